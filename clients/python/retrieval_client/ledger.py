"""Typed client for retrieval.v1.LedgerService: a run's view, gap resolutions, citation
checks, replay and purge.

    async with LedgerClient("127.0.0.1:50051") as ledger:
        run = await ledger.get_run("run-1")
        if run.open_critical_gaps: ...
        checks = await ledger.validate_citations("run-1", ["kb-billing#0@v1"])

Errors are the package's typed errors (NotFoundError, InvalidArgumentError naming the
field, UnavailableError when the ledger cannot be reached, ...).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from retrieval_client.tls import TlsOptions, aio_channel, sync_channel
from retrieval_client._gen.retrieval.v1 import corpus_pb2, ledger_pb2, ledger_pb2_grpc, types_pb2
from retrieval_client.errors import from_rpc_error
from retrieval_client.types import Evidence, Leg, Outcome

Metadata = tuple[tuple[str, str], ...]


class GapState(enum.Enum):
    OPEN = "OPEN"
    RESOLVED = "RESOLVED"
    PARTIAL = "PARTIAL"
    CONFLICTING = "CONFLICTING"
    UNRESOLVED = "UNRESOLVED"


class CitationClass(enum.Enum):
    OBSERVED_IN_RUN = "OBSERVED_IN_RUN"
    OBSERVED_IN_OTHER_RUN = "OBSERVED_IN_OTHER_RUN"
    UNKNOWN = "UNKNOWN"
    VERSION_MISMATCH = "VERSION_MISMATCH"
    NOT_ADMISSIBLE = "NOT_ADMISSIBLE"


def _enum_name(enum_type: Any, value: int, prefix: str) -> str:
    return str(enum_type.Name(value)).removeprefix(prefix)


@dataclass(frozen=True)
class CitationCheck:
    evidence_id: str
    classification: CitationClass
    attempt_ids: list[str]
    observed_evidence_ids: list[str]

    @property
    def valid(self) -> bool:
        return self.classification is CitationClass.OBSERVED_IN_RUN

    @classmethod
    def from_pb(cls, m: ledger_pb2.CitationCheck) -> CitationCheck:
        return cls(m.evidence_id, CitationClass(_enum_name(ledger_pb2.CitationClass, m.classification, "CITATION_CLASS_")),
                   list(m.attempt_ids), list(m.observed_evidence_ids))


@dataclass(frozen=True)
class Gap:
    gap_id: str
    kind: str  # "USER_INFORMATION" | "EXTERNAL_KNOWLEDGE" | "UNSPECIFIED"
    question: str
    criticality: float
    critical: bool
    state: GapState
    reason: str
    supporting_evidence_ids: list[str]
    contradicting_evidence_ids: list[str]
    missing_subclaims: list[str]
    resolved_by: str
    rejected: list[CitationCheck] = field(default_factory=list)  # ResolveGap only

    @property
    def is_open(self) -> bool:
        return self.state is not GapState.RESOLVED

    @classmethod
    def from_pb(cls, m: ledger_pb2.Gap) -> Gap:
        return cls(m.gap_id, _enum_name(types_pb2.GapKind, m.kind, "GAP_KIND_"), m.question, m.criticality, m.critical,
                   GapState(_enum_name(ledger_pb2.GapState, m.state, "GAP_STATE_")), m.reason,
                   list(m.supporting_evidence_ids), list(m.contradicting_evidence_ids), list(m.missing_subclaims),
                   m.resolved_by, [CitationCheck.from_pb(c) for c in m.rejected])


@dataclass(frozen=True)
class RunAttempt:
    attempt_id: str
    gap_id: str
    query: str
    plan_reason: str
    evidence_ids: list[str]
    retrieved_count: int
    admissible_count: int
    outcome: Outcome
    stopping_reason: str
    legs: list[Leg]
    budget_before: int | None
    budget_after: int | None
    principal: str
    model_ids: list[str]
    created_at_ms: int

    @classmethod
    def from_pb(cls, m: ledger_pb2.RunAttempt) -> RunAttempt:
        return cls(m.attempt_id, m.gap_id, m.query, m.plan_reason, [e.evidence_id for e in m.evidence],
                   m.retrieved_count, m.admissible_count,
                   Outcome(_enum_name(types_pb2.AttemptOutcome, m.outcome, "ATTEMPT_OUTCOME_")), m.stopping_reason,
                   [Leg.from_pb(x) for x in m.legs], m.budget_before if m.HasField("budget_before") else None,
                   m.budget_after if m.HasField("budget_after") else None, m.principal, list(m.model_ids),
                   m.created_at_ms)


@dataclass(frozen=True)
class Run:
    """One page of a run: its budget, gaps and attempts."""

    run_id: str
    max_searches: int
    max_results_per_search: int
    searches_used: int
    searches_left: int
    require_gap: bool
    gaps: list[Gap]
    open_critical_gaps: int
    attempts: list[RunAttempt]
    next_page_token: str

    @classmethod
    def from_pb(cls, m: ledger_pb2.Run) -> Run:
        b = m.budget
        return cls(m.run_id, b.max_searches, b.max_results_per_search, b.searches_used, b.searches_left,
                   m.require_gap, [Gap.from_pb(g) for g in m.gaps], m.open_critical_gaps,
                   [RunAttempt.from_pb(a) for a in m.attempts], m.next_page_token)


@dataclass(frozen=True)
class ReplayedEvidence:
    evidence_id: str
    exact: bool  # False: that version is gone (fidelity degraded); nothing was substituted
    evidence: Evidence | None
    available_versions: list[str]


@dataclass(frozen=True)
class Rerun:
    attempt_id: str
    outcome: Outcome
    added: list[str]
    dropped: list[str]
    new_versions: list[tuple[str, str]]  # (observed then, returned today)
    unchanged: list[str]


@dataclass(frozen=True)
class Replay:
    attempt_id: str
    run_id: str
    query: str
    evidence: list[ReplayedEvidence]
    rerun: Rerun | None

    @classmethod
    def from_pb(cls, m: ledger_pb2.ReplayAttemptResponse) -> Replay:
        items = [ReplayedEvidence(e.evidence_id, e.fidelity == corpus_pb2.FIDELITY_EXACT,
                                  Evidence.from_pb(e.evidence) if e.HasField("evidence") else None,
                                  list(e.available_versions)) for e in m.evidence]
        rerun = None
        if m.HasField("rerun"):
            r = m.rerun
            rerun = Rerun(r.rerun_attempt_id, Outcome(_enum_name(types_pb2.AttemptOutcome, r.outcome, "ATTEMPT_OUTCOME_")),
                          list(r.added), list(r.dropped),
                          [(v.observed_evidence_id, v.current_evidence_id) for v in r.new_versions], list(r.unchanged))
        return cls(m.attempt_id, m.run_id, m.query, items, rerun)


@dataclass(frozen=True)
class Purge:
    run_id: str
    purged_at_ms: int
    reason: str
    principal: str
    attempts_deleted: int
    gaps_deleted: int
    observations_deleted: int

    @classmethod
    def from_pb(cls, m: ledger_pb2.PurgeRecord) -> Purge:
        return cls(m.run_id, m.purged_at_ms, m.reason, m.principal, m.attempts_deleted, m.gaps_deleted,
                   m.observations_deleted)


def resolve_request(run_id: str, gap_id: str, state: GapState, supporting: Sequence[str] = (),
                    contradicting: Sequence[str] = (), missing_subclaims: Sequence[str] = (),
                    note: str = "") -> ledger_pb2.ResolveGapRequest:
    return ledger_pb2.ResolveGapRequest(
        run_id=run_id, gap_id=gap_id, resolution=ledger_pb2.GapState.Value(f"GAP_STATE_{state.value}"),
        supporting_evidence_ids=list(supporting), contradicting_evidence_ids=list(contradicting),
        missing_subclaims=list(missing_subclaims), note=note)


class LedgerClient:
    """Asynchronous LedgerService client (grpc.aio). Pass ``channel`` to share one with a
    RetrievalClient."""

    def __init__(self, target: str, *, api_key: str = "", timeout: float = 10.0,
                 channel: grpc.aio.Channel | None = None, tls: TlsOptions | None = None) -> None:
        self._channel = channel or aio_channel(target, tls)
        self._owns_channel = channel is None
        self._metadata: Metadata = (("x-api-key", api_key),) if api_key else ()
        self.timeout = timeout
        self._stub = ledger_pb2_grpc.LedgerServiceStub(self._channel)

    async def __aenter__(self) -> LedgerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_channel:
            await self._channel.close()

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None

    async def get_run(self, run_id: str, page_size: int = 0, page_token: str = "") -> Run:
        """One page of the run (``next_page_token`` empty on the last)."""
        return Run.from_pb(await self._call(self._stub.GetRun, ledger_pb2.GetRunRequest(
            run_id=run_id, page_size=page_size, page_token=page_token)))

    async def iter_attempts(self, run_id: str, page_size: int = 100) -> AsyncIterator[RunAttempt]:
        """Every attempt of the run, in order, page after page."""
        token = ""
        while True:
            run = await self.get_run(run_id, page_size, token)
            for attempt in run.attempts:
                yield attempt
            token = run.next_page_token
            if not token:
                return

    async def resolve_gap(self, run_id: str, gap_id: str, state: GapState, supporting: Sequence[str] = (), *,
                          contradicting: Sequence[str] = (), missing_subclaims: Sequence[str] = (),
                          note: str = "") -> Gap:
        return Gap.from_pb(await self._call(self._stub.ResolveGap, resolve_request(
            run_id, gap_id, state, supporting, contradicting, missing_subclaims, note)))

    async def validate_citations(self, run_id: str, evidence_ids: Sequence[str]) -> list[CitationCheck]:
        res = await self._call(self._stub.ValidateCitations, ledger_pb2.ValidateCitationsRequest(
            run_id=run_id, evidence_ids=list(evidence_ids)))
        return [CitationCheck.from_pb(c) for c in res.citations]

    async def replay_attempt(self, attempt_id: str, *, rerun: bool = False) -> Replay:
        return Replay.from_pb(await self._call(self._stub.ReplayAttempt, ledger_pb2.ReplayAttemptRequest(
            attempt_id=attempt_id, rerun=rerun)))

    async def purge_run(self, run_id: str, reason: str = "") -> Purge:
        res = await self._call(self._stub.PurgeRun, ledger_pb2.PurgeRunRequest(run_id=run_id, reason=reason))
        return Purge.from_pb(res.purge)


class SyncLedgerClient:
    """Blocking LedgerService client."""

    def __init__(self, target: str, *, api_key: str = "", timeout: float = 10.0,
                 tls: TlsOptions | None = None) -> None:
        self._channel = sync_channel(target, tls)
        self._metadata: Metadata = (("x-api-key", api_key),) if api_key else ()
        self.timeout = timeout
        self._stub = ledger_pb2_grpc.LedgerServiceStub(self._channel)

    def __enter__(self) -> SyncLedgerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def get_run(self, run_id: str, page_size: int = 0, page_token: str = "") -> Run:
        return Run.from_pb(self._call(self._stub.GetRun, ledger_pb2.GetRunRequest(
            run_id=run_id, page_size=page_size, page_token=page_token)))

    def iter_attempts(self, run_id: str, page_size: int = 100) -> Iterator[RunAttempt]:
        token = ""
        while True:
            run = self.get_run(run_id, page_size, token)
            yield from run.attempts
            token = run.next_page_token
            if not token:
                return

    def resolve_gap(self, run_id: str, gap_id: str, state: GapState, supporting: Sequence[str] = (), *,
                    contradicting: Sequence[str] = (), missing_subclaims: Sequence[str] = (), note: str = "") -> Gap:
        return Gap.from_pb(self._call(self._stub.ResolveGap, resolve_request(
            run_id, gap_id, state, supporting, contradicting, missing_subclaims, note)))

    def validate_citations(self, run_id: str, evidence_ids: Sequence[str]) -> list[CitationCheck]:
        res = self._call(self._stub.ValidateCitations, ledger_pb2.ValidateCitationsRequest(
            run_id=run_id, evidence_ids=list(evidence_ids)))
        return [CitationCheck.from_pb(c) for c in res.citations]

    def replay_attempt(self, attempt_id: str, *, rerun: bool = False) -> Replay:
        return Replay.from_pb(self._call(self._stub.ReplayAttempt, ledger_pb2.ReplayAttemptRequest(
            attempt_id=attempt_id, rerun=rerun)))

    def purge_run(self, run_id: str, reason: str = "") -> Purge:
        res = self._call(self._stub.PurgeRun, ledger_pb2.PurgeRunRequest(run_id=run_id, reason=reason))
        return Purge.from_pb(res.purge)
