"""Cross-lingual distillation targets on CPU: the language a reranker reads best teaches the other.

    python -m service.offline.training.crosslingual_teacher --pack .cache/train-pack \\
        --cache .cache/cont2/cache-l9 --reranker ~/.cache/retrieval-service/models/e5-small-split-reranker-int8 \\
        --source en --target zh --questions 2000 --out .cache/xl/teacher-zh.npz

InsuranceQA's Chinese side is a translation of its English side: the same question and answer
ids, so an InsuranceQA pack's question and passage indices name the same question and answer in
both languages. The served reranker ranks the English side of a Chinese training list far better
than the Chinese itself (150 train questions' mined lists of ~65: the positive's mean rank 6.8
against 13.1, first 32 % of the time against 17 %). Its logits over each target-language training
pair, read in the source language, are distillation targets for the target language
(``split train --teacher T``; ``--teacher-only`` trains on the scored questions alone).

Scoring runs the reranker's joint graph (``joint.onnx``, serving's session) over the split
trainer's cached lower-layer states of the source language (``split cache``: the served int8
lower graph's output in the trainer's layout), so it needs no GPU: ~110 pairs/s on 2 cores.
Questions are scored in the pack's order, so a cut run is a prefix, as ``teacher.py``'s.

Output: ``teacher.py``'s format (``load_teacher``); the source language gets an empty table,
so its groups learn from their labels alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.models.base import pad_states
from service.offline.training.data import load_pack
from service.offline.training.pack import MANIFEST_FILE
from service.offline.training.teacher import question_pairs

ROWS_PER_CALL = 8  # pairs per joint-graph call, length-sorted (padding against call overhead)


def _log(msg: str) -> None:
    print(f"[crosslingual-teacher] {msg}", file=sys.stderr, flush=True)


def score(pack_dir: Path, cache: Path, reranker: Path, source: str, target: str, questions: int | None,
          out: Path, threads: int = 2, log: Any = _log) -> dict[str, Any]:
    from service.models._ort import make_session
    from service.offline.training.split import load_cache

    t0 = time.monotonic()
    manifest = json.loads((pack_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
    settings = manifest.get("settings") or {}
    # Only a whole-split, whole-corpus InsuranceQA pack orders both languages by the same ids
    # (a sampled one draws its questions and corpus per language).
    if (not str((manifest.get("source") or {}).get("data", "")).startswith("insuranceqa")
            or settings.get("train_questions") is not None or settings.get("corpus_size") is not None
            or not {source, target} <= set(manifest.get("langs") or [])):
        raise SystemExit(f"{pack_dir}: {source} and {target} are not parallel: cross-lingual targets need a pack of "
                         "InsuranceQA's whole train split and corpus in both languages")
    pack = load_pack(pack_dir, [source, target])
    s, t = pack.langs[source], pack.langs[target]
    if len(s.docs) != len(t.docs) or len(s.train_q) != len(t.train_q):
        raise SystemExit(f"{pack_dir}: {source} and {target} are not parallel (passages or train questions differ)")
    states = load_cache(cache, [source])[source]
    meta_cache = json.loads((cache / "cache.json").read_text())
    if meta_cache.get("pack_sha256") != pack.manifest["files"]["data.npz"]["sha256"]:
        raise SystemExit(f"{cache}: its states are for another pack")
    off, doc = question_pairs(pack, target)
    n = len(off) - 1 if questions is None else min(questions, len(off) - 1)
    pairs = int(off[n])
    doc, qof = doc[:pairs], np.repeat(np.arange(n), np.diff(off[: n + 1]))
    session = make_session(reranker / "joint.onnx", threads=1)
    hidden = int(states.docs.flat.shape[1])
    lengths = states.docs.lengths()[doc]
    order = np.lexsort((qof, lengths))
    calls = [order[i : i + ROWS_PER_CALL] for i in range(0, len(order), ROWS_PER_CALL)]
    scores = np.zeros(pairs, np.float32)

    def run(rows: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        qx, qm = pad_states([states.train_q[int(q)] for q in qof[rows]], hidden)
        px, pm = pad_states([states.docs[int(x)] for x in doc[rows]], hidden)
        logits = session.run(None, {"query_states": qx, "query_mask": qm, "passage_states": px, "passage_mask": pm})[0]
        return rows, np.asarray(logits, np.float32).reshape(-1)

    done, last = 0, time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:  # onnxruntime releases the GIL
        for rows, logits in pool.map(run, calls):
            scores[rows] = logits
            done += len(rows)
            if time.monotonic() - last > 60:
                last = time.monotonic()
                log(f"{done}/{pairs} pairs, {done / (last - t0):.0f}/s")
    secs = time.monotonic() - t0
    report = {target: {"questions": len(off) - 1, "scored": n, "pairs": pairs, "seconds": round(secs, 1),
                       "pairs_per_s": round(pairs / max(secs, 1e-6), 1), "read_in": source},
              source: {"questions": len(s.train_q), "scored": 0, "pairs": 0}}
    meta = {"format": "teacher-scores/1", "kind": "cross-lingual",
            "pack_data_sha256": pack.manifest["files"]["data.npz"]["sha256"],
            "layers": f"{reranker.name}: joint graph over the {source} side's cached lower states",
            "reranker": str(reranker), "report": report, "seconds": round(secs, 1)}
    arrays: dict[str, Any] = {f"{target}_off": off[: n + 1], f"{target}_doc": doc.astype(np.int32),
              f"{target}_score": scores.astype(np.float16), f"{target}_done": np.int64(n),
              f"{source}_off": np.zeros(1, np.int64), f"{source}_doc": np.zeros(0, np.int32),
              f"{source}_score": np.zeros(0, np.float16), f"{source}_done": np.int64(0)}
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, meta=np.array(json.dumps(meta)), **arrays)
    log(f"{target}: {n} questions, {pairs} pairs read in {source} in {secs:.0f}s")
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.offline.training.crosslingual_teacher", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pack", type=Path, required=True)
    p.add_argument("--cache", type=Path, required=True, help="split cache of the same pack (holds the source's states)")
    p.add_argument("--reranker", type=Path, required=True, help="a split reranker's model dir (joint.onnx)")
    p.add_argument("--source", default="en")
    p.add_argument("--target", default="zh")
    p.add_argument("--questions", type=int, default=None, help="the first N train questions (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    print(json.dumps(score(a.pack, a.cache, a.reranker, a.source, a.target, a.questions, a.out, a.threads), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
