"""Fit a reranker's head order (``rerank_order.json``, service/pipeline/head_order.py) on the
item dumps of ``service eval --calibration-sample N`` (InsuranceQA *train* questions), and
score any order on other dumps (valid).

    python -m service.eval.head_order_fit fit --train-en EN.items.json --train-zh ZH.items.json \\
        --start-alpha 0.7 --out rerank_order.json
    python -m service.eval.head_order_fit score --order rerank_order.json --items VALID.items.json
    python -m service.eval.head_order_fit compare --base A.items.json --new B.items.json
    python -m service.eval.head_order_fit score --depth 40 --order rerank_order.json --items DEEP.items.json

``--depth D`` (fit, score) reads each head as if the server had reranked only the first D of
the fused list: the D candidates with the highest fused score. A rerank score does not depend
on the rest of the head, so one run at a deep ``--rerank-top-n`` answers every shallower depth
(ties of fused score at the cut may fall either way; the served list breaks them by fusion's
own order, which the dump does not keep).

Each dump row is a reranked head item with its BM25, dense, fused and rerank scores (the
server's own values), so the offline order here is the one the server would serve: the
scoring goes through ``HeadOrder.scores``. The fit is coordinate ascent on mean nDCG@10 from
the alpha interpolation the gate chose (a few weights, ~1,000 questions per script: no
model that could memorise them), one weight set per script. ``compare`` pairs two eval runs
of the same questions (another reranker, passage cap, first stage) on the lists as served.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from service.eval.item_dump import column
from service.eval.metrics import ndcg_at_k
from service.pipeline.head_order import FEATURES, SCRIPTS, HeadOrder
STEPS = (-1.0, -0.5, -0.25, -0.1, -0.05, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class Head:
    ids: list[str]
    signals: dict[str, list[float | None]]
    relevant: set[str]
    query: str = ""
    qid: str = ""  # the dump's key for the question


def load_heads(path: Path, depth: int | None = None) -> list[Head]:
    """The reranked head of every non-degraded query in a hybrid+rerank item dump; with
    ``depth``, only its ``depth`` best by fused score (what a shallower head would have held)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    heads = []
    for qid, record in data.items():
        if record.get("degraded"):
            continue
        rows = [r for r in record["items"] if column(r, "rerank") is not None]
        if depth is not None:  # stable: equal fused scores keep the dump's order
            rows = sorted(rows, key=lambda r: -float(column(r, "fused")))[:depth]
        if len(rows) < 2:
            continue
        heads.append(Head([str(column(r, "source_id")) for r in rows], {f: [column(r, f) for r in rows] for f in FEATURES},
                          set(record["relevant"]), str(record.get("query", "")), str(qid)))
    return heads


def per_query(heads: list[Head], order: HeadOrder, cjk: bool) -> list[float]:
    return [ndcg_at_k([h.ids[i] for i in order.order(h.signals, cjk)], h.relevant, 10) for h in heads]


def mean_ndcg(heads: list[Head], order: HeadOrder, cjk: bool) -> float:
    return statistics.fmean(per_query(heads, order, cjk)) if heads else 0.0


