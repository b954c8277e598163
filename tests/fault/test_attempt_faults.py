"""Outcomes under real faults: the pools and the engine are real; stalls come from real
contention (blocking jobs that occupy every worker), failures from real components that
were shut down. Nothing is mocked."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Executor
from pathlib import Path

import grpc
import pytest

from service._gen.retrieval.v1 import retrieval_pb2, types_pb2
from service.offline.builder.tiny_cross_encoder import build_tiny_cross_encoder
from service.models.onnx_cross_encoder import load_cross_encoder
from tests.support.timing import assert_within
from tests.support.harness import DEFAULT_EMBEDDER, StartServer, evidence_of, legs_of, result_of

pytestmark = [pytest.mark.fault, pytest.mark.slow]

BM25_ONLY = retrieval_pb2.RetrievalOptions(legs=[types_pb2.LEG_KIND_BM25])


@contextlib.contextmanager
def stalled(executor: Executor, workers: int) -> Iterator[None]:
    """Occupy every worker of a real pool until the block exits."""
    gate = threading.Event()
    started = threading.Barrier(workers + 1)

    def hold() -> None:
        started.wait()
        gate.wait(30)

    for _ in range(workers):
        executor.submit(hold)
    started.wait(5)
    try:
        yield
    finally:
        gate.set()


async def test_stalled_legs_give_timeout_within_the_callers_deadline(start_server: StartServer) -> None:
    live = await start_server()
    with stalled(live.app.engine.executor, 1), stalled(live.app.runtime.executor, 2):  # type: ignore[attr-defined]
        t0 = time.monotonic()
        events = await live.retrieve(query="reset password", top_k=3, timeout=1.0)
        elapsed = time.monotonic() - t0
    result = result_of(events)
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_TIMEOUT
    assert result.evidence_status == types_pb2.EVIDENCE_STATUS_NO_EVIDENCE
    legs = legs_of(result)
    assert legs["LEG_KIND_BM25"] == legs["LEG_KIND_KNN"] == "LEG_STATUS_TIMEOUT"
    # The TIMEOUT result itself shows the server answered before the caller's 1.0 s deadline
    # (after it the client sees DEADLINE_EXCEEDED); the client-side clock gets the load margin.
    assert_within(elapsed, 1.0, "the attempt answered")


async def test_no_lexical_hits_and_a_knn_timeout_is_timeout_never_empty(start_server: StartServer) -> None:
    live = await start_server()
    with stalled(live.app.runtime.executor, 2):
        result = result_of(await live.retrieve(query="qzxjv wkpfy", top_k=3, timeout=1.0))
    legs = {leg.kind: leg for leg in result.legs}
    assert legs[types_pb2.LEG_KIND_BM25].status == types_pb2.LEG_STATUS_OK
    assert legs[types_pb2.LEG_KIND_BM25].hit_count == 0
    assert legs[types_pb2.LEG_KIND_KNN].status == types_pb2.LEG_STATUS_TIMEOUT
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_TIMEOUT


async def test_a_stalled_vector_leg_degrades_to_lexical_evidence(start_server: StartServer) -> None:
    live = await start_server()
    with stalled(live.app.runtime.executor, 2):
        events = await live.retrieve(query="reset password link", top_k=3, timeout=1.0)
    result = result_of(events)
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND
    assert result.degraded and result.stopping_reason == "completed_degraded"
    assert legs_of(result)["LEG_KIND_KNN"] == "LEG_STATUS_TIMEOUT"
    assert evidence_of(events)[0].source_id == "kb-password-reset"
    # Judged as a BM25-only list (the calibration's "bm25" model), not as a two-leg one.
    assert result.quality_source == types_pb2.QUALITY_SOURCE_HYBRID_CALIBRATED


async def test_a_failed_engine_is_backend_error(start_server: StartServer) -> None:
    live = await start_server()
    await live.app.engine.close()
    result = result_of(await live.retrieve(query="reset password", top_k=3))
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_BACKEND_ERROR
    assert set(legs_of(result).values()) >= {"LEG_STATUS_ERROR"}
    assert legs_of(result)["LEG_KIND_BM25"] == "LEG_STATUS_ERROR"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await live.retrieval.Lookup(retrieval_pb2.RetrieveRequest(query="reset password", top_k=3))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "BACKEND_ERROR" in (err.value.details() or "")


async def test_a_failed_model_runtime_degrades_to_lexical(start_server: StartServer) -> None:
    live = await start_server()
    live.app.runtime.executor.shutdown(wait=True)  # the model runtime is gone
    result = result_of(await live.retrieve(query="invoice pdf", top_k=3))
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND and result.degraded
    knn = next(leg for leg in result.legs if leg.kind == types_pb2.LEG_KIND_KNN)
    assert knn.status == types_pb2.LEG_STATUS_ERROR and knn.detail


async def test_lookup_maps_timeout_to_deadline_exceeded(start_server: StartServer) -> None:
    live = await start_server()
    with stalled(live.app.engine.executor, 1), stalled(live.app.runtime.executor, 2):  # type: ignore[attr-defined]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await live.retrieval.Lookup(retrieval_pb2.RetrieveRequest(query="refund", top_k=3), timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "TIMEOUT" in (err.value.details() or ""), "our mapping, not the transport's own deadline"
    attempt_id = dict(err.value.trailing_metadata() or ())["x-attempt-id"]
    rec = await live.retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=attempt_id))
    assert rec.attempt.outcome == types_pb2.ATTEMPT_OUTCOME_TIMEOUT


async def test_a_caller_that_cancels_mid_stream_is_recorded_as_cancelled(start_server: StartServer) -> None:
    live = await start_server()
    query = "cancel me mid stream"
    with stalled(live.app.engine.executor, 1), stalled(live.app.runtime.executor, 2):  # type: ignore[attr-defined]
        call = live.retrieval.Retrieve(retrieval_pb2.RetrieveRequest(query=query, top_k=3), timeout=20)
        reader = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.3)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
    db = Path(live.app.cfg.data_dir) / "ledger.sqlite3"
    outcome = None
    for _ in range(50):
        with sqlite3.connect(db) as conn:
            row = conn.execute("SELECT outcome, stopping_reason FROM attempts WHERE query = ?", (query,)).fetchone()
        if row:
            outcome = row
            break
        await asyncio.sleep(0.1)
    assert outcome == ("CANCELLED", "cancelled")


async def test_overload_is_resource_exhausted_with_a_retry_delay(start_server: StartServer) -> None:
    live = await start_server(max_inflight_attempts=1)
    with stalled(live.app.engine.executor, 1), stalled(live.app.runtime.executor, 2):  # type: ignore[attr-defined]
        first = asyncio.ensure_future(live.retrieve(query="first", top_k=1, timeout=1.5))
        await asyncio.sleep(0.2)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await live.retrieve(query="second", top_k=1)
        await first
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(err.value.trailing_metadata() or ())["retry-after-ms"]) > 0


@pytest.fixture
def tiny_reranker(tmp_path: Path):  # type: ignore[no-untyped-def]
    from service.offline.builder import default_models_dir

    out = build_tiny_cross_encoder(tmp_path / "tiny-ce", default_models_dir() / DEFAULT_EMBEDDER / "tokenizer.json")
    return load_cross_encoder(out, threads=1)


async def test_reranker_timeout_falls_back_to_the_fused_order_and_says_so(start_server: StartServer, tiny_reranker) -> None:  # type: ignore[no-untyped-def]
    live = await start_server(reranker=tiny_reranker)
    baseline = await live.retrieve(query="invoice", top_k=3, options=retrieval_pb2.RetrievalOptions(
        legs=[types_pb2.LEG_KIND_BM25], rerank=types_pb2.RERANK_MODE_OFF))
    with stalled(live.app.runtime.executor, 2):
        events = await live.retrieve(query="invoice", top_k=3, options=BM25_ONLY, timeout=1.0)
    result = result_of(events)
    rerank = next(leg for leg in result.legs if leg.kind == types_pb2.LEG_KIND_RERANK)
    assert rerank.status == types_pb2.LEG_STATUS_TIMEOUT and "fell back to the fused order" in rerank.detail
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND and result.degraded
    assert [e.evidence_id for e in evidence_of(events)] == [e.evidence_id for e in evidence_of(baseline)]
    assert all(not e.HasField("rerank_score") for e in evidence_of(events))


async def test_corpus_calls_on_a_failed_engine_are_unavailable_never_unknown(start_server: StartServer) -> None:
    from service._gen.retrieval.v1 import corpus_pb2
    from tests.support.harness import demo_documents

    live = await start_server()
    await live.app.engine.close()
    for call in (live.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id="kb-billing#0@v1")),
                 live.corpus.DeleteDocument(corpus_pb2.DeleteDocumentRequest(source_id="kb-billing"))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    summary = await live.ingest(demo_documents()[:2])  # per-document failures, reported
    assert summary.documents_indexed == 0 and len(summary.errors) == 2
    assert all("EngineUnavailable" in e.message for e in summary.errors)
