"""Domain errors. The transport maps each class to one gRPC status in one table
(``service.api.errors``); nothing below the api layer knows about gRPC."""

from __future__ import annotations

from dataclasses import dataclass


class DomainError(Exception):
    """Base class: a failure the caller should see as a status, not a crash."""


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class InvalidArgument(DomainError):
    def __init__(self, violations: list[FieldViolation]) -> None:
        self.violations = violations
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in violations))

    @classmethod
    def one(cls, field: str, description: str) -> InvalidArgument:
        return cls([FieldViolation(field, description)])


class Overloaded(DomainError):
    """Too much work in flight; the caller should retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message)


class Unauthenticated(DomainError):
    pass


class NotFound(DomainError):
    pass


class ShuttingDown(DomainError):
    pass


class DeadlineExceeded(DomainError):
    """The caller's deadline passed before the work could run (also: dropped from a
    model queue because its deadline had passed)."""


class BackendFailure(DomainError):
    """A backend (engine, model runtime) failed; used where no attempt outcome can carry it."""


class FailedPrecondition(DomainError):
    pass


class PermissionDenied(DomainError):
    pass
