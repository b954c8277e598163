"""Tune weighted RRF per language from leg rankings captured through the service.

The ``bm25`` and ``knn`` modes of an evaluation run (``runs/<model>-bm25.json`` and
``runs/<model>-knn.json``: query id -> ranked source ids, top 100 each, captured through
``Retrieve``) are fused offline with the pipeline's formula,
score(d) = bm25_weight / (rrf_k + rank_bm25(d)) + knn_weight / (rrf_k + rank_knn(d)),
over a grid; the best setting on TRAIN is then checked on VALID (offline, and through the
service with ``python -m service eval --bm25-weight .. --knn-weight .. --rrf-k ..``).
The pipeline fuses chunk hits and then keeps the best chunk per parent; the offline fusion
works on the per-leg deduplicated source lists, a close approximation that the service
run confirms.

Also reported for reference (the pipeline cannot do it today): convex score fusion,
alpha * minmax(bm25) + (1 - alpha) * minmax(cosine), a document missing from a leg scoring 0 there.

    python -m service.eval.fusion_tune --lang en --train eval-out/train-en --valid eval-out/valid-en \\
        --model int8 --out service/eval/fusion_tuned.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from service.eval.datasets import load_insuranceqa
from service.eval.metrics import evaluate

BM25_WEIGHTS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0)
RRF_KS = (1, 2, 5, 10, 20, 30, 45, 60, 80, 100, 150)
ALPHAS = tuple(round(a * 0.05, 2) for a in range(21))
DEPTH = 100


def rrf_fuse_legs(legs: Sequence[tuple[Sequence[str], float]], *, k: int, depth: int = DEPTH) -> list[str]:
    """Source-level weighted RRF over any number of ranked lists, ties in first-seen order
    (legs in the order given, as the pipeline).

    A source listed twice by one leg (two chunks in different parent sections) counts once,
    at its best rank: the pipeline fuses chunks, so one chunk never collects another's
    rank (summing them would promote long answers)."""
    scores: dict[str, float] = {}
    for ranked, weight in legs:
        seen: set[str] = set()
        for rank, d in enumerate(ranked, start=1):
            if d in seen:
                continue
            seen.add(d)
            scores[d] = scores.get(d, 0.0) + weight / (k + rank)
    return sorted(scores, key=lambda d: -scores[d])[:depth]


def rrf_fuse(bm25: Sequence[str], knn: Sequence[str], *, k: int, bm25_weight: float, knn_weight: float,
             depth: int = DEPTH) -> list[str]:
    """The pipeline's two legs, BM25 first."""
    return rrf_fuse_legs(((bm25, bm25_weight), (knn, knn_weight)), k=k, depth=depth)


def _minmax(xs: Sequence[float]) -> list[float]:
    if not xs:
        return []
    lo, hi = min(xs), max(xs)
    return [1.0 if hi == lo else (x - lo) / (hi - lo) for x in xs]


def score_fuse(bm25: Sequence[str], bm25_scores: Sequence[float], knn: Sequence[str], knn_scores: Sequence[float],
               *, alpha: float, depth: int = DEPTH) -> list[str]:
    scores: dict[str, float] = {}
    for ranked, raw, weight in ((bm25, bm25_scores, alpha), (knn, knn_scores, 1 - alpha)):
        seen: set[str] = set()
        for d, s in zip(ranked, _minmax(raw)):
            if d not in seen:
                seen.add(d)
                scores[d] = scores.get(d, 0.0) + weight * s
    return sorted(scores, key=lambda d: -scores[d])[:depth]


def _load(run_dir: Path, model: str, mode: str) -> tuple[dict[str, list[str]], dict[str, list[float]]]:
    runs = json.loads((run_dir / "runs" / f"{model}-{mode}.json").read_text())
    sp = run_dir / "runs" / f"{model}-{mode}.scores.json"
    scores = json.loads(sp.read_text()) if sp.exists() else {}
    return runs, scores


def fuse_run(bm25: Mapping[str, list[str]], knn: Mapping[str, list[str]], **kw: Any) -> dict[str, list[str]]:
    return {q: rrf_fuse(bm25.get(q, []), knn.get(q, []), **kw) for q in set(bm25) | set(knn)}


def grid(bm25: Mapping[str, list[str]], knn: Mapping[str, list[str]], qrels: Mapping[str, set[str]]) -> list[dict[str, Any]]:
    rows = []
    for k in RRF_KS:
        for w in BM25_WEIGHTS:
            m = evaluate(fuse_run(bm25, knn, k=k, bm25_weight=w, knn_weight=1.0), qrels)
            rows.append({"rrf_k": k, "bm25_weight": w, "knn_weight": 1.0, **{n: round(v, 5) for n, v in m.items()}})
    return rows


def score_grid(bm25: Mapping[str, list[str]], bs: Mapping[str, list[float]], knn: Mapping[str, list[str]],
               ks: Mapping[str, list[float]], qrels: Mapping[str, set[str]]) -> list[dict[str, Any]]:
    rows = []
    for a in ALPHAS:
        run = {q: score_fuse(bm25.get(q, []), bs.get(q, []), knn.get(q, []), ks.get(q, []), alpha=a) for q in qrels}
        rows.append({"alpha_bm25": a, **{n: round(v, 5) for n, v in evaluate(run, qrels).items()}})
    return rows


