"""Acknowledged ingest survives the hard faults: the service killed with SIGKILL mid-stream
(embedded engine and OpenSearch), and the OpenSearch node itself stopped mid-stream and
started again. Every document acknowledged INDEXED is readable and searchable afterwards;
a document acknowledged FAILED was not committed (the caller knows to send it again); the
re-run of the same documents writes none of the acknowledged ones again.

Real processes and real signals: ``python -m service serve`` in its own process (the
dummy hash embedder, so the stream is bound by the engine, not by a model) and, for the
node restart, a node of our own started with deploy/opensearch/opensearch.sh.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from service._gen.retrieval.v1 import corpus_pb2, retrieval_pb2, retrieval_pb2_grpc, types_pb2
from tests.support.ingest_stream import Acks, stream_documents
from tests.support.opensearch import drop_prefix, opensearch_url_or_skip, unique_prefix
from tests.support.service_live import ScriptNodes, ServiceProcess

pytestmark = [pytest.mark.fault, pytest.mark.slow]

N_DOCS = 300
NODE_PORT = int(os.environ.get("OPENSEARCH_INGEST_FAULT_PORT", "9295"))


def _doc(i: int) -> corpus_pb2.Document:
    body = " ".join(f"Part {k} of note {i}: kayak rental rules, pier hours, safety notes." for k in range(12))
    return corpus_pb2.Document(source_id=f"n-{i}", version="v1", title=f"Note {i}", text=f"{body} uniq{i}tok",
                               collection=types_pb2.COLLECTION_DOC)


DOCS = [_doc(i) for i in range(N_DOCS)]


def _env(prefix: str = "") -> dict[str, str]:
    env = {"RETRIEVAL_EMBEDDING_MODEL": "dummy-hash", "RETRIEVAL_RERANKER_MODEL": ""}
    return {**env, "RETRIEVAL_OPENSEARCH_INDEX_PREFIX": prefix} if prefix else env


async def _stream(target: str, on_ack: Callable[[Acks], Awaitable[None]] | None = None
                  ) -> tuple[Acks, grpc.aio.AioRpcError | None]:
    return await stream_documents(target, DOCS, on_response=on_ack)


async def _check_committed(svc: ServiceProcess, acks: Acks) -> None:
    """Every INDEXED ack is readable at its exact version and found by its unique token."""
    indexed = [a for a in acks.values() if a.status == corpus_pb2.DOCUMENT_STATUS_INDEXED]
    assert indexed, "nothing was acknowledged before the fault"
    for ack in indexed:
        got = await svc.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id=f"{ack.source_id}#0@v1"))
        assert got.fidelity == corpus_pb2.FIDELITY_EXACT, f"acknowledged {ack.source_id} is gone after the fault"
    stub = retrieval_pb2_grpc.RetrievalServiceStub(svc.channel)
    for ack in indexed[:: max(1, len(indexed) // 20)]:  # a spread of them through search too
        n = ack.source_id.split("-")[1]
        events = [e async for e in stub.Retrieve(retrieval_pb2.RetrieveRequest(
            query=f"uniq{n}tok", top_k=3, options=retrieval_pb2.RetrievalOptions(min_quality=1e-9)), timeout=20)]
        found = [e.evidence.source_id for e in events if e.WhichOneof("event") == "evidence"]
        assert ack.source_id in found, (ack.source_id, found)


async def _rerun_writes_only_what_was_missing(svc: ServiceProcess, first: Acks) -> None:
    second, err = await _stream(svc.target)
    assert err is None, err
    assert sorted(second) == list(range(1, N_DOCS + 1))
    for seq, ack in first.items():
        if ack.status == corpus_pb2.DOCUMENT_STATUS_INDEXED:
            assert second[seq].status == corpus_pb2.DOCUMENT_STATUS_UNCHANGED, (seq, second[seq])
    assert all(a.status in (corpus_pb2.DOCUMENT_STATUS_INDEXED, corpus_pb2.DOCUMENT_STATUS_UNCHANGED)
               for a in second.values())


async def _kill_mid_stream(data_dir: Path, opensearch_url: str, env: dict[str, str]) -> None:
    svc = ServiceProcess.spawn(opensearch_url, data_dir, env=env)
    try:
        await svc.wait_serving()

        async def kill_after_some(acks: Acks) -> None:
            if len(acks) >= 40 and svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGKILL)  # no shutdown hook, no flush

        first, err = await _stream(svc.target, kill_after_some)
        assert err is not None, "the stream finished before the kill"
        assert 40 <= len(first) < N_DOCS, len(first)
        assert await asyncio.to_thread(svc.proc.wait, 30) == -signal.SIGKILL
    finally:
        await svc.stop()
    again = ServiceProcess.spawn(opensearch_url, data_dir, env=env)
    try:
        await again.wait_serving()
        await _check_committed(again, first)
        await _rerun_writes_only_what_was_missing(again, first)
    finally:
        await again.stop()


async def test_sigkill_of_the_service_mid_ingest_loses_no_acknowledged_document_embedded(tmp_path: Path) -> None:
    await _kill_mid_stream(tmp_path / "data", "", _env())


@pytest.fixture
def os_prefix() -> Iterator[tuple[str, str]]:
    url = opensearch_url_or_skip()
    prefix = unique_prefix("dur")
    yield url, prefix
    drop_prefix(url, prefix)


@pytest.mark.integration
async def test_sigkill_of_the_service_mid_ingest_loses_no_acknowledged_document_opensearch(
        tmp_path: Path, os_prefix: tuple[str, str]) -> None:
    url, prefix = os_prefix
    await _kill_mid_stream(tmp_path / "data", url, _env(prefix))


@pytest.fixture(scope="module")
def own_node() -> Iterator[ScriptNodes]:
    nodes = ScriptNodes(port=NODE_PORT, nodes=1, heap="512m").start()
    yield nodes
    nodes.stop()


@pytest.mark.integration
async def test_the_node_stopped_and_started_mid_ingest_loses_no_acknowledged_document(
        tmp_path: Path, own_node: ScriptNodes) -> None:
    svc = ServiceProcess.spawn(own_node.url, tmp_path / "data", env=_env(unique_prefix("nr")))
    try:
        await svc.wait_serving()
        stopped = asyncio.Event()

        async def stop_node_after_some(acks: Acks) -> None:
            if len(acks) >= 40 and not stopped.is_set():
                stopped.set()
                await asyncio.to_thread(own_node.stop_node, 0)  # SIGTERM: the node goes away mid-stream
                asyncio.get_running_loop().call_later(5.0, lambda: asyncio.ensure_future(
                    asyncio.to_thread(own_node.start_node, 0)))

        first, err = await _stream(svc.target, stop_node_after_some)
        assert stopped.is_set()
        for _ in range(240):  # the node is back (the restart runs in the background)
            try:
                if own_node.health().get("status") in ("green", "yellow"):
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            await asyncio.sleep(0.5)
        failed = [a for a in first.values() if a.status == corpus_pb2.DOCUMENT_STATUS_FAILED]
        indexed = [a for a in first.values() if a.status == corpus_pb2.DOCUMENT_STATUS_INDEXED]
        print(f"\nnode restart mid-ingest: {len(indexed)} INDEXED, {len(failed)} FAILED, "
              f"{N_DOCS - len(first)} unacknowledged, stream error: {err.code().name if err else None}")
        await asyncio.sleep(2.0)  # the service's engine reconnects on its own
        await _check_committed(svc, first)
        await _rerun_writes_only_what_was_missing(svc, first)
    finally:
        await svc.stop()
