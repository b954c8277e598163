"""Prometheus metrics: one registry per App, served on its own HTTP port (``metrics_listen``).

Each App owns a ``ServiceMetrics`` with a private ``CollectorRegistry`` (not the process-wide
default) so several servers in one process (the tests) count independently and a scrape
shows exactly one server's work. Every metric is documented in README "Observability";
``deploy/grafana/retrieval-dashboard.json`` charts them (a test checks its queries name
only metrics this module exposes).

Nothing here imports grpc: the transport, the pipeline and the model runtime report into it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

if TYPE_CHECKING:
    from service.domain import LegReport, Outcome

log = logging.getLogger(__name__)

# Latency buckets (seconds) from 1 ms (a BM25 leg) to 30 s (an overloaded rerank).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Event-loop lag: the interesting range is well below a millisecond up to a stall.
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 20, 32, 40, 64, 128)
# How often the event-loop lag probe wakes up.
LAG_INTERVAL_S = 0.05


class ServiceMetrics:
    """Every metric the service exposes, on one registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.attempts = Counter(
            "retrieval_attempts", "Attempts finished (recorded in the ledger), by outcome",
            ["outcome"], registry=r)
        self.attempt_seconds = Histogram(
            "retrieval_attempt_duration_seconds", "Attempt wall time from policy checks to the result, by outcome",
            ["outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self.leg_seconds = Histogram(
            "retrieval_leg_latency_seconds", "Latency of each leg of an attempt, by leg and status",
            ["leg", "status"], buckets=LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge("retrieval_inflight_attempts", "Attempts admitted and not yet finished", registry=r)
        self.shed = Counter(
            "retrieval_shed", "Requests refused with RESOURCE_EXHAUSTED before any work, by reason",
            ["reason"], registry=r)
        self.admission_waiting = Gauge(
            "retrieval_admission_queue_depth",
            "Attempts waiting for a running slot (max_running_attempts; 0 without it)", registry=r)
        self.admission_wait = Histogram(
            "retrieval_admission_wait_seconds",
            "Time an admitted attempt waited for a running slot (only with max_running_attempts)",
            buckets=LAG_BUCKETS, registry=r)
        self.queue_depth = Gauge(
            "retrieval_model_queue_depth", "Requests waiting in a model's micro-batch queue", ["model"], registry=r)
        self.int8_exact_kernels = Gauge(
            "retrieval_int8_exact_kernels",
            "1 where the int8 models run onnxruntime's exact (slower) kernels because its fast ones saturate on "
            "this CPU (graphs with 7-bit weights keep the fast ones), 0 where the fast ones are exact", registry=r)
        self.batch_size = Histogram(
            "retrieval_model_batch_size", "Items per model batch run", ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.queue_wait = Histogram(
            "retrieval_model_queue_wait_seconds", "Time a request waited before a worker ran its batch",
            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokenize_seconds = Histogram(
            "retrieval_model_tokenize_seconds", "Tokenizer time per batch", ["model"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.inference_seconds = Histogram(
            "retrieval_model_inference_seconds", "onnxruntime time per batch", ["model"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.model_dropped = Counter(
            "retrieval_model_dropped_items", "Items a model never ran: caller gone, deadline passed or queue full",
            ["model", "reason"], registry=r)
        self.query_cache = Counter(
            "retrieval_query_embedding_cache", "Query embedding cache lookups, by result (hit, miss)",
            ["result"], registry=r)
        self.loop_lag = Histogram(
            "retrieval_event_loop_lag_seconds", "How late the event loop woke a timer (sampled every 50 ms)",
            buckets=LAG_BUCKETS, registry=r)
        self.ingest_documents = Counter(
            "retrieval_ingest_documents", "Documents received by Ingest, by result (indexed, unchanged, invalid, failed)",
            ["status"], registry=r)
        self.ingest_chunks = Counter("retrieval_ingest_chunks", "Chunks written by Ingest", registry=r)
        self.ingest_errors = Counter(
            "retrieval_ingest_errors", "Documents Ingest could not index, by reason (invalid, failed)",
            ["reason"], registry=r)
        self.states_write_back = Counter(
            "retrieval_passage_states_write_back",
            "Passage states reranks computed and offered for storage, by result (written; stale: the chunk "
            "changed or went; skipped: too many writes in flight; failed)", ["result"], registry=r)
        self.states_fill = Counter(
            "retrieval_passage_states_fill",
            "Chunks the background fill of passage states handled, by result (written; had: stored meanwhile, "
            "by a rerank's write-back or a re-ingest; stale: the chunk changed or went before it was stored)",
            ["result"], registry=r)
        self.states_fill_pending = Gauge(
            "retrieval_passage_states_fill_pending", "Chunks ingest handed to the fill of passage states, not yet filled",
            registry=r)
        self.states_fill_scanning = Gauge(
            "retrieval_passage_states_fill_scanning",
            "1 while the fill of passage states has a scan of the store due or running (at start, or after more "
            "chunks were handed over than it keeps)", registry=r)
        self.ingest_states_passes = Counter(
            "retrieval_ingest_passage_states",
            "Chunks ingest computed passage states for, by pass (one: tapped from the embedding pass; two: the "
            "reranker's lower layers ran again, the chunk's rows differ; left: rows differ and "
            "rerank_states_second_pass is off, so the chunk's first rerank computes them)", ["pass"], registry=r)
        self.ingest_held_back = Counter(
            "retrieval_ingest_held_back_seconds", "Time ingest model batches waited because queries were using the models",
            registry=r)
        self._server: object | None = None
        self._lag_task: asyncio.Task[None] | None = None

    # -- reporting ------------------------------------------------------------------------

    def attempt_finished(self, outcome: Outcome, total_s: float, legs: list[LegReport]) -> None:
        self.attempts.labels(outcome.value).inc()
        self.attempt_seconds.labels(outcome.value).observe(total_s)
        for leg in legs:
            self.leg_seconds.labels(leg.kind.value, leg.status.value).observe(leg.latency_ms / 1000)

    def watch_admission_queue(self, depth: Callable[[], float]) -> None:
        self.admission_waiting.set_function(depth)

    def watch_queue(self, model: str, depth: Callable[[], float]) -> None:
        self.queue_depth.labels(model).set_function(depth)

    def batch_ran(self, model: str, size: int, waits_s: list[float], tokenize_s: float, inference_s: float) -> None:
        self.batch_size.labels(model).observe(size)
        for w in waits_s:
            self.queue_wait.labels(model).observe(w)
        self.tokenize_seconds.labels(model).observe(tokenize_s)
        self.inference_seconds.labels(model).observe(inference_s)

    def dropped(self, model: str, reason: str, items: int) -> None:
        if items:
            self.model_dropped.labels(model, reason).inc(items)

    def ingested(self, status: str, chunks: int) -> None:
        self.ingest_documents.labels(status).inc()
        if chunks:
            self.ingest_chunks.inc(chunks)
        if status in ("invalid", "failed"):
            self.ingest_errors.labels(status).inc()

    # -- exposition -----------------------------------------------------------------------

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, listen: str) -> int:
        """Serve /metrics on ``HOST:PORT`` (port 0: any free port) in a daemon thread."""
        host, _, port = listen.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host or "0.0.0.0", registry=self.registry)
        self._server = server
        bound: int = server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host or "0.0.0.0", bound)
        return bound

    def start_lag_probe(self) -> None:
        if self._lag_task is None:
            self._lag_task = asyncio.get_running_loop().create_task(self._probe_lag(), name="event-loop-lag")

    async def _probe_lag(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(LAG_INTERVAL_S)
            self.loop_lag.observe(max(0.0, time.monotonic() - before - LAG_INTERVAL_S))

    async def close(self) -> None:
        if self._lag_task is not None:
            self._lag_task.cancel()
            await asyncio.gather(self._lag_task, return_exceptions=True)
            self._lag_task = None
        server = self._server
        if server is not None:
            shutdown = getattr(server, "shutdown")
            await asyncio.to_thread(shutdown)
            getattr(server, "server_close")()
            self._server = None
