"""Estimate what two dense legs fused would score, offline, from leg rankings captured
through the service (an evaluation's ``runs/<model>-<mode>.json``: query id -> ranked source
ids, top 100).

The pipeline has one kNN leg (one embedder per index), so "e5 + bge" cannot be run through
the service today; this fuses the captured rankings with the pipeline's weighted-RRF formula
generalised to any number of legs, score(d) = sum over legs of w_leg / (rrf_k + rank_leg(d)),
on source ids (as ``fusion_tune`` does: a close approximation of the pipeline's chunk-level
fusion, which it reports next to the service's own hybrid for the same legs, so the gap is
visible). Legs must come from runs over the same question sample and corpus (same --sample,
--corpus-sample and --seed).

    python -m service.eval.dense_fusion --lang en --sample 300 --seed 0 \\
        --leg bm25=eval-out/en/runs/multilingual-e5-small-int8-bm25.json:0.4 \\
        --leg e5=eval-out/en/runs/multilingual-e5-small-int8-knn.json:1.0 \\
        --leg bge=eval-out/en/runs/bge-small-en-v1.5-int8-knn.json:1.0
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from service.eval.datasets import load_insuranceqa
from service.eval.fusion_tune import rrf_fuse_legs
from service.eval.metrics import evaluate

# With --grid: every leg but the first (the reference dense leg, weight 1) gets each weight.
GRID_RRF_KS = (5, 10, 20, 60)
GRID_WEIGHTS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.5)


def fuse_runs(runs: Sequence[tuple[Mapping[str, list[str]], float]], *, k: int) -> dict[str, list[str]]:
    queries = set().union(*(r for r, _ in runs)) if runs else set()
    return {q: rrf_fuse_legs([(r.get(q, []), w) for r, w in runs], k=k) for q in queries}


def _parse_leg(spec: str) -> tuple[str, Path, float]:
    name, _, rest = spec.partition("=")
    path, _, weight = rest.rpartition(":")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"--leg {spec!r}: expected NAME=PATH:WEIGHT")
    return name, Path(path), float(weight)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lang", choices=["en", "zh"], required=True)
    p.add_argument("--split", choices=["train", "valid"], default="valid")
    p.add_argument("--leg", type=_parse_leg, action="append", required=True, help="NAME=RUN_JSON:WEIGHT (repeat)")
    p.add_argument("--rrf-k", type=int, default=10)
    p.add_argument("--grid", action="store_true",
                   help="also search rrf_k and every leg's weight but the first one's (fixed at 1) by nDCG@10 "
                        "on these runs: tune on train runs, then pass the winner to a valid run")
    a = p.parse_args(argv)
    qrels_all = load_insuranceqa(a.split, a.lang).qrels
    legs = [(name, json.loads(path.read_text()), w) for name, path, w in a.leg]
    queries = set(legs[0][1])
    qrels = {q: qrels_all[q] for q in queries}
    rows = {name: evaluate(run, qrels) for name, run, _ in legs}
    label = " + ".join(f"{w:g}*{name}" for name, _, w in legs) + f" (rrf_k {a.rrf_k})"
    rows[label] = evaluate(fuse_runs([(run, w) for _, run, w in legs], k=a.rrf_k), qrels)
    report: dict[str, object] = {"queries": len(qrels),
                                 "rows": {n: {m: round(v, 4) for m, v in r.items()} for n, r in rows.items()}}
    if a.grid:
        report["grid_best"] = grid_search([(name, run) for name, run, _ in legs], qrels)
    print(json.dumps(report, indent=1, ensure_ascii=False))
    return 0


def grid_search(legs: Sequence[tuple[str, Mapping[str, list[str]]]], qrels: Mapping[str, set[str]]) -> dict[str, object]:
    """Best nDCG@10 over rrf_k x weights (first leg fixed at 1.0), ties to the smaller k."""
    from itertools import product

    best: dict[str, object] = {}
    best_score = -1.0
    for k in GRID_RRF_KS:
        for weights in product(GRID_WEIGHTS, repeat=len(legs) - 1):
            run = fuse_runs([(legs[0][1], 1.0), *((r, w) for (_, r), w in zip(legs[1:], weights))], k=k)
            score = evaluate(run, qrels)["ndcg@10"]
            if score > best_score:
                best_score = score
                best = {"rrf_k": k, "weights": {legs[0][0]: 1.0, **{n: w for (n, _), w in zip(legs[1:], weights)}},
                        "ndcg@10": round(score, 4)}
    return best


if __name__ == "__main__":
    raise SystemExit(main())
