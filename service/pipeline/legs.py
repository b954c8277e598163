"""What one leg (or one planned sub-search of it) produced, and how a leg's failure and
model timing are reported (shared by the search legs and the rerank leg)."""

from __future__ import annotations

from dataclasses import dataclass

from service.domain import LegReport, LegStatus, LegTiming
from service.engines.base import EngineTimeout, EngineUnavailable, Hit
from service.errors import DeadlineExceeded, Overloaded
from service.models.runtime import Timing

# Kept back from the caller's deadline for fusion, post-processing and the reply.
REPLY_MARGIN_S = 0.05


@dataclass
class LegRun:
    report: LegReport
    hits: list[Hit]


def classify_failure(exc: BaseException) -> tuple[LegStatus, str]:
    """A leg's exception -> its status (TIMEOUT or ERROR) and the report's detail."""
    if isinstance(exc, (EngineTimeout, DeadlineExceeded, TimeoutError)):
        return LegStatus.TIMEOUT, str(exc) or "deadline share exceeded"
    if isinstance(exc, Overloaded):
        return LegStatus.ERROR, f"overloaded: {exc}"
    if isinstance(exc, EngineUnavailable):
        return LegStatus.ERROR, f"engine unavailable: {exc}"
    return LegStatus.ERROR, f"{type(exc).__name__}: {exc}"


def leg_timing(t: Timing) -> LegTiming:
    return LegTiming(t.queue_ms, t.tokenize_ms, t.inference_ms)
