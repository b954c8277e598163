"""The whole service (gRPC, pipeline, e5 int8 embedder, OpenSearch engine) while a real
OpenSearch node misbehaves. Faults come only from tests/support/tcp_proxy.py between the
engine and the node, or from SIGSTOP/SIGCONT of a node of our own; nothing is mocked.

- a hung node (proxy black-holes) -> TIMEOUT, answered before the caller's gRPC deadline,
  never EMPTY; health turns NOT_SERVING;
- a stopped node (proxy refuses) -> BACKEND_ERROR (Lookup: UNAVAILABLE);
- the proxy resumes -> the same server answers EVIDENCE_FOUND again, no restart;
- the service starts while the node is down (refusing) or hung (black-holed): NOT_SERVING,
  attempts BACKEND_ERROR/TIMEOUT, then SERVING within a few seconds of the node coming
  back, and ingest + retrieval work, no restart;
- the fill of passage states meets a node that went down after ingest: it keeps the chunk
  ingest left and stores its states once the node is back;
- SIGSTOP of the node's JVM -> TIMEOUT before the deadline; SIGCONT -> recovery.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from service._gen.retrieval.v1 import corpus_pb2, retrieval_pb2, types_pb2
from service.config import Config
from service.demo.corpus import DEMO_DOCUMENTS
from service.models.base import EmbeddingBackend
from tests.support.harness import Live, demo_documents, evidence_of, fill_caught_up, legs_of, result_of
from tests.support.opensearch import drop_prefix, opensearch_url_or_skip, unique_prefix
from tests.support.service_live import (
    NOT_SERVING,
    SERVING,
    ScriptNodes,
    health_status,
    start_live,
    stop_live,
    wait_health,
)
from tests.support.timing import assert_within
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

# The caller's gRPC deadline. The legs get retrieval_share (0.6) of it, the engine's client
# waits a small margin past that, so a hung node must be answered well before it.
DEADLINE = 2.0
# For the checks that the service answers (before a fault, once it is over): a whole, not
# degraded, answer is the point there, not its time, so a slow moment of a loaded machine
# (the first rerank after a restart, a JVM pause) must not read as a failed recovery.
SERVING_DEADLINE = 10.0
QUERY, EXPECTED = "how do I reset my password", "kb-password-reset"
# Health is polled every 1s and the readiness probe waits up to 1.1s: a state change shows
# within ~2.5s; 10s leaves room for a loaded machine without hiding a service that never flips.
HEALTH_WAIT_S = 10.0
SIGSTOP_PORT = int(os.environ.get("OPENSEARCH_SVC_FAULT_PORT", "9280"))

FOUND = types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND
TIMEOUT = types_pb2.ATTEMPT_OUTCOME_TIMEOUT
BACKEND_ERROR = types_pb2.ATTEMPT_OUTCOME_BACKEND_ERROR
EMPTY = types_pb2.ATTEMPT_OUTCOME_EMPTY


def name(outcome: int) -> str:
    return types_pb2.AttemptOutcome.Name(outcome)  # type: ignore[arg-type]


def os_config(url: str, prefix: str, data_dir: Path) -> Config:
    return dataclasses.replace(Config(), opensearch_url=url, opensearch_index_prefix=prefix, data_dir=data_dir)


async def timed_retrieve(live: Live, query: str = QUERY, deadline: float = DEADLINE
                         ) -> tuple[retrieval_pb2.AttemptResult, list[str], float]:
    """One attempt under the caller's ``deadline``: the result, evidence sources, seconds taken.
    Getting a result at all means the stream ended before the deadline (gRPC would
    otherwise end it with DEADLINE_EXCEEDED)."""
    started = time.monotonic()
    try:
        events = await live.retrieve(query=query, top_k=3, timeout=deadline)
    except grpc.aio.AioRpcError as exc:  # say when and how, so a failure here can be read
        pytest.fail(f"Retrieve ended with {exc.code().name} after {time.monotonic() - started:.3f}s "
                    f"(deadline {deadline}s): {exc.details()}")
    elapsed = time.monotonic() - started
    return result_of(events), [e.source_id for e in evidence_of(events)], elapsed


def assert_timeout_before_deadline(result: retrieval_pb2.AttemptResult, elapsed: float) -> None:
    assert result.outcome == TIMEOUT, (name(result.outcome), legs_of(result))
    assert result.outcome != EMPTY
    assert result.evidence_status == types_pb2.EVIDENCE_STATUS_NO_EVIDENCE
    assert legs_of(result)["LEG_KIND_BM25"] == legs_of(result)["LEG_KIND_KNN"] == "LEG_STATUS_TIMEOUT"
    assert result.engine == "opensearch"
    assert_within(elapsed, DEADLINE, "the TIMEOUT result")  # a result at all: before the deadline


async def assert_serves(live: Live) -> None:
    """The service answers whole (under SERVING_DEADLINE): before a fault, once it is over."""
    assert_found(*(await timed_retrieve(live, deadline=SERVING_DEADLINE))[:2])


def assert_found(result: retrieval_pb2.AttemptResult, sources: list[str]) -> None:
    assert result.outcome == FOUND, (name(result.outcome), legs_of(result), [leg.detail for leg in result.legs])
    assert not result.degraded and result.engine == "opensearch", (
        result.stopping_reason, legs_of(result), [leg.detail for leg in result.legs])
    assert sources[0] == EXPECTED, sources


@pytest.fixture
def prefix(node_url: str) -> Iterator[str]:
    p = unique_prefix("svcfault")
    yield p
    drop_prefix(node_url, p)


@pytest.fixture
async def proxied(proxy: TcpProxy, prefix: str, tmp_path: Path, e5_embedder: EmbeddingBackend) -> AsyncIterator[Live]:
    """The service, its engine pointed at the proxy, with the demo corpus ingested."""
    live = await start_live(os_config(proxy.url, prefix, tmp_path / "data"), e5_embedder)
    try:
        summary = await live.ingest(demo_documents())
        assert summary.documents_indexed == len(DEMO_DOCUMENTS) and not summary.errors, summary
        await wait_health(live.channel, SERVING, HEALTH_WAIT_S)
        yield live
    finally:
        await stop_live(live)


async def test_hung_node_is_timeout_before_the_deadline_then_recovers_without_restart(
    proxied: Live, proxy: TcpProxy
) -> None:
    await assert_serves(proxied)
    proxy.blackhole()
    elapsed_all = []
    for query in (QUERY, "如何开具发票"):
        result, sources, elapsed = await timed_retrieve(proxied, query)
        assert_timeout_before_deadline(result, elapsed)
        assert sources == []
        elapsed_all.append(elapsed)
    # The agent projection: TIMEOUT is DEADLINE_EXCEEDED with our mapping, never "no evidence".
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxied.retrieval.Lookup(retrieval_pb2.RetrieveRequest(query=QUERY, top_k=3), timeout=DEADLINE)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "TIMEOUT" in (err.value.details() or "")
    not_serving_s = await wait_health(proxied.channel, NOT_SERVING, HEALTH_WAIT_S)
    assert await health_status(proxied.channel, "liveness") == SERVING  # readiness only
    await proxy.resume()
    await assert_serves(proxied)
    serving_s = await wait_health(proxied.channel, SERVING, HEALTH_WAIT_S)
    print(f"\n[hung node] TIMEOUT after {', '.join(f'{e:.3f}s' for e in elapsed_all)} "
          f"(deadline {DEADLINE}s); NOT_SERVING after {not_serving_s:.2f}s; SERVING {serving_s:.2f}s after resume")


async def test_stopped_node_is_backend_error_then_recovers_without_restart(proxied: Live, proxy: TcpProxy) -> None:
    await proxy.refuse()
    result, sources, elapsed = await timed_retrieve(proxied)
    assert result.outcome == BACKEND_ERROR, (name(result.outcome), legs_of(result))
    assert legs_of(result)["LEG_KIND_BM25"] == legs_of(result)["LEG_KIND_KNN"] == "LEG_STATUS_ERROR"
    assert all("unavailable" in leg.detail for leg in result.legs if leg.kind != types_pb2.LEG_KIND_RERANK)
    assert sources == []
    assert_within(elapsed, DEADLINE)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxied.retrieval.Lookup(retrieval_pb2.RetrieveRequest(query=QUERY, top_k=3), timeout=DEADLINE)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "BACKEND_ERROR" in (err.value.details() or "")
    await wait_health(proxied.channel, NOT_SERVING, HEALTH_WAIT_S)
    await proxy.resume()
    await assert_serves(proxied)
    serving_s = await wait_health(proxied.channel, SERVING, HEALTH_WAIT_S)
    print(f"\n[stopped node] BACKEND_ERROR after {elapsed:.3f}s; SERVING {serving_s:.2f}s after resume")


async def take_down(proxy: TcpProxy, fault: str) -> None:
    """The node as the service sees it: ``refused`` (stopped) or ``hung`` (black-holed)."""
    if fault == "refused":
        await proxy.refuse()
    else:
        proxy.blackhole()


@pytest.mark.parametrize("fault", ["refused", "hung"])
async def test_service_starts_while_the_node_is_down_and_serves_once_it_is_back(
    proxy: TcpProxy, prefix: str, tmp_path: Path, e5_embedder: EmbeddingBackend, fault: str
) -> None:
    await take_down(proxy, fault)
    started = time.monotonic()
    live = await start_live(os_config(proxy.url, prefix, tmp_path / "data"), e5_embedder)
    start_s = time.monotonic() - started
    try:
        assert await health_status(live.channel) == NOT_SERVING
        assert await health_status(live.channel, "retrieval.v1.RetrievalService") == NOT_SERVING
        assert await health_status(live.channel, "liveness") == SERVING
        expected = BACKEND_ERROR if fault == "refused" else TIMEOUT
        for query in (QUERY, "qzxjv wkpfy"):  # nothing would match the second one: still not EMPTY
            result, sources, elapsed = await timed_retrieve(live, query)
            assert result.outcome == expected, (name(result.outcome), legs_of(result))
            assert result.outcome != EMPTY and sources == []
            assert_within(elapsed, DEADLINE)
        await proxy.resume()
        resumed = time.monotonic()
        serving_s = await wait_health(live.channel, SERVING, HEALTH_WAIT_S)
        summary = await live.ingest(demo_documents())
        assert summary.documents_indexed == len(DEMO_DOCUMENTS) and not summary.errors, summary
        await assert_serves(live)
        print(f"\n[start while {fault}] server up in {start_s:.2f}s; SERVING {serving_s:.2f}s after the node "
              f"came back; ingest + retrieve {time.monotonic() - resumed:.2f}s after")
    finally:
        await stop_live(live)


@pytest.mark.parametrize("fault", ["refused", "hung"])
async def test_the_latin_leg_waits_for_a_node_down_at_start_then_catches_up(
    proxy: TcpProxy, prefix: str, tmp_path: Path, e5_embedder: EmbeddingBackend, fault: str
) -> None:
    # With the Latin-script leg served, the start reads the store for chunks without its
    # vector (service/ingest/backfill.py). With the node down that read fails or hangs: the
    # start goes on (bounded), the leg is SKIPPED as "catching up", and the backfill task
    # retries until the node is back; then the leg answers.
    from service.models.dummy import HashEmbedder

    await take_down(proxy, fault)
    started = time.monotonic()
    live = await start_live(os_config(proxy.url, prefix, tmp_path / "data"), e5_embedder, latin_embedder=HashEmbedder())
    start_s = time.monotonic() - started
    try:
        task = live.app.latin_backfill
        assert task is not None and not task.done()
        assert live.app.runner.latin_pending.startswith("catching up")
        result, _, elapsed = await timed_retrieve(live)
        assert result.outcome != EMPTY and legs_of(result)["LEG_KIND_KNN_LATIN"] == "LEG_STATUS_SKIPPED"
        assert_within(elapsed, DEADLINE)
        await proxy.resume()
        await wait_health(live.channel, SERVING, HEALTH_WAIT_S)
        # Its retry, every backfill.RETRY_S. asyncio.wait, not wait_for: a task that will not
        # finish fails here, saying so, instead of waiting on its cancellation.
        await asyncio.wait({task}, timeout=30)
        assert task.done(), f"the backfill did not finish within 30 s of the node's return: {live.app.runner.latin_pending!r}"
        progress = task.result()
        assert progress.done and live.app.runner.latin_pending == ""
        summary = await live.ingest(demo_documents())
        assert summary.documents_indexed == len(DEMO_DOCUMENTS) and not summary.errors, summary
        result, sources, _ = await timed_retrieve(live, deadline=SERVING_DEADLINE)
        assert result.outcome == FOUND and sources, (name(result.outcome), legs_of(result))
        assert legs_of(result)["LEG_KIND_KNN_LATIN"] == "LEG_STATUS_OK"
        print(f"\n[Latin-script leg, start while {fault}] server up in {start_s:.2f}s; caught up once the node was back")
    finally:
        await stop_live(live)


@pytest.mark.parametrize("fault", ["refused", "hung"])
async def test_the_fill_waits_out_a_node_down_then_stores_what_ingest_left(
    proxy: TcpProxy, prefix: str, tmp_path: Path, e5_embedder: EmbeddingBackend, fault: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ingest leaves a chunk past the passage cap to the fill (service/ingest/states_fill.py);
    # the node goes down before ingest has been quiet long enough. Each try fails (refused)
    # or times out (hung), the chunk stays handed over, and once the node is back the fill
    # stores the bytes a rerank would compute.
    from service.ingest import states_fill
    from service.engines.base import make_chunk_id
    from tests.e2e.test_rerank_states import LONG_ZH

    monkeypatch.setattr(states_fill, "RETRY_S", 1.0)
    live = await start_live(os_config(proxy.url, prefix, tmp_path / "data"), e5_embedder)
    try:
        fill, reranker = live.app.ingestor.states_fill, live.app.runtime.reranker
        assert fill is not None and reranker is not None and fill.idle_s >= 2.0
        doc = corpus_pb2.Document(source_id="long-zh", version="v1", text=LONG_ZH, collection=types_pb2.COLLECTION_DOC)
        summary = await live.ingest([doc])
        assert summary.documents_indexed == 1 and not summary.errors, summary
        await take_down(proxy, fault)
        await asyncio.sleep(fill.idle_s + 2.0)  # the fill has tried, and failed or hung
        assert not fill.caught_up and fill.progress.written == 0
        await proxy.resume()
        await fill_caught_up(fill, 40, poll_s=0.1)  # a hung try ends at the engine's request timeout (10 s)
        [chunk] = await live.app.engine.get_chunks([make_chunk_id("long-zh", 0, doc.version)])
        stored = await live.app.engine.passage_states([(chunk.chunk_id, chunk.content_hash)], fill.states_key)
        assert stored == {chunk.chunk_id: reranker.passage_states([chunk.search_text])[0]}
        print(f"\n[the fill, node {fault}] caught up once the node was back: {fill.progress.written} chunk")
    finally:
        await stop_live(live)


# -- SIGSTOP / SIGCONT of a node of our own ------------------------------------------------

@pytest.fixture(scope="module")
def own_node() -> Iterator[ScriptNodes]:
    opensearch_url_or_skip()  # the same gate as every OpenSearch test (fails under CI=true)
    node = ScriptNodes(port=SIGSTOP_PORT, nodes=1, heap="512m").start()
    try:
        yield node
    finally:
        node.stop()


async def test_sigstopped_node_is_timeout_before_the_deadline_and_sigcont_recovers(
    own_node: ScriptNodes, tmp_path: Path, e5_embedder: EmbeddingBackend
) -> None:
    prefix = unique_prefix("svcstop")
    live = await start_live(os_config(own_node.url, prefix, tmp_path / "data"), e5_embedder)
    pid = own_node.pids[0]
    try:
        summary = await live.ingest(demo_documents())
        assert summary.documents_indexed == len(DEMO_DOCUMENTS) and not summary.errors, summary
        await wait_health(live.channel, SERVING, HEALTH_WAIT_S)
        await assert_serves(live)
        os.kill(pid, signal.SIGSTOP)
        try:
            elapsed_all = []
            for query in (QUERY, "退款需要多长时间审核"):
                result, _sources, elapsed = await timed_retrieve(live, query)
                assert_timeout_before_deadline(result, elapsed)
                elapsed_all.append(elapsed)
            await wait_health(live.channel, NOT_SERVING, HEALTH_WAIT_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        serving_s = await wait_health(live.channel, SERVING, 30.0)
        await assert_serves(live)
        print(f"\n[SIGSTOP] TIMEOUT after {', '.join(f'{e:.3f}s' for e in elapsed_all)} (deadline {DEADLINE}s); "
              f"SERVING {serving_s:.2f}s after SIGCONT")
    finally:
        os.kill(pid, signal.SIGCONT)
        await stop_live(live)
        drop_prefix(own_node.url, prefix)
