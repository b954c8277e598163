"""Fusion of the lexical and vector ranked lists.

Reciprocal Rank Fusion (Cormack et al. 2009): score(d) = sum_leg w_leg / (k + rank_leg(d)),
rank 1-based, k = 60 by default. Scores from different legs are on different scales, so
RRF uses ranks only; weights let a tuned deployment favour one leg.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from service.config import Config
from service.domain import LegKind
from service.engines.base import ChunkRecord, Hit
from service.script import has_han


@dataclass(frozen=True)
class FusionParams:
    rrf_k: int
    bm25_weight: float
    knn_weight: float
    latin_knn_weight: float = 0.0  # the Latin-script dense leg (queries without Han characters)


def is_cjk(query: str) -> bool:
    """The query has Han characters: it is treated as Chinese (fusion and quality calibration)."""
    return has_han(query)


def fusion_for(query: str, cfg: Config, *, latin: bool = True) -> FusionParams:
    """Per-language fusion settings: BM25 over cjk bigrams and dense similarity trade off
    differently in Chinese and English, and English has a third leg where the Latin-script
    embedder is served (tuned on InsuranceQA train, service/eval/fusion_tuned.json).
    ``latin``: False where that leg is served but does not run for this request (not asked
    for, or skipped while the store catches up), so the two legs fuse as without it."""
    if is_cjk(query):
        return FusionParams(cfg.cjk_rrf_k, cfg.cjk_bm25_weight, cfg.cjk_knn_weight)
    if cfg.latin_embedding_model and latin:  # three legs: the Latin-script one runs for this query
        return FusionParams(cfg.latin_leg_rrf_k, cfg.latin_leg_bm25_weight, cfg.latin_leg_knn_weight,
                            cfg.latin_knn_weight)
    return FusionParams(cfg.rrf_k, cfg.bm25_weight, cfg.knn_weight)


@dataclass
class Candidate:
    chunk: ChunkRecord
    fused_score: float = 0.0
    bm25_score: float | None = None
    bm25_rank: int | None = None
    distance: float | None = None  # L2 between unit vectors
    knn_rank: int | None = None
    latin_distance: float | None = None  # the Latin-script dense leg's L2
    latin_rank: int | None = None
    rerank_score: float | None = None
    quality: float = 0.0

    @property
    def dense_score(self) -> float | None:
        """Cosine similarity recovered from the unit-vector L2 distance."""
        return None if self.distance is None else 1.0 - self.distance * self.distance / 2.0

    @property
    def latin_dense_score(self) -> float | None:
        """The Latin-script embedder's cosine similarity."""
        return None if self.latin_distance is None else 1.0 - self.latin_distance * self.latin_distance / 2.0


def rrf(
    bm25: list[Hit], knn: list[Hit], *, k: int = 60, bm25_weight: float = 1.0, knn_weight: float = 1.0,
    latin: Sequence[Hit] = (), latin_weight: float = 0.0,
) -> list[Candidate]:
    """Fuse the ranked hit lists (``latin``: the Latin-script dense leg's, when it ran); ties
    keep BM25 order, then kNN order, then the Latin leg's (stable)."""
    by_id: dict[str, Candidate] = {}
    for rank, hit in enumerate(bm25, start=1):
        c = by_id.setdefault(hit.chunk.chunk_id, Candidate(hit.chunk))
        c.bm25_score, c.bm25_rank = hit.score, rank
        c.fused_score += bm25_weight / (k + rank)
    for rank, hit in enumerate(knn, start=1):
        c = by_id.setdefault(hit.chunk.chunk_id, Candidate(hit.chunk))
        c.distance, c.knn_rank = hit.distance, rank
        c.fused_score += knn_weight / (k + rank)
    for rank, hit in enumerate(latin, start=1):
        c = by_id.setdefault(hit.chunk.chunk_id, Candidate(hit.chunk))
        c.latin_distance, c.latin_rank = hit.distance, rank
        c.fused_score += latin_weight / (k + rank)
    return sorted(by_id.values(), key=lambda c: -c.fused_score)


def fuse_legs(bm25: list[Hit], knn: list[Hit], fusion: FusionParams, latin: Sequence[Hit] = ()) -> list[Candidate]:
    """``rrf`` with a query's fusion parameters."""
    return rrf(bm25, knn, k=fusion.rrf_k, bm25_weight=fusion.bm25_weight, knn_weight=fusion.knn_weight,
               latin=latin, latin_weight=fusion.latin_knn_weight)


def fuse_by_leg(hits: Mapping[LegKind, list[Hit]], fusion: FusionParams) -> list[Candidate]:
    """``fuse_legs`` over the hit lists of the legs that ran, by leg kind."""
    return fuse_legs(hits.get(LegKind.BM25, []), hits.get(LegKind.KNN, []), fusion, hits.get(LegKind.KNN_LATIN, []))


def leg_weight(kind: LegKind, fusion: FusionParams) -> float:
    """A search leg's RRF weight."""
    if kind is LegKind.BM25:
        return fusion.bm25_weight
    return fusion.latin_knn_weight if kind is LegKind.KNN_LATIN else fusion.knn_weight


def max_rrf_score(weights: list[float], k: int) -> float:
    """The score of a document ranked first by every leg that ran."""
    return sum(w / (k + 1) for w in weights)


# The alphas the trainer and `service eval` measure the interpolation at.
INTERPOLATION_ALPHAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def minmax(values: Sequence[float]) -> list[float]:
    """Scale to [0, 1]; all zeros when every value is the same."""
    if not values:
        return []
    lo, hi = min(values), max(values)
    return [(v - lo) / (hi - lo) if hi > lo else 0.0 for v in values]


def interpolate(rerank: Sequence[float], first_stage: Sequence[float], alpha: float) -> list[float]:
    """``alpha * minmax(rerank) + (1 - alpha) * minmax(first_stage)`` per candidate: how the
    trainer and ``service eval`` sweep ``alpha`` (the rerank stage serves the same order
    through ``head_order.HeadOrder.from_alpha`` when a reranker ships no rerank order)."""
    return [alpha * r + (1.0 - alpha) * f for r, f in zip(minmax(rerank), minmax(first_stage))]
