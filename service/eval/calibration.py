"""Fit and check the quality calibrations (``service/pipeline/quality.py``).

    python -m service.eval.calibration fit \\
        --train OUT_EN/runs/int8-calibration-hybrid+rerank.items.json OUT_ZH/runs/... \\
        --valid OUT_EN/runs/int8-hybrid+rerank.items.json OUT_ZH/runs/... \\
        --embedding-dir MODELS/multilingual-e5-small-int8 --reranker-dir MODELS/e5-small-split-reranker-int8 \\
        --out service/offline/builder/artifacts/calibration

Inputs are the per-query item dumps ``service eval`` writes (``runs/*.items.json``): the
**train** sample (``--calibration-sample``) to fit on, the **valid** runs to measure on.
From a hybrid+rerank dump both calibrations are fitted: ``rerank`` on the top of the final
(reranked) order, ``hybrid`` on the top of the fused order rebuilt from the fused scores
(exactly the hybrid mode's order). Label: the item is a judged answer of the question.
Rows: the top ``--rows`` items of each list (default 3), so the probability is fitted
where agents read. Model: L2-regularised logistic regression (Newton), per language.

Writes ``hybrid.json`` and ``rerank.json`` (each names the ONNX hash it was fitted on),
``calibration_report.json`` (ECE of the top-1 and of the fitted rows, per source and
language, on valid) and ``reliability.png``.

    python -m service.eval.calibration joint-gate --valid ... --off-domain ... \
        --hybrid EMBEDDER/quality_calibration.json --rerank RERANKER/quality_calibration.json --write

chooses the joint gate of reranked lists (both judges' thresholds at once,
``JOINT_GATE_RULE``) and adds it to the rerank calibration. A refit writes none (its
probabilities are new): run ``joint-gate`` after it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.domain import LegKind
from service.eval.item_dump import column
from service.pipeline.fusion import is_cjk
from service.pipeline.quality import (
    CALIBRATION_VERSION,
    LEG_SETS,
    Logistic,
    features_for,
    leg_set,
    signals,
)

F64 = npt.NDArray[np.float64]
ECE_BINS = 10


Row = tuple[dict[str, float], bool, int]


def record_legs(record: dict[str, Any]) -> str:
    """The leg set of a dumped list (``quality.leg_set`` of the legs that answered; "both" for
    dumps from before the Latin-script leg, which recorded no ``legs_ok``)."""
    legs_ok = record.get("legs_ok")
    return leg_set(LegKind(name) for name in legs_ok) if legs_ok else "both"


def _rows_of(record: dict[str, Any], kind: str, legs: str, top: int) -> list[Row]:
    """(signals, is a judged answer, rank) of the top ``top`` items of one list, as serving
    would see it: ``rerank`` = the reranked head in final order; ``hybrid`` with legs
    ``both`` (or ``all``) = the fused order, ``bm25`` / ``knn`` = that leg alone (its hits in
    its own order, fused score = its RRF term, so relative to the best = (k + 1) / (k + rank)).
    ``rerank`` with one leg: the reranked items that leg found, with the other leg's signals
    removed and the fused score of that leg's rank (the dump's head was chosen by both legs:
    an approximation of a single-leg head)."""
    all_items = record["items"]
    k = float(record.get("rrf_k", 60))
    fused_order = legs in ("both", "all")
    leg_rank: dict[str, int] = {}
    in_leg: list[list[Any]] = []
    if not fused_order:
        col = "bm25" if legs == "bm25" else "dense"
        in_leg = sorted((r for r in all_items if column(r, col) is not None), key=lambda r: -column(r, col))
        leg_rank = {column(r, "source_id"): i for i, r in enumerate(in_leg, start=1)}
    if kind == "rerank":
        items = [r for r in all_items if column(r, "rerank") is not None
                 and (fused_order or column(r, "source_id") in leg_rank)]
    elif fused_order:
        items = sorted(all_items, key=lambda r: -column(r, "fused"))
    else:
        items = in_leg
    relevant = set(record["relevant"])
    out = []
    for rank, row in enumerate(items[:top], start=1):
        sid, bm25, dense, fused, rerank, latin = (column(row, c) for c in
                                                  ("source_id", "bm25", "dense", "fused", "rerank", "latin_dense"))
        if not fused_order:
            x = signals(dense_score=dense if legs == "knn" else None, bm25_score=bm25 if legs == "bm25" else None,
                        fused_score=(k + 1) / (k + leg_rank[sid]), max_fused=1.0,
                        rerank_score=rerank if kind == "rerank" else None)
        else:
            x = signals(dense_score=dense, bm25_score=bm25, fused_score=fused, max_fused=record["max_fused"],
                        rerank_score=rerank if kind == "rerank" else None, latin_score=latin)
        out.append((x, sid in relevant, rank))
    return out


def same_language(record: dict[str, Any]) -> bool:
    """Whether a dumped question was asked of a corpus of its own script (True where the dump
    does not record the corpus's language). Gates are chosen on these only: an off-domain
    question against a corpus of the other language has nothing to match and is refused
    trivially, so counting it inflates the refused share and pulls a gate down."""
    corpus = record.get("corpus_lang")
    return corpus is None or (corpus == "zh") == is_cjk(record["query"])


def load_rows(paths: Sequence[Path], kind: str, top: int, legs: str = "both", same_language_only: bool = False
              ) -> dict[str, list[Row]]:
    """Rows per language ("en" / "cjk") from item dumps; degraded attempts are left out, and
    so are lists of the other leg set (``all`` reads the lists the Latin-script leg answered
    in; the others read the rest) and, with ``same_language_only``, questions asked of a
    corpus of the other language (``same_language``)."""
    by_lang: dict[str, list[Row]] = {"en": [], "cjk": []}
    for path in paths:
        data: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
        for record in data.values():
            if record.get("degraded") or not record["items"] or (record_legs(record) == "all") != (legs == "all"):
                continue
            if same_language_only and not same_language(record):
                continue
            by_lang["cjk" if is_cjk(record["query"]) else "en"] += _rows_of(record, kind, legs, top)
    return by_lang


def fit_logistic(x: F64, y: F64, features: Sequence[str], l2: float = 1.0, iters: int = 50) -> Logistic:
    """Newton's method on standardised features with an L2 penalty (not on the intercept)."""
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale < 1e-9] = 1.0
    z = np.hstack([(x - mean) / scale, np.ones((len(x), 1))])
    rate = float(np.clip(y.mean(), 1e-6, 1 - 1e-6))
    theta = np.zeros(z.shape[1])
    theta[-1] = math.log(rate / (1 - rate))
    penalty = np.full(z.shape[1], l2)
    penalty[-1] = 0.0
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(z @ theta, -50, 50)))
        grad = z.T @ (p - y) + penalty * theta
        hess = z.T @ (z * (p * (1 - p))[:, None]) + np.diag(penalty + 1e-9)
        step = np.linalg.solve(hess, grad)
        theta -= step
        if np.abs(step).max() < 1e-10:
            break
    return Logistic(tuple(features), tuple(float(v) for v in mean), tuple(float(v) for v in scale),
                    tuple(float(v) for v in theta[:-1]), float(theta[-1]))