def tune(lang: str, train_dir: Path, valid_dir: Path, model: str) -> dict[str, Any]:
    train_q = load_insuranceqa("train", lang).qrels  # type: ignore[arg-type]
    valid_q = load_insuranceqa("valid", lang).qrels  # type: ignore[arg-type]
    tb, tbs = _load(train_dir, model, "bm25")
    tk, tks = _load(train_dir, model, "knn")
    vb, vbs = _load(valid_dir, model, "bm25")
    vk, vks = _load(valid_dir, model, "knn")
    train_qrels = {q: train_q[q] for q in tb}
    valid_qrels = {q: valid_q[q] for q in vb}
    rows = grid(tb, tk, train_qrels)
    # Best nDCG@10 on train; ties broken towards the defaults (k = 60, equal weights).
    best = max(rows, key=lambda r: (r["ndcg@10"], -abs(r["rrf_k"] - 60), -abs(r["bm25_weight"] - 1.0)))

    def on(b: Mapping[str, list[str]], k: Mapping[str, list[str]], qrels: Mapping[str, set[str]],
           rrf_k: int, bm25_weight: float, knn_weight: float) -> dict[str, float]:
        run = fuse_run(b, k, k=rrf_k, bm25_weight=bm25_weight, knn_weight=knn_weight)
        return {n: round(v, 5) for n, v in evaluate(run, qrels).items()}

    chosen: dict[str, Any] = {"rrf_k": best["rrf_k"], "bm25_weight": best["bm25_weight"], "knn_weight": 1.0}
    equal: dict[str, Any] = {"rrf_k": 60, "bm25_weight": 1.0, "knn_weight": 1.0}
    sg = score_grid(tb, tbs, tk, tks, train_qrels) if tbs and tks else []
    sbest = max(sg, key=lambda r: r["ndcg@10"]) if sg else None
    out: dict[str, Any] = {
        "model": model, "runs": {"train": str(train_dir), "valid": str(valid_dir)},
        "chosen": chosen,
        "objective": "nDCG@10 on the train sample (offline fusion of service-captured leg rankings)",
        "train": {"queries": len(train_qrels), "bm25": {n: round(v, 5) for n, v in evaluate(tb, train_qrels).items()},
                  "knn": {n: round(v, 5) for n, v in evaluate(tk, train_qrels).items()},
                  "rrf_equal_k60": on(tb, tk, train_qrels, **equal), "rrf_tuned": on(tb, tk, train_qrels, **chosen)},
        "valid_offline": {"queries": len(valid_qrels), "bm25": {n: round(v, 5) for n, v in evaluate(vb, valid_qrels).items()},
                          "knn": {n: round(v, 5) for n, v in evaluate(vk, valid_qrels).items()},
                          "rrf_equal_k60": on(vb, vk, valid_qrels, **equal), "rrf_tuned": on(vb, vk, valid_qrels, **chosen)},
        "grid": {"rrf_k": list(RRF_KS), "bm25_weight": list(BM25_WEIGHTS), "knn_weight": [1.0], "train_rows": rows},
    }
    if sbest is not None:
        a = sbest["alpha_bm25"]
        vrun = {q: score_fuse(vb.get(q, []), vbs.get(q, []), vk.get(q, []), vks.get(q, []), alpha=a) for q in valid_qrels}
        out["score_fusion_reference"] = {
            "note": "not implemented in the pipeline; minmax-normalised convex combination, for comparison",
            "alpha_bm25": a, "train": {k: v for k, v in sbest.items() if k != "alpha_bm25"},
            "valid_offline": {n: round(v, 5) for n, v in evaluate(vrun, valid_qrels).items()}, "train_rows": sg}
    return out


def joint(data: dict[str, Any]) -> dict[str, Any] | None:
    """One setting for every language (Config has no per-language fusion today): the grid
    point with the best mean train nDCG@10 across languages, checked offline on valid."""
    langs = data.get("languages", {})
    if len(langs) < 2:
        return None
    table: dict[tuple[int, float], dict[str, float]] = {}
    for lang, entry in langs.items():
        for r in entry["grid"]["train_rows"]:
            table.setdefault((r["rrf_k"], r["bm25_weight"]), {})[lang] = r["ndcg@10"]
    (k, w), per_lang = max(((kw, v) for kw, v in table.items() if len(v) == len(langs)),
                           key=lambda kv: (sum(kv[1].values()), -abs(kv[0][0] - 60)))
    valid: dict[str, dict[str, float]] = {}
    for lang, entry in langs.items():
        vdir = Path(entry["runs"]["valid"])
        vb, _ = _load(vdir, entry["model"], "bm25")
        vk, _ = _load(vdir, entry["model"], "knn")
        qrels = load_insuranceqa("valid", lang).qrels
        run = fuse_run(vb, vk, k=k, bm25_weight=w, knn_weight=1.0)
        valid[lang] = {n: round(v, 5) for n, v in evaluate(run, {q: qrels[q] for q in vb}).items()}
    return {"chosen": {"rrf_k": k, "bm25_weight": w, "knn_weight": 1.0},
            "objective": "mean nDCG@10 over languages on the train samples",
            "train_ndcg@10": per_lang, "valid_offline": valid}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lang", choices=["en", "zh"], required=True)
    p.add_argument("--train", type=Path, required=True, help="eval --out dir of the train run (bm25 + knn modes)")
    p.add_argument("--valid", type=Path, required=True, help="eval --out dir of the valid run (bm25 + knn modes)")
    p.add_argument("--model", default="int8")
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("fusion_tuned.json"))
    a = p.parse_args(argv)
    result = tune(a.lang, a.train, a.valid, a.model)
    data = json.loads(a.out.read_text()) if a.out.exists() else {}
    previous = data.setdefault("languages", {}).get(a.lang, {})
    if "valid_service" in previous and previous.get("chosen") == result["chosen"]:
        result["valid_service"] = previous["valid_service"]  # the service check of the same setting
    data["languages"][a.lang] = result
    both = joint(data)
    if both is not None:
        data["all_languages"] = both
    a.out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("grid",)} | {
        "score_fusion_reference": {k: v for k, v in result.get("score_fusion_reference", {}).items() if k != "train_rows"}},
        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
