"""The shared vocabulary of an attempt (mirrors the proto enums; the api layer converts).

Kept free of gRPC and of any engine so every layer can use it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Outcome(enum.Enum):
    EVIDENCE_FOUND = "EVIDENCE_FOUND"
    EMPTY = "EMPTY"
    INSUFFICIENT = "INSUFFICIENT"
    INADMISSIBLE = "INADMISSIBLE"
    TIMEOUT = "TIMEOUT"
    BACKEND_ERROR = "BACKEND_ERROR"
    BUDGET_DENIED = "BUDGET_DENIED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    CANCELLED = "CANCELLED"


class LegKind(enum.Enum):
    BM25 = "BM25"
    KNN = "KNN"
    RERANK = "RERANK"
    KNN_LATIN = "KNN_LATIN"  # the Latin-script embedder's kNN (latin_embedding_model)


# The legs that retrieve (every kind but RERANK, which reorders what they found).
SEARCH_LEGS = (LegKind.BM25, LegKind.KNN, LegKind.KNN_LATIN)


class LegStatus(enum.Enum):
    OK = "OK"
    TIMEOUT = "TIMEOUT"
    ERROR = "ERROR"
    SKIPPED = "SKIPPED"


class RelevanceLevel(enum.Enum):
    NONE = "NONE"
    PRECISE = "PRECISE"
    HIGHLY_RELEVANT = "HIGHLY_RELEVANT"  # reserved
    REFERENCE = "REFERENCE"


class QualitySource(enum.Enum):
    NONE = "NONE"
    DENSE_DISTANCE = "DENSE_DISTANCE"
    RANK_FALLBACK = "RANK_FALLBACK"
    RERANKER_PROBABILITY = "RERANKER_PROBABILITY"
    HYBRID_CALIBRATED = "HYBRID_CALIBRATED"


class GapKind(enum.Enum):
    UNSPECIFIED = "UNSPECIFIED"
    USER_INFORMATION = "USER_INFORMATION"
    EXTERNAL_KNOWLEDGE = "EXTERNAL_KNOWLEDGE"


COLLECTIONS = ("doc", "faq")
STATUSES = ("approved", "draft", "retired")


@dataclass
class LegTiming:
    queue_ms: float = 0.0
    tokenize_ms: float = 0.0
    inference_ms: float = 0.0

    def plus(self, other: LegTiming) -> LegTiming:
        return LegTiming(self.queue_ms + other.queue_ms, self.tokenize_ms + other.tokenize_ms,
                         self.inference_ms + other.inference_ms)


@dataclass
class LegReport:
    kind: LegKind
    status: LegStatus
    latency_ms: float = 0.0
    hit_count: int = 0
    detail: str = ""
    timing: LegTiming | None = None


@dataclass
class AttemptRecord:
    """An attempt as the ledger stores it: a fact, whatever its outcome."""

    attempt_id: str
    run_id: str
    gap_id: str
    channel: str
    query: str
    requested_top_k: int
    outcome: Outcome
    stopping_reason: str
    principal: str
    created_at_ms: int
    evidence_ids: list[str] = field(default_factory=list)
    retrieved_count: int = 0
    admissible_count: int = 0
    legs: list[LegReport] = field(default_factory=list)
    budget_before: int | None = None
    budget_after: int | None = None
    total_ms: float = 0.0
    model_ids: list[str] = field(default_factory=list)
    plan_reason: str = ""  # the executed plan's reason; "" without a plan
