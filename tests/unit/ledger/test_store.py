from __future__ import annotations

import asyncio
from pathlib import Path

from service.domain import AttemptRecord, LegKind, LegReport, LegStatus, LegTiming, Outcome
from service.ledger.store import Ledger


async def test_budget_is_reserved_atomically_under_concurrency(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.sqlite3")
    await ledger.start()
    decisions = await asyncio.gather(*(ledger.reserve_search("run-1", 5, 10) for _ in range(12)))
    assert sum(d.allowed for d in decisions) == 5
    befores = sorted(d.before for d in decisions if d.allowed)
    assert befores == [1, 2, 3, 4, 5]
    denied = [d for d in decisions if not d.allowed]
    assert len(denied) == 7 and all(d.before == 0 == d.after for d in denied)
    await ledger.close()


async def test_two_processes_sharing_a_file_never_overspend(tmp_path: Path) -> None:
    # Two Ledger objects = two connections to one file, as two service processes have.
    a, b = Ledger(tmp_path / "l.sqlite3"), Ledger(tmp_path / "l.sqlite3")
    await a.start()
    await b.start()
    results = await asyncio.gather(*[(a if i % 2 else b).reserve_search("r", 7, 3) for i in range(20)])
    assert sum(r.allowed for r in results) == 7
    await a.close()
    await b.close()


async def test_attempt_roundtrip_and_observed_evidence(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.sqlite3")
    await ledger.start()
    rec = AttemptRecord(
        attempt_id="a1", run_id="r1", gap_id="g1", channel="knowledge_base", query="q",
        requested_top_k=3, outcome=Outcome.TIMEOUT, stopping_reason="legs_failed_no_hits",
        principal="p", created_at_ms=1, evidence_ids=["s#0@v1"], retrieved_count=2,
        admissible_count=1, legs=[LegReport(LegKind.KNN, LegStatus.TIMEOUT, 12.5, 0, "slow", LegTiming(1, 2, 3))],
        budget_before=3, budget_after=2, total_ms=20.0, model_ids=["m@abc"],
    )
    await ledger.record_attempt(rec)
    assert await ledger.get_attempt("a1") == rec
    assert await ledger.get_attempt("nope") is None
    assert await ledger.observed_evidence("r1") == {"s#0@v1"}
    await ledger.close()
