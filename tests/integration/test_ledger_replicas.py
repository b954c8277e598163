"""One ledger shared by two service processes (``python -m service serve``):

- on SQLite, two processes on one host sharing one ledger file;
- on OpenSearch, two processes against a 2-node cluster of our own (ledger indices with
  one replica), which then loses a node.

100 concurrent attempts on one run with ``max_searches=2``, spread over both processes:
exactly 2 reach the engine (recorded with leg reports), 98 are BUDGET_DENIED (no legs),
and GetRun from either process agrees. The ledger survives a process restart, and on
OpenSearch the loss of one node of two.
"""

from __future__ import annotations

import asyncio
import collections
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from service._gen.retrieval.v1 import ledger_pb2, ledger_pb2_grpc, retrieval_pb2, types_pb2
from tests.support.harness import result_of
from tests.support.opensearch import drop_prefix, opensearch_url_or_skip, unique_prefix
from tests.support.service_live import ScriptNodes, ServiceProcess, cat_shards, http_json

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLUSTER_PORT = int(os.environ.get("OPENSEARCH_CLUSTER_PORT", "9270"))
ATTEMPTS, MAX_SEARCHES = 100, 2
DENIED = types_pb2.ATTEMPT_OUTCOME_BUDGET_DENIED


def ledger_of(proc: ServiceProcess) -> ledger_pb2_grpc.LedgerServiceStub:
    return ledger_pb2_grpc.LedgerServiceStub(proc.channel)


async def race(procs: list[ServiceProcess], run_id: str) -> list[retrieval_pb2.AttemptResult]:
    gap = retrieval_pb2.EvidenceGap(gap_id="g-race", kind=types_pb2.GAP_KIND_EXTERNAL_KNOWLEDGE, criticality=0.9)
    budget = retrieval_pb2.RunBudget(max_searches=MAX_SEARCHES)

    async def one(i: int) -> retrieval_pb2.AttemptResult:
        events = await procs[i % len(procs)].retrieve(timeout=60.0, query=f"budget race {i}", top_k=3,
                                                      run_id=run_id, gap=gap, budget=budget)
        return result_of(events)

    return list(await asyncio.gather(*(one(i) for i in range(ATTEMPTS))))


async def whole_run(proc: ServiceProcess, run_id: str) -> tuple[ledger_pb2.Run, list[ledger_pb2.RunAttempt]]:
    attempts: list[ledger_pb2.RunAttempt] = []
    token = ""
    while True:
        page = await ledger_of(proc).GetRun(ledger_pb2.GetRunRequest(run_id=run_id, page_size=40, page_token=token),
                                            timeout=30.0)
        attempts += page.attempts
        token = page.next_page_token
        if not token:
            return page, attempts


async def check_exactly_two_searched(procs: list[ServiceProcess], run_id: str) -> None:
    results = await race(procs, run_id)
    outcomes = collections.Counter(types_pb2.AttemptOutcome.Name(r.outcome) for r in results)
    searched = [r for r in results if r.outcome != DENIED]
    assert len(searched) == MAX_SEARCHES and outcomes["ATTEMPT_OUTCOME_BUDGET_DENIED"] == ATTEMPTS - MAX_SEARCHES, outcomes
    assert all(r.legs for r in searched) and not any(r.legs for r in results if r.outcome == DENIED)
    assert sorted(r.budget_before for r in searched) == [1, 2]
    # Each GetRun flushes that process's own pending records first: ask both, then compare.
    views = [await whole_run(p, run_id) for p in procs]
    views = [await whole_run(p, run_id) for p in procs]
    for run, attempts in views:
        assert (run.budget.searches_used, run.budget.searches_left) == (MAX_SEARCHES, 0)
        assert {a.attempt_id for a in attempts} == {r.attempt_id for r in results}
        engine_reached = [a for a in attempts if a.legs]  # leg reports: the engine was called
        assert len(engine_reached) == MAX_SEARCHES
        assert all(a.outcome != DENIED for a in engine_reached)
        assert sum(a.outcome == DENIED for a in attempts) == ATTEMPTS - MAX_SEARCHES
        [gap] = run.gaps
        assert gap.state == ledger_pb2.GAP_STATE_UNRESOLVED and gap.reason == "budget_exhausted"
    assert [a.attempt_id for a in views[0][1]] == [a.attempt_id for a in views[1][1]]  # same order too


async def check_restart_survival(procs: list[ServiceProcess], run_id: str, respawn: ServiceProcess) -> None:
    before = await whole_run(procs[0], run_id)
    await procs[0].stop()
    await respawn.wait_serving(180.0)
    procs[0] = respawn
    after = await whole_run(respawn, run_id)
    assert after[0].budget == before[0].budget and [a.attempt_id for a in after[1]] == [a.attempt_id for a in before[1]]
    denied = result_of(await respawn.retrieve(query="after restart", top_k=1, run_id=run_id))
    assert denied.outcome == DENIED


