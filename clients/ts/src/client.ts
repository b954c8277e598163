/**
 * The TypeScript client of the retrieval.v1 service (Node 20, @grpc/grpc-js).
 *
 *   const client = new RetrievalClient("127.0.0.1:50051", { apiKey });
 *   const attempt = await client.retrieve("refund policy", { topK: 3 });
 *   if (attempt.outcome.isInfrastructureFailure()) { ... } // TIMEOUT / BACKEND_ERROR
 *
 * Every call has a deadline (timeoutMs, default 10 s, when the caller gives none);
 * only idempotent unary calls are retried, and only on UNAVAILABLE.
 */

import {
  type CallOptions as GrpcCallOptions,
  type ChannelCredentials,
  type ClientOptions as GrpcClientOptions,
  type ClientUnaryCall,
  credentials,
  Metadata,
  type ServiceError,
  status as Status,
} from "@grpc/grpc-js";

import { CancelledError, fromServiceError, isServiceError, RetrievalError } from "./errors";
import { CorpusServiceClient, type GetEvidenceResponse } from "./gen/retrieval/v1/corpus";
import {
  type AttemptRecord,
  type GetAttemptResponse,
  type LookupResult,
  RetrievalServiceClient,
  type RetrieveEvent,
  RetrieveRequest,
} from "./gen/retrieval/v1/retrieval";
import { Collection, LegKind, RerankMode } from "./gen/retrieval/v1/types";
import { type Attempt, type Event, type Evidence, eventOf, type ToolResult, toolResultOf } from "./types";

/** The deadline of a call whose caller gives none (the server's default is 10 s too). */
export const DEFAULT_TIMEOUT_MS = 10_000;
/** top_k when the caller gives none, as the other clients. */
export const DEFAULT_TOP_K = 10;

export interface TlsOptions {
  /** PEM roots to trust; the system roots when absent. */
  rootCerts?: Buffer;
  /** PEM client key and certificate for mutual TLS. */
  privateKey?: Buffer;
  certChain?: Buffer;
}

export interface ClientOptions {
  /** Sent as `x-api-key`; the server maps it to a principal and its ACL groups. */
  apiKey?: string;
  /** TLS (true: system roots). Plaintext without it, as the default loopback listener expects. */
  tls?: boolean | TlsOptions;
  /** Deadline of calls that set none (DEFAULT_TIMEOUT_MS). */
  timeoutMs?: number;
  /** Tries in all for an idempotent unary call failing with UNAVAILABLE (default 3). */
  maxAttempts?: number;
  /** First wait between those tries, doubled after each (default 200 ms). */
  retryBackoffMs?: number;
  /** Passed to the @grpc/grpc-js client: channel options ("grpc.keepalive_time_ms", ...), interceptors. */
  grpcOptions?: GrpcClientOptions;
}

/** One attempt's request in plain values. Unknown names (a collection "wiki") are sent as
 * UNSPECIFIED, which the server rejects with INVALID_ARGUMENT naming the field. */
export interface RetrieveOptions {
  topK?: number;
  /** Groups attempts into a run; budget creates the run on its first attempt. */
  runId?: string;
  budget?: { maxSearches?: number; maxResultsPerSearch?: number };
  collections?: string[]; // "doc", "faq"
  sourceIds?: string[];
  metadata?: Record<string, string>;
  legs?: string[]; // "bm25", "knn", "knn_latin"
  rerank?: boolean;
  minQuality?: number;
  maxContextChars?: number;
  toolCallId?: string;
  versionPins?: Record<string, string>;
}

export interface CallOptions {
  /** This call's deadline in ms from now (the client's timeoutMs otherwise). */
  timeoutMs?: number;
  /** Cancels the call; the stream or promise then fails with CancelledError. */
  signal?: AbortSignal;
}