def paired_ci(a: list[float], b: list[float], seed: int = 0, rounds: int = 2000) -> tuple[float, float, float]:
    """Mean of ``a - b`` per query and its 95 % paired bootstrap interval."""
    diff = [x - y for x, y in zip(a, b)]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(diff, k=len(diff))) for _ in range(rounds))
    return statistics.fmean(diff), means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def served_ndcg(path: Path) -> dict[str, float]:
    """Per question, nDCG@10 of a dump's list in the order the server returned it (the dump
    keeps every row in that order);
    degraded attempts count with what they returned, as in the eval's own report."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {qid: ndcg_at_k([str(column(r, "source_id")) for r in record["items"]], set(record["relevant"]), 10)
            for qid, record in data.items()}


def compare_runs(base: Path, new: Path, seed: int = 0) -> dict[str, float | int]:
    """``new`` against ``base`` on the questions both dumps hold: their means, the paired
    difference and its 95 % bootstrap interval."""
    return _paired(served_ndcg(new), served_ndcg(base), seed,
                   f"compare: {base} and {new} share no question (different --split/--sample/--seed?)")


def compare_heads(base: Path, new: Path, order: HeadOrder, cjk: bool, seed: int = 0) -> dict[str, float | int]:
    """Like ``compare_runs``, with both runs' reranked heads put in ``order`` first (e.g.
    ``HeadOrder.from_alpha(1.0)``: each reranker alone), on the questions both reranked."""
    def by_query(path: Path) -> dict[str, float]:
        heads = load_heads(path)
        return dict(zip((h.qid for h in heads), per_query(heads, order, cjk)))

    return _paired(by_query(new), by_query(base), seed, f"compare: {base} and {new} share no reranked question")


def _paired(a: dict[str, float], b: dict[str, float], seed: int, none_shared: str) -> dict[str, float | int]:
    """Per-question scores of a new run (``a``) and a base run (``b``) on the questions both
    hold: their means, the paired difference and its 95 % bootstrap interval."""
    common = [q for q in b if q in a]
    if not common:
        raise SystemExit(none_shared)
    mean, lo, hi = paired_ci([a[q] for q in common], [b[q] for q in common], seed=seed)
    return {"questions": len(common), "only_base": len(b) - len(common), "only_new": len(a) - len(common),
            "base": statistics.fmean(b[q] for q in common), "new": statistics.fmean(a[q] for q in common),
            "diff": mean, "ci_low": lo, "ci_high": hi}


def fit_script(heads: list[Head], start: dict[str, float], cjk: bool, rounds: int = 6) -> tuple[dict[str, float], float]:
    """Coordinate ascent from ``start`` over every feature's weight (steps ``STEPS``); keeps a
    move only when it raises the mean by more than 1e-6."""
    script = "cjk" if cjk else "latin"

    def value(w: dict[str, float]) -> float:
        if not w.get("rerank", 0.0) > 0:
            return -1.0
        return mean_ndcg(heads, HeadOrder({script: w, "cjk" if not cjk else "latin": w}), cjk)

    w = {f: start.get(f, 0.0) for f in FEATURES}
    best = value(w)
    for _ in range(rounds):
        moved = False
        for f in FEATURES:
            for step in STEPS:
                trial = {**w, f: round(w[f] + step, 4)}
                v = value(trial)
                if v > best + 1e-6:
                    w, best, moved = trial, v, True
        if not moved:
            break
    return {f: v for f, v in w.items() if v}, best


def _depth(text: str) -> int:
    """A head depth: at least 10, so the top 10 that nDCG@10 reads is all reranked."""
    value = int(text)
    if value < 10:
        raise argparse.ArgumentTypeError(f"--depth must be at least 10 (nDCG@10 reads 10), got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.eval.head_order_fit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit per-script weights on train dumps")
    f.add_argument("--train-en", type=Path, default=None, help="Latin-script (English) train item dump")
    f.add_argument("--train-zh", type=Path, default=None, help="Han-script (Chinese) train item dump")
    f.add_argument("--start-alpha", type=float, default=0.7, help="the interpolation to start from (the gate's)")
    f.add_argument("--start-order", type=Path, default=None,
                   help="start from this order's weights instead of the alpha (e.g. the shipped one)")
    f.add_argument("--scripts", default="latin,cjk",
                   help="the scripts to fit; the others keep --start-order's weights (a first stage "
                        "that changed for one script only re-fits that one)")
    f.add_argument("--depth", type=_depth, default=None,
                   help="fit as if only the first N fused candidates were reranked (a deeper run's dumps)")
    f.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("score", help="mean nDCG@10 of an order (or an alpha) on item dumps")
    s.add_argument("--order", type=Path, default=None)
    s.add_argument("--alpha", type=float, default=None)
    s.add_argument("--items", type=Path, nargs="+", required=True)
    s.add_argument("--cjk", action="store_true", help="score with the Han-script weights")
    s.add_argument("--depth", type=_depth, default=None,
                   help="score as if only the first N fused candidates were reranked")
    s.add_argument("--against-alpha", type=float, default=None,
                   help="also print the paired difference to this alpha with a 95 %% bootstrap interval")
    c = sub.add_parser("compare", help="paired nDCG@10 difference between two eval runs of the same questions")
    c.add_argument("--base", type=Path, required=True, help="item dump of the run to compare against")
    c.add_argument("--new", type=Path, required=True, help="item dump of the run being measured")
    c.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    c.add_argument("--alpha", type=float, default=None,
                   help="compare the reranked heads re-ordered by this interpolation (1.0: each reranker alone) "
                        "instead of the lists as served")
    c.add_argument("--cjk", action="store_true", help="with --alpha: the Han-script weights (no effect on an alpha)")
    a = p.parse_args(argv)
    if a.cmd == "compare":
        r = (compare_runs(a.base, a.new, a.seed) if a.alpha is None
             else compare_heads(a.base, a.new, HeadOrder.from_alpha(a.alpha), a.cjk, a.seed))
        print(f"{r['questions']} questions in both (only in base {r['only_base']}, only in new {r['only_new']}): "
              f"nDCG@10 {r['base']:.4f} -> {r['new']:.4f}, {r['diff']:+.4f} "
              f"(95 % paired bootstrap {r['ci_low']:+.4f}..{r['ci_high']:+.4f})")
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
        return 0
    if a.cmd == "score":
        if (a.order is None) == (a.alpha is None):
            p.error("give exactly one of --order and --alpha")
        order = HeadOrder.load(a.order) if a.order else HeadOrder.from_alpha(a.alpha)
        for path in a.items:
            heads = load_heads(path, a.depth)
            mine = per_query(heads, order, a.cjk)
            line = f"{path}: {len(heads)} queries, nDCG@10 {statistics.fmean(mine):.4f} ({order.source})"
            if a.against_alpha is not None:
                mean, lo, hi = paired_ci(mine, per_query(heads, HeadOrder.from_alpha(a.against_alpha), a.cjk))
                line += f"; vs alpha {a.against_alpha:g}: {mean:+.4f} (95 % CI {lo:+.4f}..{hi:+.4f})"
            print(line)
        return 0
    scripts = [x.strip() for x in a.scripts.split(",") if x.strip()]
    if not scripts or any(x not in SCRIPTS for x in scripts):
        p.error(f"--scripts: a comma-separated subset of {', '.join(SCRIPTS)}")
    for script, path, flag in (("latin", a.train_en, "--train-en"), ("cjk", a.train_zh, "--train-zh")):
        if script in scripts and path is None:
            p.error(f"fitting {script} needs {flag}")
    start_order = HeadOrder.load(a.start_order) if a.start_order else None
    if start_order is None and len(scripts) < len(SCRIPTS):
        p.error("--scripts without every script needs --start-order (the weights the others keep)")
    alpha_start = {"rerank": a.start_alpha, "fused": round(1.0 - a.start_alpha, 4)}
    weights: dict[str, dict[str, float]] = {}
    report: dict[str, object] = {}
    if start_order is not None:  # what a script that is not re-fitted keeps, and where fits start
        weights = {x: dict(start_order.weights[x]) for x in SCRIPTS}
        previous = start_order.meta.get("fitted_on", {})
        report = {x: previous.get(x, {"from": str(a.start_order)}) for x in SCRIPTS if x not in scripts}
    for script, path, cjk in (("latin", a.train_en, False), ("cjk", a.train_zh, True)):
        if script not in scripts:
            continue
        heads = load_heads(path, a.depth)
        start = weights.get(script, alpha_start)
        base = mean_ndcg(heads, HeadOrder.from_alpha(a.start_alpha), cjk)
        started = mean_ndcg(heads, HeadOrder({x: start for x in SCRIPTS}), cjk) if start_order is not None else base
        weights[script], fitted = fit_script(heads, start, cjk)
        report[script] = {"train_items": str(path), "queries": len(heads), **({"depth": a.depth} if a.depth else {}),
                          f"ndcg@10_alpha_{a.start_alpha:g}": round(base, 4),
                          **({"ndcg@10_start_order": round(started, 4)} if start_order is not None else {}),
                          "ndcg@10_fitted": round(fitted, 4)}
        print(f"{script}: {len(heads)} train queries, nDCG@10 {base:.4f} at alpha {a.start_alpha:g}"
              + (f", {started:.4f} with the start order" if start_order is not None else "")
              + f" -> {fitted:.4f} with {weights[script]}", file=sys.stderr)
    order = HeadOrder.from_weights(weights)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(order.to_json(fitted_on=report, start_alpha=a.start_alpha,
                                   **({"start_order": str(a.start_order)} if a.start_order else {}),
                                   command="python -m service.eval.head_order_fit " + " ".join(argv or sys.argv[1:])),
                     encoding="utf-8")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
