"""OpenTelemetry traces of attempts, exported over OTLP/HTTP when ``otlp_endpoint`` is set.

One trace per attempt: an ``attempt`` span (attribute ``retrieval.attempt_id``, the outcome,
the engine) with a child span per leg (``leg BM25``, ``leg KNN``, ``leg RERANK``); under a
leg, a ``model <name>`` span for the model work it waited on and an ``engine <name>`` span
for the search. Why spans are written when the attempt ends rather than opened around each
await: the attempt is an async generator whose stages run under ``asyncio.wait_for`` and
task fan-out, where a "current span" context would leak across yields. Leg spans end when
the pipeline saw the leg finish and start ``latency`` before that; a model span covers the
leg's queue wait + tokenize + inference; a KNN leg's engine span is the rest of the leg.

Each App has its own TracerProvider (never the global one), so export is off by default
and tests in one process do not share exporters.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.domain import LegReport, Outcome

log = logging.getLogger(__name__)


@dataclass
class AttemptTrace:
    """What the pipeline notes while an attempt runs: wall-clock start and when each leg
    was seen finishing (``time.time_ns``)."""

    attempt_id: str
    start_ns: int = field(default_factory=time.time_ns)
    leg_end_ns: dict[str, int] = field(default_factory=dict)

    def leg_seen(self, leg: LegReport) -> None:
        self.leg_end_ns.setdefault(leg.kind.value, time.time_ns())


class Tracer:
    """No-op unless built with an exporter (``from_endpoint`` or a test's span exporter)."""

    def __init__(self, provider: Any = None, engine: str = "", models: dict[str, str] | None = None) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("retrieval.service") if provider is not None else None
        self.engine = engine
        self.models = models or {}  # leg kind -> model id, for the model spans

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @classmethod
    def from_endpoint(cls, endpoint: str, service_name: str) -> Tracer:
        if not endpoint:
            return cls()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
        return cls.with_exporter(OTLPSpanExporter(endpoint=url), service_name)

    @classmethod
    def with_exporter(cls, exporter: Any, service_name: str, *, batch: bool = True) -> Tracer:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        return cls(provider)

    def begin(self, attempt_id: str) -> AttemptTrace | None:
        return AttemptTrace(attempt_id) if self.enabled else None

    def finish(self, trace: AttemptTrace | None, outcome: Outcome, legs: list[LegReport],
               stopping_reason: str) -> None:
        if trace is None or self._tracer is None:
            return
        from opentelemetry import trace as otel
        from opentelemetry.trace import Status, StatusCode

        end_ns = time.time_ns()
        root = self._tracer.start_span("attempt", start_time=trace.start_ns, attributes={
            "retrieval.attempt_id": trace.attempt_id, "retrieval.outcome": outcome.value,
            "retrieval.stopping_reason": stopping_reason, "retrieval.engine": self.engine,
        })
        if outcome.value in ("TIMEOUT", "BACKEND_ERROR"):
            root.set_status(Status(StatusCode.ERROR, outcome.value))
        parent = otel.set_span_in_context(root)
        for leg in legs:
            if leg.status.value == "SKIPPED":
                continue
            leg_end = min(trace.leg_end_ns.get(leg.kind.value, end_ns), end_ns)
            leg_start = max(trace.start_ns, leg_end - int(leg.latency_ms * 1e6))
            span = self._tracer.start_span(f"leg {leg.kind.value}", context=parent, start_time=leg_start, attributes={
                "retrieval.attempt_id": trace.attempt_id, "retrieval.leg": leg.kind.value,
                "retrieval.leg.status": leg.status.value, "retrieval.leg.hits": leg.hit_count,
            })
            if leg.status.value != "OK":
                span.set_status(Status(StatusCode.ERROR, leg.detail[:200]))
            inner = otel.set_span_in_context(span)
            model_ns = 0
            if leg.timing is not None:
                model_ns = int((leg.timing.queue_ms + leg.timing.tokenize_ms + leg.timing.inference_ms) * 1e6)
            model_ns = min(model_ns, leg_end - leg_start)
            if leg.kind.value in ("KNN", "RERANK") and model_ns > 0 and leg.timing is not None:
                model = self._tracer.start_span(f"model {self.models.get(leg.kind.value, leg.kind.value)}",
                                                context=inner, start_time=leg_start, attributes={
                    "retrieval.model.queue_ms": leg.timing.queue_ms,
                    "retrieval.model.tokenize_ms": leg.timing.tokenize_ms,
                    "retrieval.model.inference_ms": leg.timing.inference_ms,
                })
                model.end(end_time=leg_start + model_ns)
            if leg.kind.value in ("BM25", "KNN"):
                engine = self._tracer.start_span(f"engine {self.engine}", context=inner,
                                                 start_time=leg_start + model_ns,
                                                 attributes={"retrieval.engine": self.engine})
                engine.end(end_time=leg_end)
            span.end(end_time=leg_end)
        root.end(end_time=end_ns)

    def flush(self, timeout_s: float = 5.0) -> bool:
        if self._provider is None:
            return True
        return bool(self._provider.force_flush(int(timeout_s * 1000)))

    def close(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self._tracer = None