const COLLECTIONS: Record<string, Collection> = { doc: Collection.COLLECTION_DOC, faq: Collection.COLLECTION_FAQ };
const LEGS: Record<string, LegKind> = {
  bm25: LegKind.LEG_KIND_BM25,
  knn: LegKind.LEG_KIND_KNN,
  knn_latin: LegKind.LEG_KIND_KNN_LATIN,
};

/** The request as sent. */
export function buildRequest(query: string, o: RetrieveOptions = {}): RetrieveRequest {
  return RetrieveRequest.fromPartial({
    query,
    topK: o.topK ?? DEFAULT_TOP_K,
    runId: o.runId ?? "",
    toolCallId: o.toolCallId ?? "",
    versionPins: o.versionPins ?? {},
    filters: {
      collections: (o.collections ?? []).map((c) => COLLECTIONS[c] ?? Collection.COLLECTION_UNSPECIFIED),
      sourceIds: o.sourceIds ?? [],
      metadata: o.metadata ?? {},
    },
    options: {
      legs: (o.legs ?? []).map((l) => LEGS[l] ?? LegKind.LEG_KIND_UNSPECIFIED),
      rerank:
        o.rerank === undefined
          ? RerankMode.RERANK_MODE_UNSPECIFIED
          : o.rerank
            ? RerankMode.RERANK_MODE_ON
            : RerankMode.RERANK_MODE_OFF,
      minQuality: o.minQuality ?? 0,
      maxContextChars: o.maxContextChars ?? 0,
    },
    ...(o.budget
      ? { budget: { maxSearches: o.budget.maxSearches ?? 0, maxResultsPerSearch: o.budget.maxResultsPerSearch ?? 0 } }
      : {}),
  });
}

type Unary<T> = (
  metadata: Metadata,
  options: Partial<GrpcCallOptions>,
  callback: (err: ServiceError | null, value?: T) => void,
) => ClientUnaryCall;

export class RetrievalClient {
  /** The generated stubs, for what the wrapper does not cover. */
  readonly retrieval: RetrievalServiceClient;
  readonly corpus: CorpusServiceClient;
  private readonly apiKey: string;
  private readonly timeoutMs: number;
  private readonly maxAttempts: number;
  private readonly retryBackoffMs: number;

  constructor(target: string, options: ClientOptions = {}) {
    const creds: ChannelCredentials = options.tls
      ? options.tls === true
        ? credentials.createSsl()
        : credentials.createSsl(options.tls.rootCerts ?? null, options.tls.privateKey ?? null, options.tls.certChain ?? null)
      : credentials.createInsecure();
    this.retrieval = new RetrievalServiceClient(target, creds, options.grpcOptions);
    // One channel for both services: the second stub reuses the first one's.
    this.corpus = new CorpusServiceClient(target, creds, {
      ...options.grpcOptions,
      channelOverride: this.retrieval.getChannel(),
    });
    this.apiKey = options.apiKey ?? "";
    this.timeoutMs = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    this.maxAttempts = Math.max(1, options.maxAttempts ?? 3);
    this.retryBackoffMs = options.retryBackoffMs ?? 200;
  }

  close(): void {
    this.retrieval.close();
  }

  private metadata(): Metadata {
    const md = new Metadata();
    if (this.apiKey) md.set("x-api-key", this.apiKey);
    return md;
  }

  private deadline(call: CallOptions): number {
    return Date.now() + (call.timeoutMs ?? this.timeoutMs);
  }

