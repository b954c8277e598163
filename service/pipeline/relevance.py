"""Quality of a candidate and the coarse relevance level of a whole call.

Quality sources, in order of preference (the attempt says which one it used):
1. reranker probability: sigmoid of the cross-encoder logit, when the rerank leg ran;
2. dense distance: 1 - L2 / max_l2 (max_l2 = 2 for unit vectors), when the vector leg
   returned the document;
3. rank fallback: the fused RRF score divided by the best possible fused score, so a
   document ranked first by every leg that ran scores 1.0.
"""

from __future__ import annotations

import math

from service.domain import QualitySource, RelevanceLevel
from service.pipeline.fusion import Candidate

MAX_L2 = 2.0


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def assign_quality(c: Candidate, *, reranked: bool, max_fused: float) -> QualitySource:
    if reranked and c.rerank_score is not None:
        c.quality = sigmoid(c.rerank_score)
        return QualitySource.RERANKER_PROBABILITY
    if c.distance is not None:
        c.quality = max(0.0, min(1.0, 1.0 - c.distance / MAX_L2))
        return QualitySource.DENSE_DISTANCE
    c.quality = max(0.0, min(1.0, c.fused_score / max_fused)) if max_fused > 0 else 0.0
    return QualitySource.RANK_FALLBACK


def relevance_level(top_quality: float | None, precise: float, reference: float) -> RelevanceLevel:
    if top_quality is None:
        return RelevanceLevel.NONE
    if top_quality >= precise:
        return RelevanceLevel.PRECISE
    if top_quality >= reference:
        return RelevanceLevel.REFERENCE
    return RelevanceLevel.NONE
