"""How far the two-graph rerank's logits are from the one graph's (README "Cached passage
states"): both are int8 graphs whose activation scales are taken per call, so a logit moves
with its batch company; what matters for the shipped quality calibration is whether the
two graphs *shift* logits (signed mean) or only add noise of the one graph's own size.

    .venv/bin/python tests/bench/rerank_drift.py [--lang en] [--questions 30]

Per valid question: 3 judged answers + 17 random ones (seed 0), scored by the one graph
(one call over the 20 pairs, as every rerank ran before the two graphs), by the two graphs
on exact lower states, and by the two graphs on states through the full-width int8 codec
and the compact one (what ``rerank_states`` stores with ``rerank_scoring = "joint"``), and by
the two towers (README "Two towers": each side's upper layers alone, the passage's vector
through its int8 codec, as served).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from service.config import load_config  # noqa: E402
from service.eval.datasets import load_insuranceqa  # noqa: E402
from service.models.onnx_cross_encoder import OnnxCrossEncoder  # noqa: E402

RERANKER = "e5-small-split-reranker-int8"


def valid_reranks(lang: str, n_questions: int) -> list[list[tuple[str, str]]]:
    """The first ``n_questions`` valid questions (sorted ids), each with 3 judged answers + 17
    random ones (seed 0) as one rerank's pairs."""
    data = load_insuranceqa("valid", lang)  # type: ignore[arg-type]
    rng, answers = random.Random(0), sorted(data.corpus)
    return [[(data.queries[qid], data.corpus[a]) for a in sorted(data.qrels[qid])[:3] + rng.sample(answers, 17)]
            for qid in sorted(data.queries)[:n_questions]]


def main(lang: str, n_questions: int) -> None:
    model_dir = load_config(None).models_dir / RERANKER
    full, compact = OnnxCrossEncoder(model_dir, scoring="joint"), OnnxCrossEncoder(model_dir, compact_states=True,
                                                                                  scoring="joint")
    towers = OnnxCrossEncoder(model_dir, scoring="towers")
    scores: dict[str, list[np.ndarray]] = {}
    for pairs in valid_reranks(lang, n_questions):
        passages = [p for _, p in pairs]
        scores.setdefault("one graph", []).append(full.infer(full.tokenize(pairs)))
        exact = full.tokenize_with_states(pairs, [None] * len(pairs))
        exact.extra["stored"] = dict(enumerate(full._lower_states(full._passage_rows(passages))))
        exact.extra["missing"] = []
        scores.setdefault("two graphs, exact states", []).append(full.infer(exact))
        scores.setdefault("two graphs, int8 states", []).append(
            full.infer(full.tokenize_with_states(pairs, full.passage_states(passages))))
        scores.setdefault("two graphs, compact states", []).append(
            compact.infer(compact.tokenize_with_states(pairs, compact.passage_states(passages))))
        scores.setdefault("two towers (served)", []).append(
            towers.infer(towers.tokenize_with_states(pairs, towers.passage_states(passages))))
    one = np.concatenate(scores["one graph"])
    print(f"{lang}: {len(one)} pairs; logit - one graph's (the head scores 20 x cosine + interaction)")
    print(f"{'':<28} {'signed mean':>12} {'mean |d|':>9} {'p95 |d|':>8} {'max |d|':>8}")
    for name, parts in scores.items():
        if name == "one graph":
            continue
        d = np.concatenate(parts) - one
        print(f"{name:<28} {d.mean():>+12.3f} {np.abs(d).mean():>9.3f} {np.percentile(np.abs(d), 95):>8.3f} "
              f"{np.abs(d).max():>8.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--lang", choices=("en", "zh"), default="en")
    ap.add_argument("--questions", type=int, default=30)
    args = ap.parse_args()
    main(args.lang, args.questions)
