"""Query variants: each variant's ranked list is fused with Reciprocal Rank Fusion.

A candidate keeps the signals (BM25 score, dense distance, fused score) of the variant
that ranked it best, so the quality calibrations, fitted on single-query hybrid lists,
still see the scale they were fitted on; the order comes from the RRF over variants.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.pipeline.fusion import Candidate

# RRF constant across variants: the standard 60, since variants are near-duplicates of one
# question and no variant should dominate by rank alone.
VARIANT_RRF_K = 60


def fuse_variants(lists: Sequence[list[Candidate]], k: int = VARIANT_RRF_K) -> list[tuple[Candidate, float]]:
    """(candidate, order score) in fused order. One list: its own order, scored by the
    fused score; several: RRF over the lists."""
    if len(lists) == 1:
        return [(c, c.fused_score) for c in lists[0]]
    best: dict[str, Candidate] = {}
    score: dict[str, float] = {}
    for ranked in lists:
        for rank, c in enumerate(ranked, start=1):
            cid = c.chunk.chunk_id
            score[cid] = score.get(cid, 0.0) + 1.0 / (k + rank)
            if cid not in best or c.fused_score > best[cid].fused_score:
                best[cid] = c
    order = sorted(score, key=lambda cid: -score[cid])
    return [(best[cid], score[cid]) for cid in order]