  /** The attempt's events as they arrive: a leg per leg, the evidence in rank order, then
   * the result, always last. Leaving the loop early cancels the call. */
  async *events(query: string, options: RetrieveOptions & CallOptions = {}): AsyncGenerator<Event, void, undefined> {
    const { signal } = options;
    if (signal?.aborted) throw new CancelledError(Status.CANCELLED, "cancelled before the call started");
    const call = this.retrieval.retrieve(buildRequest(query, options), this.metadata(), {
      deadline: this.deadline(options),
    });
    const abort = (): void => call.cancel();
    signal?.addEventListener("abort", abort, { once: true });
    try {
      for await (const message of call as AsyncIterable<RetrieveEvent>) {
        // Once the caller cancelled, the stream ends here, even with events still buffered.
        if (signal?.aborted) throw new CancelledError(Status.CANCELLED, "cancelled by the caller");
        yield eventOf(message);
      }
    } catch (err) {
      if (err instanceof RetrievalError) throw err;
      if (signal?.aborted) throw new CancelledError(Status.CANCELLED, "cancelled by the caller");
      throw isServiceError(err) ? fromServiceError(err) : err;
    } finally {
      signal?.removeEventListener("abort", abort);
      call.cancel(); // no-op once the stream ended; stops it when the caller left early
    }
  }

  /** Runs one attempt and collects it. Outcomes are in-band (attempt.outcome); a thrown
   * RetrievalError is a transport-level failure. */
  async retrieve(query: string, options: RetrieveOptions & CallOptions = {}): Promise<Attempt> {
    const evidence: Evidence[] = [];
    for await (const event of this.events(query, options)) {
      if (event.kind === "evidence") evidence.push(event.evidence);
      else if (event.kind === "result") return { ...event.result, evidence };
    }
    throw new RetrievalError(Status.INTERNAL, "stream ended without an AttemptResult");
  }

  /** The agent projection, ready for a tool result (JSON.stringify it). Outcomes that are
   * not "the search ran" throw: BackendTimeoutError, UnavailableError,
   * BudgetExhaustedError, PermissionDeniedError. Retried on UNAVAILABLE only without a
   * runId: with one, every try would spend the run's budget. */
  async lookup(query: string, options: RetrieveOptions & CallOptions = {}): Promise<ToolResult> {
    const request = buildRequest(query, options);
    const result = await this.unary<LookupResult>(!options.runId, options, (md, opts, cb) =>
      this.retrieval.lookup(request, md, opts, cb),
    );
    return toolResultOf(result);
  }

  /** One recorded attempt from the ledger (NotFoundError when unknown). */
  async getAttempt(attemptId: string, options: CallOptions = {}): Promise<AttemptRecord | undefined> {
    const res = await this.unary<GetAttemptResponse>(true, options, (md, opts, cb) => this.retrieval.getAttempt({ attemptId }, md, opts, cb));
    return res.attempt;
  }

  /** The exact text of one `source#chunk@version`. */
  async getEvidence(evidenceId: string, options: CallOptions = {}): Promise<GetEvidenceResponse> {
    return this.unary<GetEvidenceResponse>(true, options, (md, opts, cb) => this.corpus.getEvidence({ evidenceId }, md, opts, cb));
  }

  private async unary<T>(idempotent: boolean, call: CallOptions, invoke: Unary<T>): Promise<T> {
    const deadline = this.deadline(call);
    let wait = this.retryBackoffMs;
    for (let attempt = 1; ; attempt++) {
      try {
        return await this.once(invoke, deadline, call.signal);
      } catch (err) {
        const retry =
          idempotent &&
          err instanceof RetrievalError &&
          err.code === Status.UNAVAILABLE &&
          attempt < this.maxAttempts &&
          Date.now() + wait < deadline &&
          !call.signal?.aborted;
        if (!retry) throw err;
        await new Promise((resolve) => setTimeout(resolve, wait));
        wait *= 2;
      }
    }
  }

  private once<T>(invoke: Unary<T>, deadline: number, signal: AbortSignal | undefined): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      if (signal?.aborted) {
        reject(new CancelledError(Status.CANCELLED, "cancelled before the call started"));
        return;
      }
      const pending = invoke(this.metadata(), { deadline }, (err, value) => {
        signal?.removeEventListener("abort", abort);
        if (err) reject(signal?.aborted ? new CancelledError(Status.CANCELLED, "cancelled by the caller") : fromServiceError(err));
        else resolve(value as T);
      });
      const abort = (): void => pending.cancel();
      signal?.addEventListener("abort", abort, { once: true });
    });
  }
}
