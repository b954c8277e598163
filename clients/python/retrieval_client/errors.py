"""Typed errors: one class per gRPC status the service documents."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class RetrievalError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, attempt_id: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.attempt_id = attempt_id


class InvalidArgumentError(RetrievalError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, violations: list[FieldViolation], attempt_id: str = "") -> None:
        super().__init__(message, attempt_id)
        self.violations = violations

    @property
    def fields(self) -> list[str]:
        return [v.field for v in self.violations]


class OverloadedError(RetrievalError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float, attempt_id: str = "") -> None:
        super().__init__(message, attempt_id)
        self.retry_after_s = retry_after_s


class UnauthenticatedError(RetrievalError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(RetrievalError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFoundError(RetrievalError):
    code = grpc.StatusCode.NOT_FOUND


class BudgetExhaustedError(RetrievalError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class BackendTimeoutError(RetrievalError):
    """The attempt timed out in the backend (Lookup's TIMEOUT), or the call's deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnavailableError(RetrievalError):
    """The backend failed (Lookup's BACKEND_ERROR) or the server is unreachable/draining."""

    code = grpc.StatusCode.UNAVAILABLE


class CancelledError(RetrievalError):
    code = grpc.StatusCode.CANCELLED


_BY_CODE: dict[grpc.StatusCode, type[RetrievalError]] = {
    cls.code: cls
    for cls in (UnauthenticatedError, PermissionDeniedError, NotFoundError, BudgetExhaustedError,
                BackendTimeoutError, UnavailableError, CancelledError)
}


def from_rpc_error(err: Any) -> RetrievalError:
    """Translate a gRPC error (a sync ``grpc.RpcError`` call or an aio ``AioRpcError``)."""
    code = err.code()
    message = err.details() or ""
    trailers: dict[str, Any] = {str(k): v for k, v in (err.trailing_metadata() or ())}
    attempt_id = str(trailers.get("x-attempt-id", ""))
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        violations: list[FieldViolation] = []
        status = rpc_status.from_call(err)
        for detail in status.details if status else []:
            bad = error_details_pb2.BadRequest()
            if detail.Unpack(bad):
                violations += [FieldViolation(v.field, v.description) for v in bad.field_violations]
        return InvalidArgumentError(message, violations, attempt_id)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry_ms = float(trailers.get("retry-after-ms", 0) or 0)
        return OverloadedError(message, retry_ms / 1000, attempt_id)
    cls = _BY_CODE.get(code, RetrievalError)
    exc = cls(message, attempt_id)
    if cls is RetrievalError:
        exc.code = code
    return exc
