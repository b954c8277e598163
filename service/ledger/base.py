"""The ledger contract: runs with budgets, gaps with their lifecycle, attempts, and the
evidence each attempt observed. Two implementations keep it: SQLite (one host, the
embedded default) and OpenSearch (shared by every replica). tests/unit/ledger/contract.py
is the one suite both must pass.

Only storage lives behind this interface. The rules (which citation is valid, which
resolution is accepted) are pure functions in ``service.ledger.rules``, so the two stores
can never disagree about them.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.domain import AttemptRecord


class LedgerUnavailable(Exception):
    """The store could not be reached or did not answer in time (never "no data")."""


class GapState(enum.Enum):
    OPEN = "OPEN"  # registered by an attempt; nobody has judged it yet
    RESOLVED = "RESOLVED"
    PARTIAL = "PARTIAL"
    CONFLICTING = "CONFLICTING"
    UNRESOLVED = "UNRESOLVED"


@dataclass(frozen=True)
class BudgetDecision:
    allowed: bool
    before: int  # searches left before this attempt
    after: int  # searches left after it
    max_results_per_search: int
    # Why it was refused: "budget_exhausted", or "no_gap_in_run" (the run requires a gap).
    reason: str = ""


def run_visible(owner: str, caller: str, sees_all: bool = False) -> bool:
    """May ``caller`` use or read a run of ``owner``: its owner, anyone for a run without
    one, and unrestricted callers (``sees_all``)."""
    return sees_all or not owner or owner == caller


@dataclass(frozen=True)
class RunState:
    run_id: str
    max_searches: int
    max_results_per_search: int
    searches_used: int
    require_gap: bool
    created_at_ms: int
    # The principal whose attempt created the run ("" for runs recorded before owners were):
    # only it (and unrestricted callers) may spend from, read or govern the run.
    owner: str = ""

    def visible_to(self, caller: str, sees_all: bool = False) -> bool:
        return run_visible(self.owner, caller, sees_all)

    @property
    def searches_left(self) -> int:
        return max(0, self.max_searches - self.searches_used)


@dataclass
class GapRecord:
    run_id: str
    gap_id: str
    kind: str = "UNSPECIFIED"
    question: str = ""
    rationale: str = ""
    criticality: float = 0.0
    targeted_query: str = ""
    state: GapState = GapState.OPEN
    reason: str = ""
    supporting_ids: list[str] = field(default_factory=list)
    contradicting_ids: list[str] = field(default_factory=list)
    missing_subclaims: list[str] = field(default_factory=list)
    created_at_ms: int = 0
    updated_at_ms: int = 0
    resolved_by: str = ""  # principal of the last ResolveGap


@dataclass(frozen=True)
class Observation:
    """One evidence id the runtime saw in an attempt of a run."""

    run_id: str
    evidence_id: str  # source#chunk@version
    attempt_id: str
    gap_id: str
    admissible: bool  # returned to the caller (True) or retrieved but inadmissible (False)
    observed_at_ms: int

    @property
    def chunk_key(self) -> str:
        return chunk_key(self.evidence_id)


def chunk_key(evidence_id: str) -> str:
    """``source#chunk@version`` -> ``source#chunk`` (the id without its version)."""
    head, sep, _ = evidence_id.rpartition("@")
    return head if sep else evidence_id


@dataclass(frozen=True)
class AttemptEntry:
    """What one attempt writes: its record, what it observed, and the gap it served
    (registered on first sight; an exhausted budget turns an OPEN gap UNRESOLVED)."""

    record: AttemptRecord
    observations: list[Observation] = field(default_factory=list)
    gap: GapRecord | None = None
    # The request as ``service.pipeline.recording`` serialises it, so ReplayAttempt can run it again.
    request: dict[str, Any] = field(default_factory=dict)
    # The run as this attempt would create it, for attempts refused before any reservation
    # (a USER_INFORMATION gap): the run exists, with nothing spent.
    run: RunState | None = None


@dataclass(frozen=True)
class PurgeReport:
    run_id: str
    purged_at_ms: int
    reason: str
    principal: str
    attempts: int
    gaps: int
    observations: int
    owner: str = ""  # the purged run's owner: only it (and unrestricted callers) learn of the purge


