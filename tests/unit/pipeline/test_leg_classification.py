"""How engine answers and failures become leg statuses (the rules behind every outcome)."""

from __future__ import annotations

import pytest

from service.domain import LegKind, LegStatus
from service.engines.base import EngineTimeout, EngineUnavailable, PartialReason, SearchResponse
from service.errors import DeadlineExceeded, Overloaded
from service.pipeline.attempt import _from_response
from service.pipeline.legs import classify_failure


def test_engine_timed_out_with_zero_hits_is_a_timeout_leg_not_an_empty_one() -> None:
    run = _from_response(LegKind.BM25, SearchResponse(hits=[], complete=False,
                                                      partial_reason=PartialReason.TIMED_OUT), 12.0)
    assert run.report.status is LegStatus.TIMEOUT and run.report.hit_count == 0
    assert "timed_out" in run.report.detail


def test_failed_shards_are_an_error_leg_and_a_complete_answer_is_ok() -> None:
    shards = _from_response(LegKind.KNN, SearchResponse(hits=[], complete=False,
                                                        partial_reason=PartialReason.SHARDS_FAILED), 1.0)
    assert shards.report.status is LegStatus.ERROR
    assert _from_response(LegKind.KNN, SearchResponse(hits=[]), 1.0).report.status is LegStatus.OK


@pytest.mark.parametrize("exc,status", [
    (EngineTimeout("slow"), LegStatus.TIMEOUT),
    (TimeoutError(), LegStatus.TIMEOUT),
    (DeadlineExceeded("queue"), LegStatus.TIMEOUT),
    (EngineUnavailable("refused"), LegStatus.ERROR),
    (Overloaded("full", 0.1), LegStatus.ERROR),
    (RuntimeError("boom"), LegStatus.ERROR),
])
def test_exceptions_map_to_timeout_or_error(exc: BaseException, status: LegStatus) -> None:
    assert classify_failure(exc)[0] is status
