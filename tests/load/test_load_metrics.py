"""The load generator against a live in-process server, checked against what the server's
/metrics says: attempts by outcome equal the outcomes the generator saw (closed loop), and
requests refused under an open-loop overload equal the shed counter. Quick (a few
seconds), so it runs in the default tier; `make bench` does the long runs."""

from __future__ import annotations

import asyncio

from tests.load.loadgen import closed_loop, grpc_call, open_loop, percentile
from tests.support.demo_expectations import RANKING_CASES
from tests.support.scrape import by_label, scrape

QUERIES = [q for q, _ in RANKING_CASES] + ["zebra migration patterns"]


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([5.0], 99) == 5.0
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 99), percentile(values, 100)) == (50, 95, 99, 100)


async def test_closed_loop_counts_match_scraped_metrics(start_server) -> None:
    live = await start_server(metrics_listen="127.0.0.1:0")
    url = f"http://127.0.0.1:{live.server.metrics_port}/metrics"
    retrieve = grpc_call(live.channel, "retrieve", rerank=False)
    stats = await closed_loop(retrieve, QUERIES, 8, requests=60)
    assert stats.requests == 60 and "EVIDENCE_FOUND" in stats.outcomes
    lookup = await closed_loop(grpc_call(live.channel, "lookup", rerank=False), QUERIES, 4, requests=20)
    assert lookup.requests == 20
    scraped = await asyncio.to_thread(scrape, url)
    counted = {k: int(v) for k, v in by_label(scraped, "retrieval_attempts_total", "outcome").items() if v}
    # Lookup's NO_EVIDENCE hides the outcome (EMPTY / INSUFFICIENT / ...): compare totals for it.
    assert sum(counted.values()) == stats.requests + lookup.requests
    assert counted.get("EVIDENCE_FOUND", 0) == stats.outcomes["EVIDENCE_FOUND"] + lookup.outcomes["EVIDENCE_FOUND"]
    for outcome, n in stats.outcomes.items():
        if outcome != "EVIDENCE_FOUND":
            assert counted[outcome] >= n, (outcome, counted, stats.outcomes)
    assert stats.p(50) > 0 and stats.p(99) >= stats.p(95) >= stats.p(50)


async def test_open_loop_overload_is_shed_and_counted(start_server) -> None:
    live = await start_server(metrics_listen="127.0.0.1:0", max_inflight_attempts=2)
    url = f"http://127.0.0.1:{live.server.metrics_port}/metrics"
    stats = await open_loop(grpc_call(live.channel, "retrieve", rerank=False), QUERIES, rate=400, duration_s=0.5)
    shed = stats.outcomes["RESOURCE_EXHAUSTED"]
    assert shed > 0 and stats.requests == 200, stats.outcomes
    scraped = await asyncio.to_thread(scrape, url)
    assert sum(by_label(scraped, "retrieval_shed_total", "reason").values()) == shed
    assert sum(by_label(scraped, "retrieval_attempts_total", "outcome").values()) == stats.requests - shed
