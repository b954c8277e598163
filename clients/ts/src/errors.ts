/** Typed errors: one class per gRPC status the service documents (the Python client's
 * classes), with the google.rpc details it attaches. */

import { Metadata, status as Status, type ServiceError } from "@grpc/grpc-js";

import { BadRequest, RetryInfo } from "./gen/google/rpc/error_details";
import { Status as RpcStatus } from "./gen/google/rpc/status";

/** One bad request field, e.g. "filters.collections[0]". */
export interface FieldViolation {
  field: string;
  description: string;
}

/** The canonical upper-case name of a code ("INVALID_ARGUMENT"), as the other clients print it. */
export function codeName(code: Status): string {
  return Status[code] ?? `CODE_${code}`;
}

export class RetrievalError extends Error {
  /** The `x-attempt-id` trailer when the call reached the attempt (e.g. Lookup's TIMEOUT). */
  readonly attemptId: string;

  constructor(
    readonly code: Status,
    message: string,
    attemptId = "",
  ) {
    super(message);
    this.name = new.target.name;
    this.attemptId = attemptId;
  }

  get codeName(): string {
    return codeName(this.code);
  }
}

export class InvalidArgumentError extends RetrievalError {
  constructor(
    message: string,
    readonly violations: FieldViolation[],
    attemptId = "",
  ) {
    super(Status.INVALID_ARGUMENT, message, attemptId);
  }

  get fields(): string[] {
    return this.violations.map((v) => v.field);
  }
}

/** RESOURCE_EXHAUSTED: the server is overloaded; retry after retryAfterMs. */
export class OverloadedError extends RetrievalError {
  constructor(
    message: string,
    readonly retryAfterMs: number,
    attemptId = "",
  ) {
    super(Status.RESOURCE_EXHAUSTED, message, attemptId);
  }
}

export class UnauthenticatedError extends RetrievalError {}
export class PermissionDeniedError extends RetrievalError {}
export class NotFoundError extends RetrievalError {}
/** Lookup's BUDGET_DENIED (FAILED_PRECONDITION). */
export class BudgetExhaustedError extends RetrievalError {}
/** Lookup's TIMEOUT, or the call's own deadline passed (DEADLINE_EXCEEDED). */
export class BackendTimeoutError extends RetrievalError {}
/** Lookup's BACKEND_ERROR, or the server is unreachable or draining (UNAVAILABLE). */
export class UnavailableError extends RetrievalError {}
/** The caller cancelled the call (an AbortSignal, or leaving a stream early). */
export class CancelledError extends RetrievalError {}

const BY_CODE = new Map<Status, new (code: Status, message: string, attemptId?: string) => RetrievalError>([
  [Status.UNAUTHENTICATED, UnauthenticatedError],
  [Status.PERMISSION_DENIED, PermissionDeniedError],
  [Status.NOT_FOUND, NotFoundError],
  [Status.FAILED_PRECONDITION, BudgetExhaustedError],
  [Status.DEADLINE_EXCEEDED, BackendTimeoutError],
  [Status.UNAVAILABLE, UnavailableError],
  [Status.CANCELLED, CancelledError],
]);

const BAD_REQUEST = "type.googleapis.com/google.rpc.BadRequest";
const RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo";

function first(metadata: Metadata | undefined, key: string): string {
  const values = metadata?.get(key) ?? [];
  return values.length > 0 ? String(values[0]) : "";
}

/** Translate what @grpc/grpc-js reported into a typed error. */
export function fromServiceError(err: ServiceError): RetrievalError {
  const message = err.details ?? err.message;
  const attemptId = first(err.metadata, "x-attempt-id");
  const violations: FieldViolation[] = [];
  let retryAfterMs = Number(first(err.metadata, "retry-after-ms") || 0);
  const raw = err.metadata?.get("grpc-status-details-bin") ?? [];
  if (raw.length > 0 && raw[0] instanceof Buffer) {
    for (const detail of RpcStatus.decode(raw[0]).details) {
      if (detail.typeUrl === BAD_REQUEST) {
        for (const v of BadRequest.decode(detail.value).fieldViolations) {
          violations.push({ field: v.field, description: v.description });
        }
      } else if (detail.typeUrl === RETRY_INFO && !retryAfterMs) {
        const delay = RetryInfo.decode(detail.value).retryDelay;
        retryAfterMs = delay ? delay.seconds * 1000 + delay.nanos / 1e6 : 0;
      }
    }
  }
  if (err.code === Status.INVALID_ARGUMENT) {
    return new InvalidArgumentError(message, violations, attemptId);
  }
  if (err.code === Status.RESOURCE_EXHAUSTED) {
    return new OverloadedError(message, retryAfterMs, attemptId);
  }
  const cls = BY_CODE.get(err.code) ?? RetrievalError;
  return new cls(err.code, message, attemptId);
}

export function isServiceError(err: unknown): err is ServiceError {
  return err instanceof Error && typeof (err as Partial<ServiceError>).code === "number" && "metadata" in err;
}
