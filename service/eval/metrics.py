"""Ranking metrics with binary judgements.

Every function takes one ranked list of document ids (best first; duplicates are ignored
after their first occurrence, so a list of evidence source ids can be passed as is) and the
set of relevant ids.

- ``recall_at_k``: |relevant in the top k| / |relevant| (0 when nothing is relevant).
- ``mrr``: reciprocal rank of the first relevant id within the top ``k`` (default 100, the
  depth the evaluation retrieves; ``k=None`` scans the whole list), 0 when none is found:
  reported as MRR@100.
- ``ndcg_at_k``: binary gains, DCG = sum over ranks i <= k of rel_i / log2(i + 1), divided
  by the ideal DCG of min(|relevant|, k) relevant ids at the top.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence


def _unique(ranked: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for d in ranked:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def recall_at_k(ranked: Sequence[str], relevant: set[str], k: int) -> float:
    if not relevant:
        return 0.0
    return len(set(_unique(ranked)[:k]) & relevant) / len(relevant)


def mrr(ranked: Sequence[str], relevant: set[str], k: int | None = 100) -> float:
    top = _unique(ranked)
    if k is not None:
        top = top[:k]
    for i, d in enumerate(top, start=1):
        if d in relevant:
            return 1.0 / i
    return 0.0


def ndcg_at_k(ranked: Sequence[str], relevant: set[str], k: int = 10) -> float:
    if not relevant:
        return 0.0
    dcg = sum(1.0 / math.log2(i + 1) for i, d in enumerate(_unique(ranked)[:k], start=1) if d in relevant)
    ideal = sum(1.0 / math.log2(i + 1) for i in range(1, min(len(relevant), k) + 1))
    return dcg / ideal


METRICS = ("recall@10", "recall@100", "mrr@100", "ndcg@10")


def per_query(ranked: Sequence[str], relevant: set[str]) -> dict[str, float]:
    return {
        "recall@10": recall_at_k(ranked, relevant, 10),
        "recall@100": recall_at_k(ranked, relevant, 100),
        "mrr@100": mrr(ranked, relevant, 100),
        "ndcg@10": ndcg_at_k(ranked, relevant, 10),
    }


def evaluate(run: Mapping[str, Sequence[str]], qrels: Mapping[str, set[str]]) -> dict[str, float]:
    """Mean of each metric over the judged queries (a query missing from ``run`` counts
    as an empty ranking, i.e. zero)."""
    rows = [per_query(run.get(q, []), rel) for q, rel in qrels.items() if rel]
    if not rows:
        return {m: 0.0 for m in METRICS}
    return {m: statistics.fmean(r[m] for r in rows) for m in METRICS}


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in [0, 100]); 0 for an empty list."""
    if not values:
        return 0.0
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]
