"""Measure a split reranker's two towers as a full-corpus retriever, on a pack's valid
questions (InsuranceQA valid, answer level, as the pack holds them).

    python -m service.offline.training.tower_leg --pack .cache/train-pack --cache .cache/split-cache \\
        --model ~/.cache/retrieval-service/models/e5-small-split-reranker-int8 --lang en

The towers score a passage from its own vector (README "Two towers"), so they could search
the whole corpus as a dense leg instead of only reordering the first stage's head. This
runs the served ``tower.onnx`` over the split cache's layer-9 states of every passage of
the pack (cut at the served passage cap) and of the valid questions, one a call as serving
does, and prints nDCG@10 of:

- ``first_stage``: the pack's fused first stage (BM25 + e5 dense, RRF);
- ``towers``: the towers alone over the full corpus;
- ``first_stage+towers``: RRF (k 60) of the two lists;
- ``rerank(first_stage)`` / ``rerank(first_stage+towers)``: the head of each list (``--depths``)
  reordered by ``alpha * minmax(tower logit) + (1 - alpha) * minmax(list score)``.

Relevance is the pack's own: every judged answer of a valid question in the pack's corpus,
rebuilt from its manifest with the sampling the pack ran (``pack.sampled_ids``). Tower vectors are cached beside the
split cache (``tower-<sha12>-*.npy``), so a second run is seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.models._ort import make_session
from service.models.base import pad_states
from service.models.manifest import sha256_file
from service.models.towers import load_tower_head
from service.offline.training.data import Ragged, load_pack, ndcg10_from_order
from service.offline.training.pack import sampled_ids
from service.offline.training.split import load_cache
from service.pipeline.fusion import interpolate

ALPHAS = (0.5, 0.7, 1.0)
RRF_K = 60


def onnx_tower_vectors(session: Any, rag: Ragged, cap: int, batch: int = 1) -> npt.NDArray[np.float32]:
    """[n, hidden]: each row's states (first ``cap`` tokens) through the tower graph, in
    length-sorted batches of ``batch``. The default, one row a call, is how serving computes
    a vector (the int8 graph's activation scale is its batch's, so batches move vectors by
    its rounding; over this measurement by ~0.003 nDCG@10)."""
    hidden = int(np.asarray(rag[0]).shape[1])
    out = np.zeros((len(rag), hidden), np.float32)
    order = np.argsort(np.minimum(rag.lengths(), cap), kind="stable")
    for s in range(0, len(order), batch):
        sel = order[s : s + batch]
        x, mask = pad_states([np.asarray(rag[i][:cap], np.float32) for i in sel], hidden)
        out[sel] = session.run(None, {"states": x, "attention_mask": mask})[0]
    return out


def valid_relevance(manifest: dict[str, Any], lang: str) -> list[set[int]]:
    """Each packed valid question's judged answers as pack doc indices (the pack's own
    samples, ``pack.sampled_ids``, from its manifest)."""
    from service.eval.datasets import load_insuranceqa

    if not str(manifest.get("source", {}).get("data", "")).startswith("insuranceqa"):
        raise SystemExit("tower_leg reads InsuranceQA packs (this one was packed from your own judgements)")
    settings = manifest["settings"]
    train, valid = load_insuranceqa("train", lang), load_insuranceqa("valid", lang)  # type: ignore[arg-type]
    _, vq_ids, doc_ids = sampled_ids(train, valid, random.Random(f"{manifest['seed']}-{lang}"),
                                     settings["train_questions"], settings["valid_questions"], settings["corpus_size"])
    index = {d: i for i, d in enumerate(doc_ids)}
    return [{index[d] for d in valid.qrels[q] if d in index} for q in vq_ids]


def measure(pack_dir: Path, cache: Path, model: Path, lang: str, cap: int, depths: tuple[int, ...]) -> dict[str, Any]:
    pack = load_pack(pack_dir, [lang])
    d = pack.langs[lang]
    states = load_cache(cache, [lang])[lang]
    tower = model / "tower.onnx"
    session = make_session(tower, 2)  # serving's session, exact int8 kernels where it takes them
    w, b = load_tower_head(model / "tower_head.npz")
    tag = sha256_file(tower)[:12]
    vectors = {}
    for name, rag, limit in (("docs", states.docs, cap), ("valid_q", states.valid_q, 1 << 30)):
        path = cache / f"tower-{tag}-{lang}_{name}-cap{min(limit, 9999)}-alone.npy"
        if not path.exists():
            t0 = time.perf_counter()
            np.save(path, onnx_tower_vectors(session, rag, limit))
            print(f"[tower_leg] {lang} {name}: {len(rag)} vectors in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        vectors[name] = np.load(path)
    scores = (vectors["valid_q"] * w) @ vectors["docs"].T + b
    relevant = valid_relevance(pack.manifest, lang)
    runs: dict[str, list[float]] = {}

    def add(name: str, ranked: list[int], rel: set[int]) -> None:
        runs.setdefault(name, []).append(ndcg10_from_order(np.array([c in rel for c in ranked], np.bool_), len(rel)))

    for qi, rel in enumerate(relevant):
        if len(rel) != int(d.valid_nrel[qi]):
            raise SystemExit(f"valid question {qi}: {len(rel)} judged answers here, {int(d.valid_nrel[qi])} in the "
                             "pack: not the pack's sample")
        first = [int(c) for c in d.valid_cand[qi] if c >= 0]
        towers = [int(c) for c in np.argsort(-scores[qi])[:100]]
        fused: dict[int, float] = {}
        for ranked in (first, towers[: len(first)]):
            for r, c in enumerate(ranked):
                fused[c] = fused.get(c, 0.0) + 1.0 / (RRF_K + r + 1)
        both = sorted(fused, key=lambda c: -fused[c])
        add("first_stage", first, rel)
        add("towers", towers, rel)
        add("first_stage+towers", both, rel)
        lists = {"first_stage": (first, [float(x) for x in d.valid_cand_score[qi][: len(first)]]),
                 "first_stage+towers": (both, [fused[c] for c in both])}
        for name, (ranked, list_scores) in lists.items():
            for depth in depths:
                head = ranked[:depth]
                logits = [float(scores[qi, c]) for c in head]
                for alpha in ALPHAS:
                    mixed = np.asarray(interpolate(logits, list_scores[:depth], alpha))
                    order = np.argsort(-mixed, kind="stable")
                    add(f"rerank({name}) top {depth} alpha {alpha}", [head[i] for i in order] + ranked[depth:], rel)
    return {"lang": lang, "model": str(model), "tower_sha256": sha256_file(tower), "passage_cap": cap,
            "questions": len(relevant), "ndcg@10": {k: round(float(np.mean(v)), 4) for k, v in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.offline.training.tower_leg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pack", type=Path, required=True)
    p.add_argument("--cache", type=Path, required=True, help="the split cache (split cache --lower 9) of that pack")
    p.add_argument("--model", type=Path, required=True, help="an assembled split reranker dir with tower.onnx")
    p.add_argument("--lang", required=True)
    p.add_argument("--passage-cap", type=int, default=128, help="passage tokens the tower reads (rerank_passage_tokens)")
    p.add_argument("--depths", default="20,50", help="comma-separated head sizes reordered by the towers")
    a = p.parse_args(argv)
    print(json.dumps(measure(a.pack, a.cache, a.model, a.lang, a.passage_cap,
                             tuple(int(x) for x in a.depths.split(",") if x)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