def matrix(rows: Sequence[tuple[dict[str, float], bool, int]], features: Sequence[str]) -> tuple[F64, F64]:
    x = np.array([[r[0][f] for f in features] for r in rows], dtype=np.float64).reshape(len(rows), len(features))
    y = np.array([1.0 if r[1] else 0.0 for r in rows], dtype=np.float64)
    return x, y


def ece(p: F64, y: F64, bins: int = ECE_BINS) -> tuple[float, list[dict[str, float]]]:
    """Expected calibration error over equal-width bins, and the reliability table."""
    table = []
    total = 0.0
    edges = np.linspace(0.0, 1.0, bins + 1)
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (p >= lo) & ((p < hi) if hi < 1.0 else (p <= hi))
        if not sel.any():
            continue
        conf, acc = float(p[sel].mean()), float(y[sel].mean())
        total += sel.sum() / len(p) * abs(conf - acc)
        table.append({"lo": float(lo), "hi": float(hi), "n": int(sel.sum()), "mean_p": round(conf, 4),
                      "observed": round(acc, 4)})
    return float(total), table


GATE_RULE = ("per model (leg set and language; none for BM25 alone), the min_quality on a 0.005 grid that "
             "maximises min(valid answerable questions kept, off-domain questions refused), both asked of a corpus "
             "of their own language; ties: the lowest")
