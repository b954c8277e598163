"""The OpenSearch engine against a real node that misbehaves.

- a black-holed proxy (hung node / dropped network) -> ``EngineTimeout`` within the budget
  plus a small margin, never "no hits";
- a refused port (stopped node) -> ``EngineUnavailable``, fast;
- the same engine object recovers when the proxy resumes (no restart);
- the engine starts while the node is unreachable and creates its index on first contact;
- a real ``timed_out: true`` answer (a slow script query under a search timeout) is
  ``complete=False``, with and without partial hits;
- SIGSTOP / SIGCONT of a dedicated node started with deploy/opensearch/opensearch.sh.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.engines.base import (
    ChunkRecord,
    EngineTimeout,
    EngineUnavailable,
    PartialReason,
    SearchFilter,
    make_chunk_id,
)
from service.engines.opensearch import mapping
from service.engines.opensearch.engine import _READY_TIMEOUT_S, OpenSearchEngine, client_margin
from tests.support.opensearch import drop_prefix, opensearch_url_or_skip, unique_prefix
from tests.support.timing import assert_within
from tests.support.tcp_proxy import TcpProxy, free_port

pytestmark = [pytest.mark.fault, pytest.mark.integration]

DIM = 8
ALL = SearchFilter(acl_groups=None)
BUDGET = 0.5
REPO = Path(__file__).resolve().parents[2]


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def chunks(source_id: str, n: int, text: str = "insurance claim 保险理赔") -> list[ChunkRecord]:
    return [
        ChunkRecord(
            chunk_id=make_chunk_id(source_id, i, "v1"),
            source_id=source_id,
            version="v1",
            chunk_index=i,
            collection="doc",
            status="approved",
            title="t",
            breadcrumb="b",
            text=f"{text} {i}",
            parent_text="",
            search_text=f"{text} {i}",
            content_hash=f"h-{source_id}",
            vector=unit(i),
        )
        for i in range(n)
    ]


async def seed(engine: OpenSearchEngine, n: int = 20) -> None:
    report = await engine.replace_document("S", "v1", chunks("S", n))
    assert report.written == n and not report.errors
    await engine.refresh()


async def assert_times_out(call: Any, budget: float) -> float:
    started = time.perf_counter()
    with pytest.raises(EngineTimeout):
        await call
    elapsed = time.perf_counter() - started
    # The engine gives up at the budget plus its own client margin; never at its 2 s request timeout.
    assert_within(elapsed, budget + client_margin(budget), "EngineTimeout")
    return elapsed


@pytest.fixture
async def proxied(proxy: TcpProxy, node_url: str) -> AsyncIterator[OpenSearchEngine]:
    prefix = unique_prefix("fault")
    engine = OpenSearchEngine(proxy.url, index_prefix=prefix, dimension=DIM, request_timeout_s=2.0)
    await engine.start()
    assert await engine.ready()
    try:
        yield engine
    finally:
        await engine.close()
        drop_prefix(node_url, prefix)


async def test_blackhole_times_out_within_budget_and_recovers(
    proxied: OpenSearchEngine, proxy: TcpProxy
) -> None:
    await seed(proxied)
    assert len((await proxied.bm25("insurance", 5, ALL, BUDGET)).hits) == 5
    proxy.blackhole()
    await assert_times_out(proxied.bm25("insurance", 5, ALL, BUDGET), BUDGET)
    await assert_times_out(proxied.knn(unit(1), 5, ALL, BUDGET), BUDGET)
    started = time.perf_counter()
    assert not await proxied.ready()
    assert_within(time.perf_counter() - started, _READY_TIMEOUT_S, "the readiness probe")  # its own short timeout
    await proxy.resume()
    response = await proxied.bm25("insurance", 5, ALL, BUDGET)
    assert response.complete and len(response.hits) == 5
    assert len((await proxied.knn(unit(1), 5, ALL, BUDGET)).hits) == 5
    assert await proxied.ready()


async def test_refused_port_is_unavailable_and_recovers(
    proxied: OpenSearchEngine, proxy: TcpProxy
) -> None:
    await seed(proxied)
    await proxy.refuse()
    for call in (
        proxied.bm25("insurance", 5, ALL, BUDGET),
        proxied.knn(unit(1), 5, ALL, BUDGET),
        proxied.replace_document("S", "v1", chunks("S", 3)),
        proxied.get_chunks(["S#0@v1"]),
    ):
        started = time.perf_counter()
        with pytest.raises(EngineUnavailable):
            await call
        # Refused is reported at once: well inside the caller's budget (plus the load margin),
        # never after the 2 s request timeout a hung peer would cost.
        assert_within(time.perf_counter() - started, BUDGET, "EngineUnavailable")
    assert not await proxied.ready()
    await proxy.resume()
    assert await proxied.ready()
    assert len((await proxied.bm25("insurance", 5, ALL, BUDGET)).hits) == 5


async def test_closed_port_is_unavailable() -> None:
    engine = OpenSearchEngine(f"http://127.0.0.1:{free_port()}", index_prefix="never", dimension=DIM)
    try:
        await engine.start()  # must not raise
        assert not await engine.ready()
        with pytest.raises(EngineUnavailable):
            await engine.bm25("x", 3, ALL, BUDGET)
    finally:
        await engine.close()


async def test_starts_while_node_down_then_creates_index_on_first_contact(
    proxy: TcpProxy, node_url: str
) -> None:
    await proxy.refuse()
    prefix = unique_prefix("lazy")
    engine = OpenSearchEngine(proxy.url, index_prefix=prefix, dimension=DIM, request_timeout_s=2.0)
    try:
        await engine.start()
        assert not await engine.ready()
        with pytest.raises(EngineUnavailable):
            await engine.knn(unit(0), 3, ALL, BUDGET)
        await proxy.resume()
        assert await engine.ready()
        await seed(engine, 4)
        assert len((await engine.knn(unit(0), 3, ALL, BUDGET)).hits) == 3
    finally:
        await engine.close()
        drop_prefix(node_url, prefix)


# -- a real timed_out: true ----------------------------------------------------------------

# Painless loop per matching document: about 0.4ms per doc here (n=20000), 4000 docs.
# OpenSearch checks the search timeout between scoring windows (the first is 2048 docs,
# then they double) against a clock cached in 200ms ticks, so a 50ms timeout fires after
# the first window (~0.8s) -- every time, well inside the 5s budget. The engine's own timeout
# shaping (server timeout under the budget) is checked in tests/unit/engines/opensearch.
_BM25_BODY = mapping.bm25_body  # the real one, before a test patches it
_SLOW = "double x = 0; for (int i = 0; i < params.n; i++) { x += Math.log(i + 1 + doc['chunk_index'].value); }"
_SERVER_TIMEOUT = 0.05
_SLOW_BUDGET = 5.0


def slow_scored_body(query: str, k: int, flt: SearchFilter, timeout_s: float) -> dict[str, Any]:
    """The engine's own bm25 body with its query wrapped in a slow script score."""
    body = _BM25_BODY(query, k, flt, _SERVER_TIMEOUT)
    body["query"] = {
        "script_score": {
            "query": body["query"],
            "script": {"source": _SLOW + " return x;", "params": {"n": 20000}},
        }
    }
    return body


