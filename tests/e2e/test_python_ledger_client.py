"""The Python client's LedgerService wrappers against the live demo server: typed runs,
gaps, citation checks, replay and purge; async and sync."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from retrieval_client import (
    CitationClass,
    GapState,
    InvalidArgumentError,
    LedgerClient,
    NotFoundError,
    Outcome,
    RetrievalClient,
    SyncLedgerClient,
)
from retrieval_client._gen.retrieval.v1 import retrieval_pb2, types_pb2
from tests.support.harness import Live


async def test_async_ledger_client_typed_results(demo: Live) -> None:
    run = f"client-{uuid.uuid4().hex[:8]}"
    gap = retrieval_pb2.EvidenceGap(gap_id="g-1", kind=types_pb2.GAP_KIND_EXTERNAL_KNOWLEDGE, criticality=1.0,
                                    question="how to reset a password")
    async with RetrievalClient(demo.target) as client, LedgerClient(demo.target) as ledger:
        attempt = await client.retrieve("how do I reset my password", top_k=2, run_id=run, gap=gap,
                                        budget=retrieval_pb2.RunBudget(max_searches=2))
        ids = [e.evidence_id for e in attempt.evidence]
        view = await ledger.get_run(run)
        assert (view.max_searches, view.searches_used, view.searches_left) == (2, 1, 1)
        assert view.open_critical_gaps == 1 and view.gaps[0].state is GapState.OPEN and view.gaps[0].is_open
        [rec] = view.attempts
        assert rec.outcome is Outcome.EVIDENCE_FOUND and rec.evidence_ids == ids and rec.gap_id == "g-1"
        assert [a.attempt_id async for a in ledger.iter_attempts(run, page_size=1)] == [attempt.attempt_id]
        checks = await ledger.validate_citations(run, [ids[0], "nope#0@v1"])
        assert [c.classification for c in checks] == [CitationClass.OBSERVED_IN_RUN, CitationClass.UNKNOWN]
        assert checks[0].valid and not checks[1].valid
        gap_now = await ledger.resolve_gap(run, "g-1", GapState.RESOLVED, [ids[0]], note="answered by the KB")
        assert gap_now.state is GapState.RESOLVED and gap_now.reason == "answered by the KB"
        replay = await ledger.replay_attempt(attempt.attempt_id, rerun=True)
        assert [e.exact for e in replay.evidence] == [True] * len(ids)
        assert replay.evidence[0].evidence is not None and replay.evidence[0].evidence.evidence_id == ids[0]
        assert replay.rerun is not None and replay.rerun.unchanged == ids
        with pytest.raises(InvalidArgumentError) as err:
            await ledger.resolve_gap(run, "g-1", GapState.PARTIAL, [ids[0]])
        assert err.value.fields == ["missing_subclaims"]
        purge = await ledger.purge_run(run, "done")
        assert purge.attempts_deleted == 1 and purge.reason == "done"
        with pytest.raises(NotFoundError):
            await ledger.get_run(run)


async def test_sync_ledger_client(demo: Live) -> None:
    run = f"client-sync-{uuid.uuid4().hex[:8]}"
    async with RetrievalClient(demo.target) as client:
        await client.retrieve("can I get a PDF invoice", top_k=1, run_id=run)

    def use() -> None:
        with SyncLedgerClient(demo.target) as ledger:
            view = ledger.get_run(run)
            assert len(view.attempts) == 1 and list(ledger.iter_attempts(run))[0].query == "can I get a PDF invoice"
            assert ledger.purge_run(run).attempts_deleted == 1

    await asyncio.to_thread(use)