GATE_GRID = tuple(round(0.005 * i, 3) for i in range(1, 61))


def choose_gates(valid: Sequence[Path], off_domain: Sequence[Path], kind: str, models: dict[str, Any],
                 leg_sets: Sequence[str] = ("both", "knn")) -> dict[str, float]:
    gates = {}
    # No gate for BM25-only lists: BM25 scores scale with the corpus (IDF over its size), so
    # a threshold fitted on one corpus misjudges a small one; BM25 alone answers EMPTY when
    # no term matches, and the quality still says how weak a match is.
    for legs in (legs for legs in leg_sets if legs != "bm25"):
        curves = gate_curve(valid, off_domain, {"version": CALIBRATION_VERSION, "kind": kind, "onnx_sha256": "",
                                                "models": models}, GATE_GRID, legs)
        for lang, rows in curves.items():
            gates[f"{legs}/{lang}"] = balance_point(rows)
    return gates


def balance_point(rows: Sequence[dict[str, float]]) -> float:
    """The ``min_quality`` of a gate curve's rows that ``GATE_RULE`` picks."""
    return max(rows, key=lambda r: (min(r["answerable_kept"], r["off_domain_refused"]), -r["min_quality"]))["min_quality"]


GATE_CURVE = (0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.12, 0.15, 0.2)


def rechoose_gates(valid: Sequence[Path], off_domain: Sequence[Path], calibration: dict[str, Any],
                   min_gain_se: float = 2.0) -> dict[str, dict[str, Any]]:
    """Per gated model key of a shipped calibration: its gate, the gate ``GATE_RULE`` chooses
    on these dumps, both gates' min(kept, refused), and the gate to ship: the new one only
    where it gains more than ``min_gain_se`` standard errors of the shipped gate's weaker
    side (a binomial share over that side's questions), else the shipped one: a shipped gate
    is not moved on a question or two."""
    shipped: dict[str, float] = calibration.get("gate", {})
    out: dict[str, dict[str, Any]] = {}
    for legs in sorted({key.partition("/")[0] for key in shipped} - {"bm25"}):  # as choose_gates: none for BM25
        answerable, off = _top1_quality(valid, calibration, legs), _top1_quality(off_domain, calibration, legs)
        curves = _curves(answerable, off, GATE_GRID)
        chosen = {f"{legs}/{lang}": balance_point(rows) for lang, rows in curves.items()}
        for lang in ("en", "cjk"):
            key = f"{legs}/{lang}"
            if key not in chosen or key not in shipped:
                continue
            ok = [q for q, hit in answerable[lang] if hit]
            neg = [q for q, _ in off[lang]]

            def rates(gate: float) -> tuple[float, float]:
                return sum(q >= gate for q in ok) / len(ok), sum(q < gate for q in neg) / len(neg)

            (k0, r0), (k1, r1) = rates(shipped[key]), rates(chosen[key])
            weak, n = (k0, len(ok)) if k0 <= r0 else (r0, len(neg))
            se = math.sqrt(max(weak * (1 - weak), 1e-12) / n)
            gain = min(k1, r1) - min(k0, r0)
            out[key] = {"shipped": shipped[key], "chosen": chosen[key], "min_rate_shipped": round(min(k0, r0), 4),
                        "min_rate_chosen": round(min(k1, r1), 4), "gain_se": round(gain / se, 2),
                        "gate": chosen[key] if gain > min_gain_se * se else shipped[key]}
    return out