def slow_filter_body(query: str, k: int, flt: SearchFilter, timeout_s: float) -> dict[str, Any]:
    """A slow script filter that matches nothing: the node gives up with zero hits."""
    body = _BM25_BODY(query, k, flt, _SERVER_TIMEOUT)
    body["query"]["bool"].setdefault("filter", []).append(
        {"script": {"script": {"source": _SLOW + " return x < 0;", "params": {"n": 20000}}}}
    )
    return body


@pytest.fixture(scope="module")
def slow_index_url() -> Iterator[tuple[str, str]]:
    """4000 chunks under one prefix, shared by the timed_out tests (writing is the slow part)."""
    url = opensearch_url_or_skip()
    prefix = unique_prefix("slow")

    async def fill() -> None:
        engine = OpenSearchEngine(url, index_prefix=prefix, dimension=DIM)
        try:
            for d in range(4):
                report = await engine.replace_document(f"D{d}", "v1", chunks(f"D{d}", 1000))
                assert not report.errors
            await engine.refresh()
        finally:
            await engine.close()

    asyncio.run(fill())
    try:
        yield url, prefix
    finally:
        drop_prefix(url, prefix)


@pytest.mark.slow
@pytest.mark.parametrize("body", [slow_scored_body, slow_filter_body], ids=["partial", "zero-hits"])
async def test_real_timed_out_answer_is_incomplete_never_empty(
    slow_index_url: tuple[str, str], monkeypatch: pytest.MonkeyPatch, body: Any
) -> None:
    url, prefix = slow_index_url
    engine = OpenSearchEngine(url, index_prefix=prefix, dimension=DIM)
    try:
        assert await engine.ready()
        monkeypatch.setattr(mapping, "bm25_body", body)
        started = time.perf_counter()
        response = await engine.bm25("insurance", 10, ALL, _SLOW_BUDGET)
        elapsed = time.perf_counter() - started
        assert not response.complete, response
        assert response.partial_reason is PartialReason.TIMED_OUT
        assert "timed out" in response.detail
        assert_within(elapsed, _SLOW_BUDGET + client_margin(_SLOW_BUDGET), "the timed-out search")
        if body is slow_filter_body:
            assert response.hits == []  # zero hits, and still not "no match"
        else:
            assert 0 < len(response.hits) <= 10
    finally:
        await engine.close()


