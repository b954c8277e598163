"""The ledger contract, one suite for every store. A store's test module subclasses
``LedgerContract`` and provides the ``open_ledger`` fixture: a factory returning a started
ledger over ONE shared store (two calls = two processes, or a process and its restart)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

from service.domain import AttemptRecord, LegKind, LegReport, LegStatus, LegTiming, Outcome
from service.ledger.base import (
    BUDGET_EXHAUSTED,
    NO_GAP_IN_RUN,
    RUN_NOT_OWNED,
    AttemptEntry,
    GapRecord,
    GapState,
    Ledger,
    Observation,
    RunState,
)
from service.ledger.rules import CitationStatus, Resolution, classify, decide, open_critical

OpenLedger = Callable[[], Awaitable[Ledger]]


def rid(tag: str = "run") -> str:
    return f"{tag}-{uuid.uuid4().hex[:10]}"


def record(run_id: str, attempt_id: str, *, ms: int = 1, gap_id: str = "", outcome: Outcome = Outcome.EVIDENCE_FOUND,
           evidence: tuple[str, ...] = ()) -> AttemptRecord:
    return AttemptRecord(
        attempt_id=attempt_id, run_id=run_id, gap_id=gap_id, channel="knowledge_base", query="q",
        requested_top_k=3, outcome=outcome, stopping_reason="completed", principal="p", created_at_ms=ms,
        evidence_ids=list(evidence), retrieved_count=2, admissible_count=1,
        legs=[LegReport(LegKind.KNN, LegStatus.TIMEOUT, 12.5, 0, "slow", LegTiming(1, 2, 3))],
        budget_before=3, budget_after=2, total_ms=20.0, model_ids=["m@abc"])


def entry(run_id: str, attempt_id: str, *, ms: int = 1, gap: str = "", criticality: float = 0.9,
          outcome: Outcome = Outcome.EVIDENCE_FOUND, admitted: tuple[str, ...] = (),
          refused: tuple[str, ...] = ()) -> AttemptEntry:
    obs = [Observation(run_id, e, attempt_id, gap, True, ms) for e in admitted]
    obs += [Observation(run_id, e, attempt_id, gap, False, ms) for e in refused]
    g = GapRecord(run_id, gap, "EXTERNAL_KNOWLEDGE", "what?", "why", criticality, "tq") if gap else None
    return AttemptEntry(record(run_id, attempt_id, ms=ms, gap_id=gap, outcome=outcome, evidence=admitted), obs, g,
                        {"query": "q", "top_k": 3})


class LedgerContract:
    async def test_budget_is_reserved_atomically_under_concurrency(self, open_ledger: OpenLedger) -> None:
        ledger = await open_ledger()
        run = rid()
        decisions = await asyncio.gather(*(ledger.reserve_search(run, 5, 10) for _ in range(12)))
        assert sum(d.allowed for d in decisions) == 5
        assert sorted(d.before for d in decisions if d.allowed) == [1, 2, 3, 4, 5]
        denied = [d for d in decisions if not d.allowed]
        assert len(denied) == 7 and all(d.before == 0 == d.after and d.reason == BUDGET_EXHAUSTED for d in denied)
        state = await ledger.get_run(run)
        assert state is not None and state.searches_used == 5 and state.searches_left == 0

    async def test_two_ledgers_sharing_a_store_never_overspend(self, open_ledger: OpenLedger) -> None:
        a, b = await open_ledger(), await open_ledger()  # as two service processes have
        run = rid()
        results = await asyncio.gather(*[(a if i % 2 else b).reserve_search(run, 7, 3) for i in range(20)])
        assert sum(r.allowed for r in results) == 7
        state = await a.get_run(run)
        assert state is not None and state.searches_used == 7

    async def test_a_run_that_requires_a_gap_refuses_one_without_and_spends_nothing(self, open_ledger: OpenLedger) -> None:
        ledger = await open_ledger()
        run = rid()
        refused = await ledger.reserve_search(run, 2, 5, require_gap=True, has_gap=False)
        assert not refused.allowed and refused.reason == NO_GAP_IN_RUN and refused.before == 2
        assert (await ledger.reserve_search(run, 2, 5, has_gap=True)).allowed
        state = await ledger.get_run(run)
        assert state is not None and state.require_gap and state.searches_used == 1

    async def test_a_run_is_its_creators_another_principal_is_refused_and_spends_nothing(
            self, open_ledger: OpenLedger) -> None:
        a, b = await open_ledger(), await open_ledger()
        run = rid()
        assert (await a.reserve_search(run, 3, 5, owner="alice")).allowed
        for ledger in (a, b):  # the same answer from every process sharing the store
            refused = await ledger.reserve_search(run, 3, 5, owner="mallory")
            assert not refused.allowed and refused.reason == RUN_NOT_OWNED
            assert refused.before == refused.after == 0  # nothing of the run's budget shown
        assert (await b.reserve_search(run, 3, 5, owner="ops", sees_all=True)).allowed  # unrestricted callers may
        state = await b.get_run(run)
        assert state is not None and state.owner == "alice" and state.searches_used == 2
        assert state.visible_to("alice") and not state.visible_to("mallory") and state.visible_to("x", sees_all=True)
        # A run recorded before owners were (or by the writer first) keeps whoever made it.
        late = rid()
        await a.record([AttemptEntry(record(late, rid("a")), [], None, {}, RunState(late, 2, 2, 0, False, 5, "bob"))])
        assert (await b.reserve_search(late, 2, 2, owner="mallory")).reason == RUN_NOT_OWNED
        report = await a.purge_run(run, "done", "alice", 99)
        assert report is not None and report.owner == "alice" and (await a.purge_record(run)) == report

    async def test_attempt_roundtrip_and_request(self, open_ledger: OpenLedger) -> None:
        ledger = await open_ledger()
        run = rid()
        e = entry(run, rid("a"), admitted=("s#0@v1",))
        await ledger.record([e])
        await ledger.record([e])  # idempotent per attempt id
        assert await ledger.get_attempt(e.record.attempt_id) == e.record
        assert await ledger.attempt_request(e.record.attempt_id) == {"query": "q", "top_k": 3}
        assert await ledger.get_attempt("nope") is None
        assert [o.evidence_id for o in await ledger.observations(run)] == ["s#0@v1"]

    async def test_attempts_page_in_recorded_order(self, open_ledger: OpenLedger) -> None:
        ledger = await open_ledger()
        run = rid()
        ids = [f"a{i}" for i in range(5)]
        await ledger.reserve_search(run, 9, 9)
        await ledger.record([entry(run, f"{run}-{a}", ms=100 + i) for i, a in enumerate(ids)])
        await ledger.record([entry(rid(), "other-run-attempt-" + run, ms=101)])
        seen: list[str] = []
        token = ""
        for _ in range(4):
            page, token = await ledger.list_attempts(run, token, 2)
            seen += [r.attempt_id for r in page]
            if not token:
                break
        assert seen == [f"{run}-{a}" for a in ids]

    async def test_gap_registered_open_and_budget_exhaustion_leaves_it_unresolved(self, open_ledger: OpenLedger) -> None:
        ledger = await open_ledger()
        run = rid()
        await ledger.record([entry(run, rid("a"), gap="g1")])
        [gap] = await ledger.gaps(run)
        assert gap.state is GapState.OPEN and gap.criticality == 0.9 and gap.question == "what?"
        await ledger.record([entry(run, rid("a"), ms=2, gap="g1", outcome=Outcome.BUDGET_DENIED)])
        [gap] = await ledger.gaps(run)
        assert gap.state is GapState.UNRESOLVED and gap.reason == BUDGET_EXHAUSTED
        await ledger.record([entry(run, rid("a"), ms=3, gap="g1")])  # seeing it again changes nothing
        assert (await ledger.gaps(run))[0].state is GapState.UNRESOLVED

    async def test_resolution_accepts_only_admissible_evidence_of_the_run(self, open_ledger: OpenLedger) -> None:
        ledger = await open_ledger()
        run, other = rid(), rid()
        await ledger.record([
            entry(run, rid("a"), gap="g1", admitted=("doc#0@v2", "doc#1@v2"), refused=("draft#0@v1",)),
            entry(run, rid("a"), ms=2, gap="g2", criticality=0.9),
            entry(other, rid("a"), gap="g9", admitted=("else#0@v1",)),
        ])

        async def resolve(gap_id: str, r: Resolution) -> tuple[GapRecord, list[CitationStatus]]:
            rejected: list[CitationStatus] = []

            def apply(gap: GapRecord, obs: list[Observation]) -> GapRecord:
                out = decide(gap, obs, r, 5)
                rejected[:] = [c.status for c in out.rejected]
                return out.gap

            gap = await ledger.resolve_gap(run, gap_id, apply)
            assert gap is not None
            return gap, rejected

        gap, rejected = await resolve("g1", Resolution(GapState.RESOLVED, ("draft#0@v1",)))
        assert gap.state is GapState.UNRESOLVED and rejected == [CitationStatus.NOT_ADMISSIBLE]
        gap, rejected = await resolve("g1", Resolution(GapState.RESOLVED, ("else#0@v1",)))
        assert gap.state is GapState.UNRESOLVED and rejected == [CitationStatus.UNKNOWN]  # other runs not consulted here
        gap, rejected = await resolve("g2", Resolution(GapState.PARTIAL, ("doc#0@v2",), missing_subclaims=("price",)))
        assert gap.state is GapState.PARTIAL and gap.missing_subclaims == ["price"] and not rejected
        gap, rejected = await resolve("g1", Resolution(GapState.CONFLICTING, ("doc#0@v2",), ("doc#1@v2",)))
        assert gap.state is GapState.CONFLICTING and gap.contradicting_ids == ["doc#1@v2"] and not rejected
        gaps = await ledger.gaps(run)
        assert {g.gap_id: g.state for g in gaps} == {"g1": GapState.CONFLICTING, "g2": GapState.PARTIAL}
        assert open_critical(gaps, 0.7) == 2  # partial and conflicting keep critical gaps open
        gap, _ = await resolve("g2", Resolution(GapState.RESOLVED, ("doc#0@v2",)))
        assert gap.state is GapState.RESOLVED and open_critical(await ledger.gaps(run), 0.7) == 1
        assert await ledger.resolve_gap(run, "nope", lambda g, o: g) is None

    async def test_citations_classified_against_observations(self, open_ledger: OpenLedger) -> None:
        ledger = await open_ledger()
        run, other = rid(), rid()
        await ledger.record([entry(run, "a1" + run, admitted=("doc#0@v2",), refused=("draft#0@v1",)),
                             entry(other, "a2" + run, admitted=("else#0@v1",))])
        in_run = await ledger.observations(run)
        cited = ["doc#0@v2", "draft#0@v1", "doc#0@v1", "else#0@v1", "never#0@v1"]
        elsewhere = await ledger.observations_elsewhere(run, cited)
        assert {o.evidence_id for o in elsewhere} == {"else#0@v1"}
        assert [classify(c, in_run, elsewhere).status for c in cited] == [
            CitationStatus.OBSERVED_IN_RUN, CitationStatus.NOT_ADMISSIBLE, CitationStatus.VERSION_MISMATCH,
            CitationStatus.OBSERVED_IN_OTHER_RUN, CitationStatus.UNKNOWN]

    async def test_purge_deletes_the_run_and_records_itself(self, open_ledger: OpenLedger) -> None:
        ledger = await open_ledger()
        run, keep = rid(), rid()
        for r in (run, keep):
            await ledger.reserve_search(r, 3, 3)
            await ledger.record([entry(r, rid("a"), gap="g", admitted=("doc#0@v1",))])
        report = await ledger.purge_run(run, "user asked", "alice", 1234)
        assert report is not None and (report.attempts, report.gaps, report.observations) == (1, 1, 1)
        assert await ledger.get_run(run) is None and await ledger.gaps(run) == []
        assert (await ledger.list_attempts(run, "", 10))[0] == [] and await ledger.observations(run) == []
        assert await ledger.purge_record(run) == report
        assert await ledger.purge_run(run, "again", "alice", 1235) is None
        assert await ledger.get_run(keep) is not None and len(await ledger.observations(keep)) == 1

    async def test_runs_created_before_a_cutoff(self, open_ledger: OpenLedger) -> None:
        ledger = await open_ledger()
        run = rid()
        await ledger.reserve_search(run, 1, 1)
        state = await ledger.get_run(run)
        assert state is not None
        assert run in await ledger.runs_created_before(state.created_at_ms + 1, 10000)
        assert run not in await ledger.runs_created_before(state.created_at_ms, 10000)

    async def test_state_survives_a_restart(self, open_ledger: OpenLedger) -> None:
        first = await open_ledger()
        run = rid()
        assert (await first.reserve_search(run, 2, 4)).allowed
        await first.record([entry(run, "r" + run, gap="g", admitted=("doc#0@v1",))])
        await first.close()
        again = await open_ledger()  # a new process on the same store
        state = await again.get_run(run)
        assert state is not None and state.searches_used == 1
        assert (await again.reserve_search(run, 2, 4)).allowed
        assert not (await again.reserve_search(run, 2, 4)).allowed
        assert (await again.get_attempt("r" + run)) is not None and len(await again.gaps(run)) == 1
