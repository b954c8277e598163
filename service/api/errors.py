"""The one table that maps domain errors to gRPC status codes.

Every servicer funnels exceptions through ``abort_with``; the proto comments document the
same table. INVALID_ARGUMENT carries google.rpc.BadRequest field violations and
RESOURCE_EXHAUSTED a google.rpc.RetryInfo plus a ``retry-after-ms`` trailer, so clients in
any language can act on them.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from service import errors
from service.domain import Outcome

STATUS_TABLE: dict[type[errors.DomainError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.BackendFailure: grpc.StatusCode.UNAVAILABLE,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
}

# Lookup has no outcome field, so outcomes that are not "the search ran" become errors
# there (documented on the Lookup RPC). Retrieve reports every outcome in-band.
LOOKUP_OUTCOME_ERRORS: dict[Outcome, type[errors.DomainError]] = {
    Outcome.TIMEOUT: errors.DeadlineExceeded,
    Outcome.BACKEND_ERROR: errors.BackendFailure,
    Outcome.BUDGET_DENIED: errors.FailedPrecondition,
    Outcome.PERMISSION_DENIED: errors.PermissionDenied,
}


def status_for(exc: errors.DomainError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_TABLE and issubclass(cls, errors.DomainError):
            return STATUS_TABLE[cls]
    return grpc.StatusCode.INTERNAL


# Status messages and field violations can echo what the caller sent (a 100 kB id, 300 bad
# enum values); they travel in HTTP/2 trailers, whose size the peer limits (8 KiB by default:
# over it the caller sees a RESOURCE_EXHAUSTED from its own transport instead of our status),
# so they are capped to stay well inside it.
MAX_MESSAGE_CHARS = 500
MAX_VIOLATIONS = 10
MAX_VIOLATION_CHARS = 200


def _cap(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def to_rpc_status(exc: errors.DomainError) -> tuple[grpc.Status, tuple[tuple[str, str], ...]]:
    code = status_for(exc)
    details: list[any_pb2.Any] = []
    trailers: tuple[tuple[str, str], ...] = ()
    if isinstance(exc, errors.InvalidArgument):
        shown = exc.violations[:MAX_VIOLATIONS]
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=_cap(v.field, MAX_VIOLATION_CHARS),
                                                            description=_cap(v.description, MAX_VIOLATION_CHARS))
                for v in shown
            ]
        )
        if len(exc.violations) > len(shown):
            bad.field_violations.add(field="request", description=f"... and {len(exc.violations) - len(shown)} more")
        packed = any_pb2.Any()
        packed.Pack(bad)
        details.append(packed)
    if isinstance(exc, errors.Overloaded):
        ms = int(exc.retry_after_s * 1000)
        info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=ms * 1_000_000))
        packed = any_pb2.Any()
        packed.Pack(info)
        details.append(packed)
        trailers = (("retry-after-ms", str(ms)),)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=_cap(str(exc)), details=details)
    return rpc_status.to_status(status), trailers


async def abort_with(
    context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
    exc: errors.DomainError,
    extra: tuple[tuple[str, str], ...] = (),
) -> None:
    """Abort the call with the mapped status, its details and trailers (abort replaces
    any trailing metadata set before, so callers pass theirs as ``extra``)."""
    status, trailers = to_rpc_status(exc)
    await context.abort(status.code, status.details, tuple(status.trailing_metadata) + trailers + extra)
