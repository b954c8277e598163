"""What one leg (or one planned sub-search of it) produced: its report and its hits."""

from __future__ import annotations

from dataclasses import dataclass

from service.domain import LegReport
from service.engines.base import Hit


@dataclass
class LegRun:
    report: LegReport
    hits: list[Hit]