GapDecision = Callable[[GapRecord, list[Observation]], GapRecord]

BUDGET_EXHAUSTED = "budget_exhausted"
NO_GAP_IN_RUN = "no_gap_in_run"
# Another principal's run: refused like a run the caller may not see (nothing spent, no budget shown).
RUN_NOT_OWNED = "run_not_owned"


def budget_decision(limit: int, used: int, per_search: int, require_gap: bool, has_gap: bool,
                    owned: bool = True) -> BudgetDecision:
    """The one budget rule both stores apply to the run's current state (``owned``: the
    caller may use the run, ``RunState.visible_to``)."""
    if not owned:
        return BudgetDecision(False, 0, 0, per_search, RUN_NOT_OWNED)
    before = max(0, limit - used)
    if require_gap and not has_gap:
        return BudgetDecision(False, before, before, per_search, NO_GAP_IN_RUN)
    if before == 0:
        return BudgetDecision(False, 0, 0, per_search, BUDGET_EXHAUSTED)
    return BudgetDecision(True, before, before - 1, per_search)


def registered_gap(existing: GapRecord | None, seen: GapRecord, budget_denied: bool, now_ms: int) -> GapRecord:
    """A gap as an attempt leaves it: first sight registers it OPEN; an attempt refused for
    budget leaves an OPEN gap UNRESOLVED with that reason (an exhausted budget never
    resolves anything)."""
    gap = existing or GapRecord(**{**seen.__dict__, "created_at_ms": now_ms, "updated_at_ms": now_ms})
    if budget_denied and gap.state is GapState.OPEN:
        gap.state, gap.reason, gap.updated_at_ms = GapState.UNRESOLVED, BUDGET_EXHAUSTED, now_ms
    return gap


class Ledger(abc.ABC):
    """Async; no method blocks the event loop. Failures to reach the store raise
    ``LedgerUnavailable``."""

    kind: str

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def reserve_search(
        self, run_id: str, max_searches: int, max_results_per_search: int, *,
        require_gap: bool = False, has_gap: bool = True, owner: str = "", sees_all: bool = False,
    ) -> BudgetDecision:
        """Spend one search of the run atomically (creating the run with this budget,
        policy and ``owner`` on first use). A run of another owner is refused
        (RUN_NOT_OWNED) unless ``sees_all``. Refusals spend nothing."""

    @abc.abstractmethod
    async def record(self, entries: Sequence[AttemptEntry]) -> None:
        """Write attempts (idempotent per attempt id), their observations and gaps."""

    @abc.abstractmethod
    async def get_attempt(self, attempt_id: str) -> AttemptRecord | None: ...

    @abc.abstractmethod
    async def attempt_request(self, attempt_id: str) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    async def get_run(self, run_id: str) -> RunState | None: ...

    @abc.abstractmethod
    async def list_attempts(self, run_id: str, after: str, limit: int) -> tuple[list[AttemptRecord], str]:
        """Attempts of the run in the order they were recorded (created_at_ms, then id),
        after the opaque cursor ``after``; returns the page and the next cursor ("" at
        the end)."""

    @abc.abstractmethod
    async def gaps(self, run_id: str) -> list[GapRecord]: ...

    @abc.abstractmethod
    async def resolve_gap(self, run_id: str, gap_id: str, decide: GapDecision) -> GapRecord | None:
        """Read the gap and the run's observations, apply ``decide`` and store its answer
        atomically (a concurrent change of the gap makes it decide again). None: no gap."""

    @abc.abstractmethod
    async def observations(self, run_id: str) -> list[Observation]: ...

    @abc.abstractmethod
    async def observations_elsewhere(self, run_id: str, evidence_ids: Sequence[str]) -> list[Observation]:
        """Observations of exactly these ids in runs other than ``run_id``."""

    @abc.abstractmethod
    async def purge_run(self, run_id: str, reason: str, principal: str, now_ms: int) -> PurgeReport | None:
        """Delete the run, its gaps, attempts and observations, and record the purge.
        None when there is no such run."""

    @abc.abstractmethod
    async def purge_record(self, run_id: str) -> PurgeReport | None: ...

    @abc.abstractmethod
    async def runs_created_before(self, cutoff_ms: int, limit: int) -> list[str]: ...
