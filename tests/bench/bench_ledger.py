"""Ledger benchmark: what the ledger adds to one attempt, per store, against a no-op
ledger in the same run (interleaved, so machine drift hits every variant alike).

    .venv/bin/python tests/bench/bench_ledger.py [--attempts 300] [--opensearch-url URL]

Each attempt runs in a run (so it reserves a search) through the real pipeline (embedded
engine with the demo corpus, e5-small int8, hybrid BM25 + kNN, no reranker). Printed per
ledger: p50/p95 of the reservation the caller waits on (the only ledger round trip on the
caller's path; records are written by the background writer), p50/p95 of the whole
attempt, and the ratio of the attempt's p50/p95 to the no-op ledger's; plus how long the
background writer took to land every record. Without --opensearch-url (or OPENSEARCH_URL)
the OpenSearch ledger is left out.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from service.app import App  # noqa: E402
from service.config import Config  # noqa: E402
from service.demo.corpus import DEMO_DOCUMENTS  # noqa: E402
from service.domain import AttemptRecord  # noqa: E402
from service.eval.metrics import percentile  # noqa: E402
from service.ingest.documents import DocumentInput  # noqa: E402
from service.ledger.base import (  # noqa: E402
    AttemptEntry,
    BudgetDecision,
    GapDecision,
    GapRecord,
    Ledger,
    Observation,
    PurgeReport,
    RunState,
)
from service.ledger.opensearch import OpenSearchLedger  # noqa: E402
from service.ledger.sqlite import SqliteLedger  # noqa: E402
from service.ledger.writer import AttemptWriter  # noqa: E402
from service.pipeline.attempt import AttemptRunner, ResultEvent  # noqa: E402
from service.pipeline.request import ANONYMOUS, AttemptRequest  # noqa: E402
from tests.support.opensearch import bench_node_or_none  # noqa: E402

QUERIES = ["how do I reset my password", "如何开具发票", "what is new in v2.4", "refund policy",
           "退款需要多长时间", "cancel subscription", "两步验证", "how long are deleted files kept"]


class NoopLedger(Ledger):
    """Allows every search and keeps nothing: the baseline."""

    kind = "noop"

    async def start(self) -> None: ...
    async def close(self) -> None: ...

    async def reserve_search(self, run_id: str, max_searches: int, max_results_per_search: int, *,
                             require_gap: bool = False, has_gap: bool = True) -> BudgetDecision:
        return BudgetDecision(True, max_searches, max_searches - 1, max_results_per_search)

    async def record(self, entries: Sequence[AttemptEntry]) -> None: ...
    async def get_attempt(self, attempt_id: str) -> AttemptRecord | None: return None
    async def attempt_request(self, attempt_id: str) -> dict[str, Any] | None: return None
    async def get_run(self, run_id: str) -> RunState | None: return None
    async def list_attempts(self, run_id: str, after: str, limit: int) -> tuple[list[AttemptRecord], str]: return [], ""
    async def gaps(self, run_id: str) -> list[GapRecord]: return []
    async def resolve_gap(self, run_id: str, gap_id: str, decide: GapDecision) -> GapRecord | None: return None
    async def observations(self, run_id: str) -> list[Observation]: return []
    async def observations_elsewhere(self, run_id: str, evidence_ids: Sequence[str]) -> list[Observation]: return []
    async def purge_run(self, run_id: str, reason: str, principal: str, now_ms: int) -> PurgeReport | None: return None
    async def purge_record(self, run_id: str) -> PurgeReport | None: return None
    async def runs_created_before(self, cutoff_ms: int, limit: int) -> list[str]: return []


class TimedLedger:
    """Times reserve_search on a real ledger (what the caller waits on)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.reserve_ms: list[float] = []
        original = ledger.reserve_search

        async def timed(*args: Any, **kwargs: Any) -> BudgetDecision:
            t0 = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                self.reserve_ms.append((time.perf_counter() - t0) * 1000)

        ledger.reserve_search = timed  # type: ignore[method-assign]