# -- SIGSTOP / SIGCONT of a dedicated node -------------------------------------------------

FAULT_PORT = int(os.environ.get("OPENSEARCH_FAULT_PORT", "9290"))
SCRIPT = REPO / "deploy" / "opensearch" / "opensearch.sh"


@pytest.fixture(scope="module")
def dedicated_node() -> Iterator[tuple[str, int]]:
    """A node of our own (SIGSTOP must not freeze the node other tests share)."""
    args = [str(SCRIPT), "start", "--port", str(FAULT_PORT), "--heap", "512m"]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        message = f"REAL OPENSEARCH NEEDED: could not start a dedicated node: {detail[-800:]}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    match = re.search(r"^pids: (\d+)", out.stdout, re.M)
    assert match, out.stdout
    try:
        yield f"http://127.0.0.1:{FAULT_PORT}", int(match.group(1))
    finally:
        subprocess.run([str(SCRIPT), "stop", "--port", str(FAULT_PORT)], timeout=120, check=False)


@pytest.mark.slow
async def test_sigstopped_node_times_out_and_recovers_after_sigcont(
    dedicated_node: tuple[str, int],
) -> None:
    url, pid = dedicated_node
    prefix = unique_prefix("stop")
    engine = OpenSearchEngine(url, index_prefix=prefix, dimension=DIM, request_timeout_s=2.0)
    try:
        await engine.start()
        await seed(engine)
        os.kill(pid, signal.SIGSTOP)
        try:
            await assert_times_out(engine.bm25("insurance", 5, ALL, BUDGET), BUDGET)
            await assert_times_out(engine.knn(unit(2), 5, ALL, BUDGET), BUDGET)
            assert not await engine.ready()
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not await engine.ready():
            assert time.monotonic() < deadline, "node did not come back after SIGCONT"
            await asyncio.sleep(0.2)
        response = await engine.bm25("insurance", 5, ALL, BUDGET)
        assert response.complete and len(response.hits) == 5
    finally:
        await engine.close()
        drop_prefix(url, prefix)
