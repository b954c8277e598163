"""The LedgerService's operations over a ``Ledger``: the run view, gap resolution,
citation checks, purge and retention. Transport-free: the api layer converts; store
failures become ``BackendFailure`` (UNAVAILABLE), never an empty answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from service.domain import AttemptRecord
from service.errors import BackendFailure, InvalidArgument, NotFound
from service.ledger.base import GapRecord, Ledger, LedgerUnavailable, Observation, PurgeReport, RunState, run_visible
from service.ledger.rules import Citation, Resolution, ResolutionOutcome, classify, decide, open_critical, validate_resolution
from service.ledger.writer import AttemptWriter

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PAGE = 50
MAX_PAGE = 500
# How long a read waits for this process's own pending attempt writes.
_FLUSH_S = 2.0
_DAY_MS = 86_400_000


@dataclass(frozen=True)
class Caller:
    """Who asks: a run of another owner answers exactly like an unknown run, unless
    ``sees_all`` (unrestricted internal callers)."""

    name: str
    sees_all: bool = False


@dataclass
class RunView:
    run: RunState
    gaps: list[GapRecord]
    open_critical_gaps: int
    attempts: list[AttemptRecord]
    next_page_token: str
    critical_threshold: float = 0.0


def _now_ms() -> int:
    return int(time.time() * 1000)


class LedgerOperations:
    def __init__(self, ledger: Ledger, writer: AttemptWriter, critical_threshold: float) -> None:
        self.ledger = ledger
        self.writer = writer
        self.critical_threshold = critical_threshold
        self._retention_task: asyncio.Task[None] | None = None

    async def _store(self, call: Callable[[], Awaitable[T]]) -> T:
        await self.writer.flush(_FLUSH_S)  # read-your-writes in this process
        try:
            return await call()
        except LedgerUnavailable as exc:
            raise BackendFailure(f"ledger unavailable: {exc}") from exc

    async def _run_or_404(self, run_id: str, caller: Caller) -> RunState:
        if not run_id:
            raise InvalidArgument.one("run_id", "must not be empty")
        run = await self._store(lambda: self.ledger.get_run(run_id))
        if run is not None and not run.visible_to(caller.name, caller.sees_all):
            raise NotFound(f"no run {run_id!r}")  # another principal's: exactly like an unknown id
        if run is None:
            purge = await self._store(lambda: self.ledger.purge_record(run_id))
            # Records from before owners were kept name only who purged.
            if purge is not None and run_visible(purge.owner or purge.principal, caller.name, caller.sees_all):
                raise NotFound(f"run {run_id!r} was purged at {purge.purged_at_ms} (epoch ms) by "
                               f"{purge.principal}: {purge.reason or 'no reason given'}")
            raise NotFound(f"no run {run_id!r}")
        return run

    async def get_attempt(self, attempt_id: str) -> AttemptRecord | None:
        return await self._store(lambda: self.ledger.get_attempt(attempt_id))

    async def get_run(self, run_id: str, page_size: int, page_token: str, caller: Caller) -> RunView:
        if page_size > MAX_PAGE:
            raise InvalidArgument.one("page_size", f"at most {MAX_PAGE}")
        run = await self._run_or_404(run_id, caller)
        gaps = await self._store(lambda: self.ledger.gaps(run_id))
        try:
            attempts, nxt = await self._store(
                lambda: self.ledger.list_attempts(run_id, page_token, page_size or DEFAULT_PAGE))
        except ValueError:
            raise InvalidArgument.one("page_token", "not a token this server issued") from None
        return RunView(run, gaps, open_critical(gaps, self.critical_threshold), attempts, nxt, self.critical_threshold)

    async def resolve_gap(self, run_id: str, gap_id: str, resolution: Resolution, caller: Caller) -> ResolutionOutcome:
        if not gap_id:
            raise InvalidArgument.one("gap_id", "must not be empty")
        validate_resolution(resolution)
        await self._run_or_404(run_id, caller)
        outcome: list[ResolutionOutcome] = []

        def apply(gap: GapRecord, observed: list[Observation]) -> GapRecord:
            outcome[:] = [decide(gap, observed, resolution, _now_ms())]
            return outcome[0].gap

        gap = await self._store(lambda: self.ledger.resolve_gap(run_id, gap_id, apply))
        if gap is None:
            raise NotFound(f"run {run_id!r} has no gap {gap_id!r}")
        return outcome[0]

    async def validate_citations(self, run_id: str, evidence_ids: Sequence[str], caller: Caller) -> list[Citation]:
        if not evidence_ids:
            raise InvalidArgument.one("evidence_ids", "cite at least one id")
        await self._run_or_404(run_id, caller)
        in_run = await self._store(lambda: self.ledger.observations(run_id))
        seen = {o.evidence_id for o in in_run}
        elsewhere = await self._store(
            lambda: self.ledger.observations_elsewhere(run_id, [i for i in evidence_ids if i not in seen]))
        return [classify(i, in_run, elsewhere) for i in evidence_ids]

    async def purge(self, run_id: str, reason: str, caller: Caller) -> PurgeReport:
        await self._run_or_404(run_id, caller)  # another principal's run is not found
        principal = caller.name
        report = await self._store(lambda: self.ledger.purge_run(run_id, reason, principal, _now_ms()))
        if report is None:
            raise NotFound(f"no run {run_id!r}")
        log.info("purged run %s (%s by %s): %d attempts, %d gaps, %d observations", run_id, reason, principal,
                 report.attempts, report.gaps, report.observations)
        return report

    async def purge_expired(self, days: float, now_ms: int | None = None) -> list[PurgeReport]:
        """Purge every run created more than ``days`` ago (reason "retention")."""
        cutoff = (now_ms if now_ms is not None else _now_ms()) - int(days * _DAY_MS)
        purged: list[PurgeReport] = []
        while True:
            run_ids = await self._store(lambda: self.ledger.runs_created_before(cutoff, 100))
            if not run_ids:
                return purged
            for run_id in run_ids:
                report = await self._store(
                    lambda: self.ledger.purge_run(run_id, f"retention: older than {days:g} days", "retention", _now_ms()))
                if report is not None:
                    purged.append(report)

    def start_retention(self, days: float, interval_s: float) -> None:
        if days <= 0 or self._retention_task is not None:
            return

        async def loop() -> None:
            while True:
                try:
                    purged = await self.purge_expired(days)
                    if purged:
                        log.info("retention purged %d runs", len(purged))
                except Exception as exc:  # the store may be down: try again next round
                    log.warning("retention purge failed: %s", exc)
                await asyncio.sleep(interval_s)

        self._retention_task = asyncio.get_running_loop().create_task(loop(), name="ledger-retention")

    async def close(self) -> None:
        if self._retention_task is not None:
            self._retention_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retention_task
            self._retention_task = None