async def one_attempt(runner: AttemptRunner, query: str, run_id: str) -> float:
    req = AttemptRequest(query=query, top_k=5, run_id=run_id, budget_max_searches=1_000_000, rerank=False)
    t0 = time.perf_counter()
    async for event in runner.run(req, ANONYMOUS, time.monotonic() + 30):
        if isinstance(event, ResultEvent):
            assert event.result.outcome.value == "EVIDENCE_FOUND", event.result
    return (time.perf_counter() - t0) * 1000


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attempts", type=int, default=300)
    ap.add_argument("--opensearch-url", default=os.environ.get("OPENSEARCH_URL", ""))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-ledger-"))
    cfg = dataclasses.replace(Config(), data_dir=tmp, reranker_model="")
    app = App.build(cfg)
    await app.start()
    for d in DEMO_DOCUMENTS:
        await app.ingestor.ingest(DocumentInput(**{**d, "acl": tuple(d.get("acl", ()))}))
    await app.engine.refresh()

    ledgers: dict[str, Ledger] = {"noop": NoopLedger(), "sqlite": SqliteLedger(tmp / "bench-ledger.sqlite3")}
    url = bench_node_or_none(args.opensearch_url) if args.opensearch_url else None
    if url:
        ledgers["opensearch"] = OpenSearchLedger(url, index_prefix=f"bench-{uuid.uuid4().hex[:8]}", timeout_s=5.0)
    timed = {name: TimedLedger(ledger) for name, ledger in ledgers.items()}
    runners: dict[str, tuple[AttemptRunner, AttemptWriter]] = {}
    for name, ledger in ledgers.items():
        await ledger.start()
        writer = AttemptWriter(ledger)
        runners[name] = (AttemptRunner(cfg, app.engine, app.runtime, ledger, quality=app.runner.quality,
                                       writer=writer), writer)
    totals: dict[str, list[float]] = {name: [] for name in ledgers}
    run_ids = {name: f"bench-{name}-{uuid.uuid4().hex[:6]}" for name in ledgers}
    for name in ledgers:  # warm-up: models, caches, connections, index creation
        for q in QUERIES:
            await one_attempt(runners[name][0], q, run_ids[name])
        timed[name].reserve_ms.clear()
    for i in range(args.attempts):
        for name in ledgers:  # interleaved
            totals[name].append(await one_attempt(runners[name][0], QUERIES[i % len(QUERIES)], run_ids[name]))
    drain: dict[str, float] = {}
    for name, (_, writer) in runners.items():
        t0 = time.perf_counter()
        await writer.flush(60)
        drain[name] = (time.perf_counter() - t0) * 1000
    base50, base95 = percentile(totals["noop"], 50), percentile(totals["noop"], 95)
    print(f"{args.attempts} attempts per ledger, interleaved; hybrid BM25 + kNN (e5-small int8), embedded engine")
    print(f"{'ledger':<11} {'reserve p50':>11} {'reserve p95':>11} {'attempt p50':>11} {'attempt p95':>11}"
          f" {'x noop p50':>10} {'x noop p95':>10} {'flush after':>11}")
    for name in ledgers:
        r = timed[name].reserve_ms
        t = totals[name]
        print(f"{name:<11} {percentile(r, 50):>9.3f}ms {percentile(r, 95):>9.3f}ms {percentile(t, 50):>9.2f}ms "
              f"{percentile(t, 95):>9.2f}ms {percentile(t, 50) / base50:>10.3f} {percentile(t, 95) / base95:>10.3f} "
              f"{drain[name]:>9.1f}ms")
    for name, (_, writer) in runners.items():
        await writer.close()
        if isinstance(ledgers[name], OpenSearchLedger):
            await ledgers[name].drop()  # type: ignore[attr-defined]
        await ledgers[name].close()
    await app.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
