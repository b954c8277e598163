"""The metrics registry, the Grafana dashboard against it, and the JSON log formatter."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from service.domain import LegKind, LegReport, LegStatus, Outcome
from service.observability.logs import JsonFormatter, current_attempt_id
from service.observability.metrics import ServiceMetrics
from tests.support.scrape import parse, sample_names

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "retrieval-dashboard.json"
README = Path(__file__).resolve().parents[3] / "README.md"
# A PromQL identifier that is not a function, keyword or label name: a metric reference.
_IDENT = re.compile(r"\b(retrieval_[a-z0-9_]+)\b")


def exercised() -> ServiceMetrics:
    """A registry with every labelled series touched once, as a live server would."""
    m = ServiceMetrics()
    m.attempt_finished(Outcome.EVIDENCE_FOUND, 0.01, [LegReport(LegKind.BM25, LegStatus.OK, 1.0)])
    m.shed.labels("inflight_limit").inc()
    m.inflight.inc()
    m.watch_queue("embed-query", lambda: 3.0)
    m.batch_ran("embed-query", 4, [0.001, 0.002], 0.001, 0.004)
    m.dropped("rerank", "deadline", 2)
    m.loop_lag.observe(0.001)
    m.query_cache.labels("hit").inc()
    m.ingested("indexed", 5)
    m.ingested("invalid", 0)
    m.states_write_back.labels("written").inc(3)
    m.states_fill.labels("written").inc(2)
    m.ingest_held_back.inc(0.5)
    m.ingest_states_passes.labels("one").inc(2)
    m.watch_admission_queue(lambda: 2.0)
    m.admission_wait.observe(0.004)
    return m


def test_exposition_counts() -> None:
    samples = parse(exercised().exposition().decode())
    assert samples[("retrieval_attempts_total", (("outcome", "EVIDENCE_FOUND"),))] == 1
    assert samples[("retrieval_leg_latency_seconds_count", (("leg", "BM25"), ("status", "OK")))] == 1
    assert samples[("retrieval_model_queue_depth", (("model", "embed-query"),))] == 3
    assert samples[("retrieval_model_queue_wait_seconds_count", (("model", "embed-query"),))] == 2
    assert samples[("retrieval_model_dropped_items_total", (("model", "rerank"), ("reason", "deadline")))] == 2
    assert samples[("retrieval_ingest_chunks_total", ())] == 5
    assert samples[("retrieval_ingest_errors_total", (("reason", "invalid"),))] == 1
    assert samples[("retrieval_admission_queue_depth", ())] == 2
    assert samples[("retrieval_admission_wait_seconds_count", ())] == 1


def test_dashboard_is_valid_and_every_panel_metric_exists() -> None:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    names = sample_names(parse(exercised().exposition().decode()))
    assert dash["panels"]
    charted: set[str] = set()
    for panel in dash["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs, panel["title"]
        for expr in exprs:
            used = set(_IDENT.findall(expr))
            assert used, (panel["title"], expr)
            missing = used - names
            assert not missing, (panel["title"], missing)
            charted |= used
    families = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum").removesuffix("_total")
                for n in names if not n.endswith("_created")}
    assert {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum").removesuffix("_total")
            for n in charted} == families  # every metric has a panel


def test_readme_documents_every_metric() -> None:
    text = README.read_text(encoding="utf-8")
    names = {n for n in sample_names(parse(exercised().exposition().decode())) if not n.endswith("_created")}
    families = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in names}
    missing = sorted(f for f in families if f"`{f}`" not in text)
    assert not missing, missing


def test_json_formatter_adds_attempt_id_and_extras() -> None:
    record = logging.LogRecord("service.x", logging.WARNING, __file__, 1, "leg %s slow", ("KNN",), None)
    record.total_ms = 12.5
    token = current_attempt_id.set("abc123")
    try:
        line = json.loads(JsonFormatter().format(record))
    finally:
        current_attempt_id.reset(token)
    assert line["attempt_id"] == "abc123" and line["message"] == "leg KNN slow"
    assert line["level"] == "WARNING" and line["total_ms"] == 12.5 and line["ts"].endswith("Z")
    assert "attempt_id" not in json.loads(JsonFormatter().format(record))