# -- SQLite: two processes, one ledger file ------------------------------------------------------

def sqlite_env(ledger: Path) -> dict[str, str]:
    return {"RETRIEVAL_LEDGER_PATH": str(ledger), "RETRIEVAL_LEDGER_TIMEOUT_S": "10"}


@pytest.fixture
async def sqlite_services(tmp_path: Path) -> AsyncIterator[list[ServiceProcess]]:
    env = sqlite_env(tmp_path / "shared-ledger.sqlite3")
    procs = [ServiceProcess.spawn("", tmp_path / f"svc{i}", env) for i in range(2)]
    try:
        await asyncio.gather(*(p.wait_serving(180.0) for p in procs))
        yield procs
    finally:
        await asyncio.gather(*(p.stop() for p in procs))


async def test_sqlite_two_processes_share_one_budget_and_survive_a_restart(
    sqlite_services: list[ServiceProcess], tmp_path: Path
) -> None:
    run_id = f"race-{uuid.uuid4().hex[:8]}"
    await check_exactly_two_searched(sqlite_services, run_id)
    respawn = ServiceProcess.spawn("", tmp_path / "svc0-again", sqlite_env(tmp_path / "shared-ledger.sqlite3"))
    await check_restart_survival(sqlite_services, run_id, respawn)
    await respawn.stop()


# -- OpenSearch: two processes, a 2-node cluster ---------------------------------------------------

@pytest.fixture(scope="module")
def cluster() -> Iterator[ScriptNodes]:
    opensearch_url_or_skip()  # the same gate as every OpenSearch test (fails under CI=true)
    nodes = ScriptNodes(port=CLUSTER_PORT, nodes=2, heap="512m").start()
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
async def os_services(cluster: ScriptNodes, tmp_path: Path) -> AsyncIterator[tuple[str, list[ServiceProcess]]]:
    prefix = unique_prefix("ledgerrep")
    env = {"RETRIEVAL_OPENSEARCH_INDEX_PREFIX": prefix, "RETRIEVAL_OPENSEARCH_REPLICAS": "1",
           "RETRIEVAL_LEDGER_TIMEOUT_S": "10"}
    procs = [ServiceProcess.spawn(cluster.url, tmp_path / f"svc{i}", env) for i in range(2)]
    try:
        await asyncio.gather(*(p.wait_serving(180.0) for p in procs))
        yield prefix, procs
    finally:
        await asyncio.gather(*(p.stop() for p in procs))
        http_json("DELETE", f"{cluster.url}/{prefix}-ledger-*?ignore_unavailable=true&allow_no_indices=true")
        drop_prefix(cluster.url, prefix)


async def test_opensearch_two_processes_share_one_budget_and_survive_a_restart_and_a_node(
    cluster: ScriptNodes, os_services: tuple[str, list[ServiceProcess]], tmp_path: Path
) -> None:
    prefix, procs = os_services
    run_id = f"race-{uuid.uuid4().hex[:8]}"
    await check_exactly_two_searched(procs, run_id)
    # Every ledger index has a primary and a replica, on different nodes.
    health = cluster.health(f"/{prefix}-ledger-*?wait_for_status=green&timeout=60s", timeout=65)
    assert health["status"] == "green", health
    shards = cat_shards(cluster.url, f"{prefix}-ledger-*")
    for index in {s["index"] for s in shards}:
        assert sorted(s["prirep"] for s in shards if s["index"] == index) == ["p", "r"], shards
    respawn = ServiceProcess.spawn(cluster.url, tmp_path / "svc0-again",
                                   {"RETRIEVAL_OPENSEARCH_INDEX_PREFIX": prefix, "RETRIEVAL_OPENSEARCH_REPLICAS": "1",
                                    "RETRIEVAL_LEDGER_TIMEOUT_S": "10"})
    await check_restart_survival(procs, run_id, respawn)
    before = [await whole_run(p, run_id) for p in procs][-1]  # both flushed: the whole run
    cluster.stop_node(1)  # lose one node of two
    try:
        for proc in procs:
            run, attempts = await whole_run(proc, run_id)
            assert run.budget == before[0].budget and [a.attempt_id for a in attempts] == \
                [a.attempt_id for a in before[1]]
        for proc in procs:
            assert result_of(await proc.retrieve(query="node lost", top_k=1, run_id=run_id)).outcome == DENIED
        fresh = f"after-loss-{uuid.uuid4().hex[:8]}"
        results = [result_of(await p.retrieve(query="after the loss", top_k=1, run_id=fresh,
                                              budget=retrieval_pb2.RunBudget(max_searches=1))) for p in procs]
        assert sorted(types_pb2.AttemptOutcome.Name(r.outcome) for r in results)[0] != "ATTEMPT_OUTCOME_BACKEND_ERROR"
        assert sum(r.outcome == DENIED for r in results) == 1  # still exactly one search
    finally:
        cluster.start_node(1)
