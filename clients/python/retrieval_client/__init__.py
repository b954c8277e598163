"""Python client for the retrieval.v1 gRPC service (async and sync, typed results and errors)."""

from retrieval_client.client import RetrievalClient, SyncRetrievalClient, build_request
from retrieval_client.errors import (
    BackendTimeoutError,
    BudgetExhaustedError,
    CancelledError,
    FieldViolation,
    InvalidArgumentError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    RetrievalError,
    UnauthenticatedError,
    UnavailableError,
)
from retrieval_client.ledger import (
    CitationCheck,
    CitationClass,
    Gap,
    GapState,
    LedgerClient,
    Purge,
    Replay,
    Run,
    RunAttempt,
    SyncLedgerClient,
)
from retrieval_client.tls import TlsOptions
from retrieval_client.types import Attempt, Evidence, Leg, Outcome, lookup_to_json

__all__ = [
    "TlsOptions",
    "Attempt", "BackendTimeoutError", "BudgetExhaustedError", "CancelledError", "Evidence",
    "FieldViolation", "InvalidArgumentError", "Leg", "NotFoundError", "Outcome", "OverloadedError",
    "PermissionDeniedError", "RetrievalClient", "RetrievalError", "SyncRetrievalClient",
    "UnauthenticatedError", "UnavailableError", "build_request", "lookup_to_json",
    # LedgerService
    "CitationCheck", "CitationClass", "Gap", "GapState", "LedgerClient", "Purge", "Replay", "Run", "RunAttempt",
    "SyncLedgerClient",
]
