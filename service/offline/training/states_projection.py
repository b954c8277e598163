"""Fit the down-projection of the split reranker's stored passage states (PCA on train).

    python -m service.offline.training.states_projection [--dims 96] [--passages 400]

The lower layers' output at the split point is 384 floats per token; stored as int8 that is
~31 KB for an 80-token chunk. Storing the top ``dims`` principal components instead (and
expanding them back before the joint layers, ``x ~ mean + y @ components``) brings that to
``dims`` bytes (+2 for the scale) per token. The components are fitted on the token states
of InsuranceQA *train* answers only (en and zh, each the judged answer of a train question
and no valid question's answer); the test split is never read. The result is written into
the reranker artifact (``states_projection.npz``), its settings and explained variance into
the card; ``make models`` copies it next to the built graphs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from service.models.onnx_cross_encoder import OnnxCrossEncoder
from service.models.passage_states import PROJECTION_FILE, save_projection
from service.offline.builder import default_models_dir
from service.offline.builder.reranker import CARD_FILE, RERANKER_NAME, artifact_dir


def train_passages(lang: str, n: int, seed: int) -> list[str]:
    from service.eval.datasets import load_insuranceqa

    train = load_insuranceqa("train", lang)  # type: ignore[arg-type]
    valid = load_insuranceqa("valid", lang)  # type: ignore[arg-type]
    held_out = set().union(*valid.qrels.values())
    ids = sorted(set().union(*train.qrels.values()) - held_out)
    return [train.corpus[i] for i in random.Random(seed).sample(ids, min(n, len(ids)))]


def fit(states: np.ndarray, dims: int) -> tuple[np.ndarray, np.ndarray, float]:
    """mean [hidden], components [dims, hidden] (orthonormal rows), explained variance share."""
    mean = states.mean(axis=0)
    centred = states - mean
    cov = centred.T @ centred / len(states)
    values, vectors = np.linalg.eigh(cov.astype(np.float64))
    order = np.argsort(values)[::-1]
    components = vectors[:, order[:dims]].T.astype(np.float32)
    explained = float(values[order[:dims]].sum() / values.sum())
    return mean.astype(np.float32), components, explained


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, default=96)
    ap.add_argument("--passages", type=int, default=400, help="train answers per language")
    ap.add_argument("--langs", default="en,zh")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", type=Path, default=None, help="built reranker (default: the models dir's)")
    ap.add_argument("--out", type=Path, default=artifact_dir(RERANKER_NAME))
    args = ap.parse_args(argv)
    model_dir = args.model_dir or default_models_dir() / f"{RERANKER_NAME}-int8"
    ce = OnnxCrossEncoder(model_dir, threads=2)
    t0 = time.perf_counter()
    chunks = []
    per_lang: dict[str, int] = {}
    for lang in args.langs.split(","):
        passages = train_passages(lang, args.passages, args.seed)
        for i in range(0, len(passages), 16):
            chunks.extend(ce._lower_states(ce._passage_rows(passages[i : i + 16])))
        per_lang[lang] = len(passages)
        print(f"{lang}: {len(passages)} train answers, {sum(len(c) for c in chunks)} tokens so far", file=sys.stderr)
    states = np.concatenate(chunks)
    mean, components, explained = fit(states, args.dims)
    save_projection(args.out / PROJECTION_FILE, mean, components)
    card_path = args.out / CARD_FILE
    card = json.loads(card_path.read_text(encoding="utf-8"))
    card["states_projection"] = {
        "file": PROJECTION_FILE,
        "method": "PCA of the lower layers' token states (split point), int8 per token after projecting",
        "dims": args.dims,
        "hidden": int(states.shape[1]),
        "explained_variance": round(explained, 4),
        "fit_data": {"dataset": "InsuranceQA train answers (judged answers of train questions, no valid "
                                "question's answer; the test split is never read)",
                     "answers_per_language": per_lang, "tokens": int(len(states)), "seed": args.seed},
        "command": "python -m service.offline.training.states_projection " + " ".join(argv or sys.argv[1:]),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    card_path.write_text(json.dumps(card, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{args.dims} of {states.shape[1]} dims keep {explained:.1%} of the variance "
          f"({len(states)} tokens, {time.perf_counter() - t0:.0f}s) -> {args.out / PROJECTION_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
