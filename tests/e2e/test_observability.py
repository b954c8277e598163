"""Observability end to end: /metrics on its own port counts exactly what callers saw,
shedding is counted, a trace of one attempt reaches a local OTLP receiver with the
expected spans, and JSON log lines carry the attempt id."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter

import grpc
import pytest

from service._gen.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc, types_pb2
from service.observability.logs import ATTEMPT_LOGGER, JsonFormatter
from tests.support.harness import DEFAULT_EMBEDDER, result_of
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.scrape import by_label, scrape

QUERIES = ["how do I reset my password", "如何开具发票", "refund policy", "what changed in v2.4"]


def _outcome(events: list[retrieval_pb2.RetrieveEvent]) -> str:
    return types_pb2.AttemptOutcome.Name(result_of(events).outcome).removeprefix("ATTEMPT_OUTCOME_")


@pytest.fixture
def receiver() -> OtlpReceiver:
    r = OtlpReceiver()
    yield r
    r.close()


async def test_metrics_count_what_callers_saw_and_traces_reach_otlp(receiver: OtlpReceiver, start_server) -> None:
    live = await start_server(metrics_listen="127.0.0.1:0", otlp_endpoint=receiver.endpoint)
    url = f"http://127.0.0.1:{live.server.metrics_port}/metrics"
    before = await asyncio.to_thread(scrape, url)
    seen: Counter[str] = Counter()
    for q in QUERIES * 2:
        seen[_outcome(await live.retrieve(query=q, top_k=3))] += 1
    seen[_outcome(await live.retrieve(query="zebra migration patterns", top_k=2,
                                      options=retrieval_pb2.RetrievalOptions(min_quality=0.99)))] += 1
    seen[_outcome(await live.retrieve(query="what is my account email", top_k=3, gap=retrieval_pb2.EvidenceGap(
        gap_id="g-1", kind=types_pb2.GAP_KIND_USER_INFORMATION, question="user's email")))] += 1
    lookup = await live.retrieval.Lookup(retrieval_pb2.RetrieveRequest(query=QUERIES[0], top_k=2), timeout=10)
    seen["EVIDENCE_FOUND" if lookup.evidence_status == types_pb2.EVIDENCE_STATUS_EVIDENCE_FOUND else "?"] += 1
    assert {"EVIDENCE_FOUND", "INSUFFICIENT", "PERMISSION_DENIED"} <= set(seen)

    after = await asyncio.to_thread(scrape, url)
    counted = by_label(after, "retrieval_attempts_total", "outcome")
    assert {k: v for k, v in counted.items() if v} == dict(seen), (counted, seen)
    assert not by_label(before, "retrieval_attempts_total", "outcome")
    # Every searched attempt ran both legs; the histogram counts one sample per leg report.
    legs = {(dict(l)["leg"], dict(l)["status"]): v for (n, l), v in after.items()
            if n == "retrieval_leg_latency_seconds_count"}
    searched = sum(seen.values()) - seen["PERMISSION_DENIED"]
    assert legs[("BM25", "OK")] == searched and legs[("KNN", "OK")] == searched
    # Each KNN leg looked its query up in the embedding cache (the queries repeat); every
    # miss ran in a batch (the warm-up too) whose wait was measured.
    cache = by_label(after, "retrieval_query_embedding_cache_total", "result")
    assert cache["hit"] + cache["miss"] == searched and cache["hit"] >= len(QUERIES)
    sizes = by_label(after, "retrieval_model_batch_size_count", "model")
    assert sizes["embed-query"] >= cache["miss"]
    assert by_label(after, "retrieval_model_queue_wait_seconds_count", "model")["embed-query"] >= cache["miss"]
    assert by_label(after, "retrieval_model_inference_seconds_count", "model")["embed-query"] >= 1
    assert ("retrieval_model_queue_depth", (("model", "embed-query"),)) in after
    assert after[("retrieval_event_loop_lag_seconds_count", ())] > 0
    assert by_label(after, "retrieval_ingest_documents_total", "status")["indexed"] > 0  # the demo corpus
    assert after[("retrieval_inflight_attempts", ())] == 0
    # The int8 kernels this CPU runs: the exact ones only where the fast ones saturate.
    from service.models._ort import u8s8_saturates

    assert after[("retrieval_int8_exact_kernels", ())] == (1 if u8s8_saturates() else 0)

    # The trace of one attempt: attempt -> leg BM25 / leg KNN -> model / engine spans.
    # A question not asked before: a cached query embedding has no model span.
    call = live.retrieval.Retrieve(retrieval_pb2.RetrieveRequest(query="I forgot my password, how do I reset it", top_k=3),
                                   timeout=10)
    events = [ev async for ev in call]
    attempt_id = dict(await call.trailing_metadata())["x-attempt-id"]
    assert result_of(events).attempt_id == attempt_id
    assert await asyncio.to_thread(live.app.tracer.flush)
    spans = await asyncio.to_thread(receiver.trace_of, attempt_id)
    by_name = {s.name: s for s in spans}
    assert {"attempt", "leg BM25", "leg KNN", f"model {DEFAULT_EMBEDDER}", "engine embedded"} <= set(by_name), sorted(by_name)
    root = by_name["attempt"]
    assert root.parent_span_id == "" and root.attributes["retrieval.outcome"] == "EVIDENCE_FOUND"
    assert root.resource["service.name"] == "retrieval-service"
    for leg in ("leg BM25", "leg KNN"):
        assert by_name[leg].parent_span_id == root.span_id
        assert root.start_ns <= by_name[leg].start_ns <= by_name[leg].end_ns <= root.end_ns
    assert by_name[f"model {DEFAULT_EMBEDDER}"].parent_span_id == by_name["leg KNN"].span_id
    assert by_name[f"model {DEFAULT_EMBEDDER}"].attributes["retrieval.model.inference_ms"] > 0
    engine_parents = {s.parent_span_id for s in spans if s.name == "engine embedded"}
    assert engine_parents == {by_name["leg BM25"].span_id, by_name["leg KNN"].span_id}


async def test_shed_requests_are_counted(start_server) -> None:
    live = await start_server(metrics_listen="127.0.0.1:0", max_inflight_attempts=1)
    url = f"http://127.0.0.1:{live.server.metrics_port}/metrics"

    async def one(q: str) -> str:
        try:
            return _outcome(await live.retrieve(query=q, top_k=3))
        except grpc.aio.AioRpcError as err:
            return err.code().name

    got = Counter(await asyncio.gather(*(one(q) for q in QUERIES * 4)))
    assert got["RESOURCE_EXHAUSTED"] > 0, got
    after = await asyncio.to_thread(scrape, url)
    assert by_label(after, "retrieval_shed_total", "reason") == {"inflight_limit": got["RESOURCE_EXHAUSTED"]}
    attempts = sum(by_label(after, "retrieval_attempts_total", "outcome").values())
    assert attempts == sum(v for k, v in got.items() if k != "RESOURCE_EXHAUSTED")


async def test_a_running_limit_queues_then_sheds_on_waiting_time(start_server) -> None:
    """max_running_attempts = 1: a burst waits for the one slot (the wait is in the
    x-timing-admission-ms trailer); waits past the admission interval are shed with
    RESOURCE_EXHAUSTED and counted as queue_delay, never recorded as attempts."""
    live = await start_server(metrics_listen="127.0.0.1:0", max_running_attempts=1,
                              admission_target_ms=2, admission_interval_ms=300,
                              max_inflight_attempts=128)
    url = f"http://127.0.0.1:{live.server.metrics_port}/metrics"
    waits: list[float] = []

    async def one(q: str) -> str:
        call = live.retrieval.Retrieve(retrieval_pb2.RetrieveRequest(query=q, top_k=3), timeout=10)
        try:
            events = [ev async for ev in call]
        except grpc.aio.AioRpcError as err:
            assert err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or "waited" in (err.details() or "")
            return err.code().name
        waits.append(float(dict(await call.trailing_metadata())["x-timing-admission-ms"]))
        return _outcome(events)

    # 96 distinct queries at once (no query-embedding cache hits): on any machine more than
    # one runs within the 300 ms interval, and fewer than all of them.
    got = Counter(await asyncio.gather(*(one(f"{q} {i}") for i, q in enumerate(QUERIES * 24))))
    assert got["RESOURCE_EXHAUSTED"] > 0 and got["EVIDENCE_FOUND"] > 0, got
    assert max(waits) > 0, waits  # someone waited for the slot and then ran
    after = await asyncio.to_thread(scrape, url)
    assert by_label(after, "retrieval_shed_total", "reason") == {"queue_delay": got["RESOURCE_EXHAUSTED"]}
    attempts = sum(by_label(after, "retrieval_attempts_total", "outcome").values())
    assert attempts == sum(v for k, v in got.items() if k != "RESOURCE_EXHAUSTED")
    assert live.server.admission.queue is not None
    assert live.server.admission.queue.running == 0 and live.server.admission.inflight == 0
    assert after[("retrieval_admission_queue_depth", ())] == 0


async def test_json_logs_carry_the_attempt_id(demo) -> None:
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Capture()
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(ATTEMPT_LOGGER)
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        call = demo.retrieval.Retrieve(retrieval_pb2.RetrieveRequest(query=QUERIES[0], top_k=2), timeout=10)
        [ev async for ev in call]
        attempt_id = dict(await call.trailing_metadata())["x-attempt-id"]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    lines = [json.loads(r) for r in records]
    mine = [line for line in lines if line.get("attempt_id") == attempt_id]
    assert len(mine) == 1, lines
    assert mine[0]["outcome"] == "EVIDENCE_FOUND" and mine[0]["level"] == "DEBUG" and mine[0]["total_ms"] > 0


async def test_serve_flags_turn_on_metrics_and_json_logs(tmp_path) -> None:
    """`python -m service serve --metrics-listen ... --log-json` as a user starts it."""
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    from tests.support.service_live import SERVING, wait_health
    from tests.support.tcp_proxy import free_port

    port, mport = free_port(), free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "d"),
             "--embedding-model", "dummy-hash", "--reranker-model", "", "--metrics-listen", f"127.0.0.1:{mport}",
             "--log-json"], cwd=Path(__file__).resolve().parents[2], stdout=log, stderr=subprocess.STDOUT)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await wait_health(channel, SERVING, 60)
            stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
            call = stub.Retrieve(retrieval_pb2.RetrieveRequest(query="anything at all", top_k=2), timeout=10)
            [ev async for ev in call]
            attempt_id = dict(await call.trailing_metadata())["x-attempt-id"]
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode())
        assert 'retrieval_attempts_total{outcome="EMPTY"} 1.0' in text
    finally:
        proc.terminate()
        proc.wait(15)
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert any(line.get("attempt_id") == attempt_id and line["outcome"] == "EMPTY" for line in lines), lines[-5:]