def fit(train: Sequence[Path], valid: Sequence[Path], *, hybrid_sha: str, rerank_sha: str, out: Path,
        top: int = 3, l2: float = 1.0, off_domain: Sequence[Path] = (),
        leg_sets: Sequence[str] = ("both", "bm25", "knn"), merge: dict[str, dict[str, Any]] | None = None
        ) -> dict[str, Any]:
    """``off_domain``: item dumps of unjudged off-domain questions (``service eval
    --off-domain``), fitted as negatives beside ``train`` (every item is a miss).
    ``leg_sets``: the models to fit (``all``: lists the Latin-script leg answered in, from
    dumps of runs that served it; there are no Han-script ones). ``merge``: per kind, a
    shipped calibration of the same model whose other models and gates are kept."""
    out.mkdir(parents=True, exist_ok=True)
    train = [*train, *off_domain]
    report: dict[str, Any] = {"label": "item is a judged answer (InsuranceQA); off-domain questions: none is",
                              "rows_per_list": top, "fitted_on": [str(p) for p in train],
                              "measured_on": [str(p) for p in valid], "sources": {}, "gate": {}}
    docs: dict[str, dict[str, Any]] = {}
    for kind, sha in (("hybrid", hybrid_sha), ("rerank", rerank_sha)):
        if not sha:
            continue
        base = (merge or {}).get(kind)
        if base is not None and base.get("onnx_sha256") != sha:
            raise ValueError(f"the {kind} calibration to merge into was fitted on another model")
        models: dict[str, Any] = dict(base["models"]) if base else {}
        src: dict[str, Any] = {}
        for legs in leg_sets:
            if legs not in LEG_SETS:
                raise ValueError(f"unknown leg set {legs!r} (known: {', '.join(LEG_SETS)})")
            tr, va = load_rows(train, kind, top, legs), load_rows(valid, kind, top, legs)
            features = features_for(kind, legs)
            for lang in ("en", "cjk"):
                key = f"{legs}/{lang}"
                if not tr[lang]:
                    if legs == "all":  # Han-script queries never run the Latin-script leg
                        continue
                    raise ValueError(f"no {lang} train rows for the {kind} calibration ({legs})")
                model = fit_logistic(*matrix(tr[lang], features), features, l2)
                models[key] = model.to_json()
                src[key] = _measure(model, tr[lang], va[lang], features)
        gates = dict(base.get("gate", {})) if base else {}
        if valid and off_domain:
            gates.update(choose_gates(valid, off_domain, kind, models, leg_sets))
        fitted = {key: {k: v for k, v in r.items() if k != "reliability_top1"} for key, r in src.items()}
        doc = {"version": CALIBRATION_VERSION, "kind": kind, "onnx_sha256": sha,
               "label": report["label"], "rows_per_list": top, "l2": l2, "models": models,
               **({"gate": gates, "gate_rule": GATE_RULE} if gates else {}),
               "valid": {**(base.get("valid", {}) if base else {}), **fitted}}
        (out / f"{kind}.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        docs[kind] = doc
        report["sources"][kind] = src
        if valid and off_domain:
            report["gate"][kind] = gate_curve(valid, off_domain, doc, GATE_CURVE, "all" if "all" in leg_sets else "both")
    if valid and off_domain and hybrid_sha and rerank_sha:
        report["gate"]["rerank_with_first_stage"] = serving_gate_rates(valid, off_domain, docs["hybrid"], docs["rerank"])
    (out / "calibration_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    try:
        reliability_plot(report, out / "reliability.png")
    except ImportError:
        pass
    return report


def _measure(model: Logistic, train: Sequence[Row], valid: Sequence[Row], features: Sequence[str]) -> dict[str, Any]:
    _, y = matrix(train, features)
    res: dict[str, Any] = {"train_rows": len(y), "train_positive_rate": round(float(y.mean()), 4)}
    if valid:
        xv, yv = matrix(valid, features)
        pv = np.array([model.probability(dict(zip(features, row))) for row in xv])
        top1 = np.array([r[2] == 1 for r in valid])
        e_all, _ = ece(pv, yv)
        e_top, table = ece(pv[top1], yv[top1])
        res.update({"valid_rows": len(yv), "ece_rows": round(e_all, 4), "ece_top1": round(e_top, 4),
                    "valid_top1_accuracy": round(float(yv[top1].mean()), 4),
                    "valid_top1_mean_p": round(float(pv[top1].mean()), 4), "reliability_top1": table})
    return res


def _top1_quality(paths: Sequence[Path], calibration: dict[str, Any], legs: str = "both"
                  ) -> dict[str, list[tuple[float, bool]]]:
    """Per language: (the calibration's quality of each list's top item, is it a judged
    answer), from item dumps of questions asked of a corpus of their own language."""
    from service.pipeline.quality import parse_calibration

    kind = str(calibration["kind"])
    cal = parse_calibration(calibration, kind)
    return {lang: [(cal.probability(r[0], lang == "cjk", legs), r[1]) for r in rows]
            for lang, rows in load_rows(paths, kind, 1, legs, same_language_only=True).items()}


def answerable_curve(paths: Sequence[Path], calibration: dict[str, Any], thresholds: Sequence[float]
                     ) -> dict[str, list[dict[str, float]]]:
    """Per language: for each ``min_quality``, the share of questions whose top-1 is a judged
    answer that keep EVIDENCE_FOUND, and the share of all questions that do (top-1 quality
    from the shipped calibration applied to the recorded signals)."""
    out: dict[str, list[dict[str, float]]] = {}
    for lang, top in _top1_quality(paths, calibration).items():
        if not top:
            continue
        q = np.array([x for x, _ in top])
        ok = np.array([hit for _, hit in top])
        out[lang] = [{"min_quality": t, "answerable_kept": round(float((q[ok] >= t).mean()), 4),
                      "all_kept": round(float((q >= t).mean()), 4), "answerable": int(ok.sum())} for t in thresholds]
    return out


def gate_curve(valid: Sequence[Path], off_domain: Sequence[Path], calibration: dict[str, Any],
               thresholds: Sequence[float], legs: str = "both") -> dict[str, list[dict[str, float]]]:
    """Per language, for each ``min_quality``: valid questions whose top-1 is a judged answer
    that keep EVIDENCE_FOUND, and off-domain questions refused (their top-1 below it). The
    off-domain questions are the fitted ones (in sample): the held-out check is
    tests/eval/test_answerability.py."""
    return _curves(_top1_quality(valid, calibration, legs), _top1_quality(off_domain, calibration, legs), thresholds)


def _curves(answerable: dict[str, list[tuple[float, bool]]], off: dict[str, list[tuple[float, bool]]],
            thresholds: Sequence[float]) -> dict[str, list[dict[str, float]]]:
    """``gate_curve`` over top-1 qualities already read (``_top1_quality``)."""
    out: dict[str, list[dict[str, float]]] = {}
    for lang in ("en", "cjk"):
        ok = [q for q, hit in answerable[lang] if hit]
        neg = [q for q, _ in off[lang]]
        if ok and neg:
            out[lang] = [{"min_quality": t, "answerable_kept": round(sum(q >= t for q in ok) / len(ok), 4),
                          "off_domain_refused": round(sum(q < t for q in neg) / len(neg), 4)} for t in thresholds]
    return out


def serving_gate_rates(valid: Sequence[Path], off_domain: Sequence[Path], hybrid: dict[str, Any],
                       rerank: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per language, serving's rule for reranked lists at the calibrations' gates: valid
    questions whose reranked top-1 is a judged answer that pass, off-domain ones refused."""
    return _pass_rates(*(both_judges_at_gates(p, hybrid, rerank) for p in (valid, off_domain)))


def _pass_rates(answerable: dict[str, list[tuple[bool, bool]]], off: dict[str, list[tuple[bool, bool]]]
                ) -> dict[str, dict[str, float]]:
    """``serving_gate_rates`` over (passed, is a judged answer) lists already judged."""
    return {lang: {
        "answerable_kept": round(sum(ok for ok, hit in answerable[lang] if hit)
                                 / max(1, sum(hit for _, hit in answerable[lang])), 4),
        "answerable": sum(hit for _, hit in answerable[lang]),
        "off_domain_refused": round(sum(not ok for ok, _ in off[lang]) / max(1, len(off[lang])), 4),
        "off_domain": len(off[lang])} for lang in ("en", "cjk")}


def both_judges(paths: Sequence[Path], hybrid: dict[str, Any], rerank: dict[str, Any]
                ) -> dict[str, list[tuple[float, float, bool]]]:
    """Per language, per two-leg list of a question asked of a corpus of its own language:
    (the rerank calibration's quality of the reranked top, the hybrid calibration's quality
    of the fused top before rerank, is the reranked top-1 a judged answer): what the two
    judges of a reranked list read."""
    from service.pipeline.quality import parse_calibration

    h, r = parse_calibration(hybrid, "hybrid"), parse_calibration(rerank, "rerank")
    out: dict[str, list[tuple[float, float, bool]]] = {"en": [], "cjk": []}
    for path in paths:
        data: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
        for record in data.values():
            if record.get("degraded") or not record["items"] or not same_language(record):
                continue
            cjk = is_cjk(record["query"])
            legs = record_legs(record)
            reranked, fused = _rows_of(record, "rerank", legs, 1), _rows_of(record, "hybrid", legs, 1)
            if not reranked:
                continue
            (xr, hit, _), (xh, _, _) = reranked[0], fused[0]
            out["cjk" if cjk else "en"].append((r.probability(xr, cjk, legs), h.probability(xh, cjk, legs), hit))
    return out


def both_judges_at_gates(paths: Sequence[Path], hybrid: dict[str, Any], rerank: dict[str, Any]
                         ) -> dict[str, list[tuple[bool, bool]]]:
    """Per language, per two-leg list: (does it pass the serving gate of a reranked list,
    is its reranked top-1 a judged answer). Serving passes a reranked list when both judges
    find something (``QualityModel.passes_default_gate``, the rule serving applies): the
    joint gate where the rerank calibration has one for this hybrid calibration, else the
    top reaches the rerank gate AND the fused top (before rerank) reaches the hybrid gate."""
    return _serving_passes(both_judges(paths, hybrid, rerank), hybrid, rerank)


def _serving_passes(judged: dict[str, list[tuple[float, float, bool]]], hybrid: dict[str, Any],
                    rerank: dict[str, Any]) -> dict[str, list[tuple[bool, bool]]]:
    """``both_judges_at_gates`` over the two judges' qualities already read (``both_judges``)."""
    from service.domain import QualitySource
    from service.pipeline.quality import QualityModel, parse_calibration

    served = QualityModel(hybrid=parse_calibration(hybrid, "hybrid"), rerank=parse_calibration(rerank, "rerank"))
    return {lang: [(served.passes_default_gate(r, QualitySource.RERANKER_PROBABILITY, lang == "cjk",
                                               first_stage=h), hit) for r, h, hit in lists]
            for lang, lists in judged.items()}


JOINT_GATE_RULE = ("per language, the pair (reranker min_quality, first-stage min_quality) on the 0.005 grid "
                   "(0 included) that maximises min(valid answerable questions kept, off-domain questions refused), "
                   "both asked of a corpus of their own language; ties: the higher sum of the two, then the lowest pair")


def choose_joint_gates(valid: Sequence[Path], off_domain: Sequence[Path], hybrid: dict[str, Any],
                       rerank: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per language ("en" / "cjk"): the joint gate (``JOINT_GATE_RULE``) with its in-sample
    rates, and the rates of the rule it replaces (each judge's own gate)."""
    from service.pipeline.quality import fingerprint

    grid = np.array((0.0, *GATE_GRID))
    rerank = {k: v for k, v in rerank.items() if k != "joint_gate"}  # "before": each judge's own gate
    answerable, off = both_judges(valid, hybrid, rerank), both_judges(off_domain, hybrid, rerank)
    before = _pass_rates(_serving_passes(answerable, hybrid, rerank), _serving_passes(off, hybrid, rerank))
    out: dict[str, dict[str, Any]] = {}
    for lang in ("en", "cjk"):
        pos = np.array([(r, h) for r, h, hit in answerable[lang] if hit]).reshape(-1, 2)
        neg = np.array([(r, h) for r, h, _ in off[lang]]).reshape(-1, 2)
        if not len(pos) or not len(neg):
            continue
        # passes[i, j, n]: list n reaches reranker gate grid[i] and first-stage gate grid[j]
        kept = ((pos[None, None, :, 0] >= grid[:, None, None]) & (pos[None, None, :, 1] >= grid[None, :, None])).mean(2)
        refused = 1.0 - ((neg[None, None, :, 0] >= grid[:, None, None])
                         & (neg[None, None, :, 1] >= grid[None, :, None])).mean(2)
        i, j = max(np.ndindex(kept.shape), key=lambda ij: (min(kept[ij], refused[ij]), kept[ij] + refused[ij],
                                                           -(grid[ij[0]] + grid[ij[1]])))
        out[lang] = {"rerank": float(grid[i]), "first_stage": float(grid[j]),
                     "first_stage_calibration": fingerprint(hybrid["models"]),
                     "answerable_kept": round(float(kept[i, j]), 4), "answerable": len(pos),
                     "off_domain_refused": round(float(refused[i, j]), 4), "off_domain": len(neg),
                     "each_judge_own_gate": before[lang]}
    return out


def reliability_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = report["sources"]
    fig, axes = plt.subplots(1, len(sources), figsize=(5 * len(sources), 4.6), squeeze=False)
    for ax, (kind, langs) in zip(axes[0], sources.items()):
        ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--", label="perfect")
        for key, res in langs.items():
            table = res.get("reliability_top1", [])
            if not table:
                continue
            both = key.startswith("both/")  # single-leg lists (one leg requested or failed) dotted
            ax.plot([b["mean_p"] for b in table], [b["observed"] for b in table], marker="o" if both else ".",
                    ls="-" if both else ":", lw=1.5 if both else 1.0,
                    label=f"{key}: ECE {res['ece_top1']:.3f} (n={sum(b['n'] for b in table)})")
        name = {"hybrid": "HYBRID_CALIBRATED", "rerank": "RERANKER_PROBABILITY"}[kind]
        ax.set_title(f"{name}: valid top-1 reliability", fontsize=9)
        ax.set_xlabel("predicted probability the top item is a judged answer")
        ax.set_ylabel("observed fraction")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _dump_args(parser: argparse.ArgumentParser, both_judges: bool = True) -> None:
    """The item dumps a gate command reads and, for the commands about both judges, the two
    calibrations."""
    parser.add_argument("--valid", type=Path, nargs="+", required=True)
    parser.add_argument("--off-domain", type=Path, nargs="+", required=True)
    if both_judges:
        parser.add_argument("--hybrid", type=Path, required=True, help="the embedder's quality_calibration.json")
        parser.add_argument("--rerank", type=Path, required=True, help="the reranker's quality_calibration.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.eval.calibration", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit")
    f.add_argument("--train", type=Path, nargs="+", required=True)
    f.add_argument("--valid", type=Path, nargs="*", default=[])
    f.add_argument("--off-domain", type=Path, nargs="*", default=[],
                   help="item dumps of off-domain questions (service eval --off-domain): fitted as negatives")
    f.add_argument("--embedding-dir", type=Path, required=True, help="the embedding model dir the runs used")
    f.add_argument("--reranker-dir", type=Path, default=None, help="the reranker dir the runs used")
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--rows", type=int, default=3)
    f.add_argument("--l2", type=float, default=1.0)
    f.add_argument("--leg-sets", default="both,bm25,knn",
                   help="models to fit: both,bm25,knn (two-leg runs) or all (runs with the Latin-script leg)")
    f.add_argument("--merge-hybrid", type=Path, default=None,
                   help="the embedder's shipped quality_calibration.json: keep its other models and gates")
    f.add_argument("--merge-rerank", type=Path, default=None,
                   help="the reranker's shipped quality_calibration.json: keep its other models and gates")
    c = sub.add_parser("curve", help="answerable questions kept per min_quality, from valid item dumps")
    c.add_argument("--valid", type=Path, nargs="+", required=True)
    c.add_argument("--calibration", type=Path, required=True, help="a fitted hybrid.json / rerank.json")
    r = sub.add_parser("rechoose-gates", help="choose a shipped calibration's own gates again (GATE_RULE) from "
                                              "hybrid+rerank item dumps, its models kept; --write writes those "
                                              "that gain enough")
    _dump_args(r, both_judges=False)
    r.add_argument("--calibration", type=Path, required=True, help="a quality_calibration.json (hybrid or rerank)")
    r.add_argument("--min-gain-se", type=float, default=2.0,
                   help="move a shipped gate only where the new one gains more than this many standard errors")
    r.add_argument("--write", action="store_true")
    j = sub.add_parser("joint-gate", help="choose the joint gate of reranked lists (both judges at once) from "
                                          "hybrid+rerank item dumps; --write adds it to the rerank calibration")
    _dump_args(j)
    j.add_argument("--write", action="store_true", help="write the chosen gates into --rerank (joint_gate)")
    g = sub.add_parser("gates", help="serving's rule for reranked lists (both judges) at shipped gates, "
                                     "from hybrid+rerank item dumps")
    _dump_args(g)
    a = p.parse_args(argv)
    if a.cmd == "rechoose-gates":
        doc = json.loads(a.calibration.read_text(encoding="utf-8"))
        rechosen = rechoose_gates(a.valid, a.off_domain, doc, a.min_gain_se)
        print(json.dumps(rechosen, indent=1))
        if a.write and any(r["gate"] != r["shipped"] for r in rechosen.values()):
            doc["gate"] = {**doc["gate"], **{key: r["gate"] for key, r in rechosen.items()}}
            doc["gate_rule"] = GATE_RULE + f"; a shipped gate moves only where that gains > {a.min_gain_se:g} standard errors"
            a.calibration.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        return 0
    if a.cmd == "joint-gate":
        rerank = json.loads(a.rerank.read_text(encoding="utf-8"))
        chosen = choose_joint_gates(a.valid, a.off_domain, json.loads(a.hybrid.read_text(encoding="utf-8")), rerank)
        print(json.dumps(chosen, indent=1))
        if a.write:
            keep = ("rerank", "first_stage", "first_stage_calibration")
            rerank["joint_gate"] = {f"both/{lang}": {k: g[k] for k in keep} for lang, g in chosen.items()}
            rerank["joint_gate_rule"] = JOINT_GATE_RULE
            a.rerank.write_text(json.dumps(rerank, indent=2) + "\n", encoding="utf-8")
        return 0
    if a.cmd == "gates":
        rates = serving_gate_rates(a.valid, a.off_domain, json.loads(a.hybrid.read_text(encoding="utf-8")),
                                   json.loads(a.rerank.read_text(encoding="utf-8")))
        print(json.dumps(rates, indent=1))
        return 0
    if a.cmd == "curve":
        curve = answerable_curve(a.valid, json.loads(a.calibration.read_text(encoding="utf-8")),
                                 (0.02, 0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75))
        print(json.dumps(curve, indent=1))
        return 0
    from service.models.manifest import read_manifest

    hybrid_sha = str(read_manifest(a.embedding_dir, "embedding")["onnx_sha256"])
    rerank_sha = str(read_manifest(a.reranker_dir, "cross-encoder")["onnx_sha256"]) if a.reranker_dir else ""
    merge = {kind: json.loads(path.read_text(encoding="utf-8"))
             for kind, path in (("hybrid", a.merge_hybrid), ("rerank", a.merge_rerank)) if path is not None}
    report = fit(a.train, a.valid, hybrid_sha=hybrid_sha, rerank_sha=rerank_sha, out=a.out, top=a.rows, l2=a.l2,
                 off_domain=a.off_domain, leg_sets=[x.strip() for x in a.leg_sets.split(",") if x.strip()],
                 merge=merge)
    for kind, langs in report["sources"].items():
        for lang, res in langs.items():
            print(f"{kind:7s} {lang:4s} " + ", ".join(f"{k} {v}" for k, v in res.items() if k != "reliability_top1"),
                  file=sys.stderr)
    for kind, langs in report["gate"].items():
        if kind == "rerank_with_first_stage":
            print(f"gate rerank with the first stage's gate too: {json.dumps(langs)}", file=sys.stderr)
            continue
        for lang, rows in langs.items():
            print(f"gate {kind:7s} {lang:4s} " + "  ".join(
                f"{r['min_quality']}:{r['answerable_kept']:.2f}/{r['off_domain_refused']:.2f}" for r in rows),
                file=sys.stderr)
    print(json.dumps({"out": str(a.out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
