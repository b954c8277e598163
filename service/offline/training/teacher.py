"""Score every training pair of a pack with a trained cross-encoder: distillation targets.

    python -m service.offline.training.teacher --pack .cache/train-pack --weights RUN --out teacher.npz --device cuda

The joint (12-layer) cross-encoder that ``train.py`` fits on a GPU is too slow to serve on 2
cores, but its logits over each train question's positives and mined negatives are what a
smaller reranker (the split one, trained on CPU) can learn from. Scoring them needs a GPU
too (~1.6 M pairs for en + zh), so this runs in the same device call as the training and
brings back a few MB.

Output ``teacher.npz``, per language ``L``:
  ``L_off`` (int64, questions + 1): question ``i``'s pairs are ``[off[i], off[i+1])``;
  ``L_doc`` (int32): the pack's passage index of each pair, the question's positives first,
  then its negatives, in the pack's order; ``L_score`` (float16): the teacher's logit;
  ``L_done`` (int64 scalar): questions scored (all, unless the time budget ran out).
  ``meta`` (JSON string): pack data sha256, weights' shard hashes, ``max_len``, seconds.
Keyed by passage index, so a trainer can look a pair up even in a rebuilt pack whose mined
negatives differ (its questions and passages keep their order: the whole split, the whole corpus).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.offline.training.data import Pack, load_pack, pad, pair_ids, token_batches
from service.offline.training.pack import BACKBONE_FILE

TOKENS_PER_BATCH_CUDA = 131072
TOKENS_PER_BATCH_CPU = 4096
# Questions scored together (their pairs length-sorted into batches); a deadline cuts between
# blocks, so on CPU, where a 256-question block of a 12-layer model takes many minutes, blocks
# are small enough to keep a `--minutes` dry run within seconds of its budget.
QUESTION_BLOCK_CUDA = 256
QUESTION_BLOCK_CPU = 8


def _log(msg: str) -> None:
    print(f"[teacher] {msg}", file=sys.stderr, flush=True)


def question_pairs(pack: Pack, lang: str) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
    """Offsets and passage indices of every (positive, then negative) pair per train question."""
    d = pack.langs[lang]
    docs: list[npt.NDArray[Any]] = []
    off = np.zeros(len(d.train_q) + 1, dtype=np.int64)
    for qi in range(len(d.train_q)):
        row = np.concatenate([d.train_pos[qi], d.train_neg[qi]]).astype(np.int32)
        docs.append(row)
        off[qi + 1] = off[qi] + len(row)
    return off, (np.concatenate(docs) if docs else np.zeros(0, dtype=np.int32))


def score(model: Any, pack: Pack, lang: str, off: npt.NDArray[np.int64], doc: npt.NDArray[np.int32], max_len: int,
          device: Any, amp: bool, deadline: float | None) -> tuple[npt.NDArray[np.float16], int]:
    """Logits of every pair, question block by block; stops between blocks at ``deadline``."""
    import torch  # type: ignore[import-not-found, unused-ignore]  # the train extra

    d = pack.langs[lang]
    out = np.zeros(len(doc), dtype=np.float16)
    cuda = device.type == "cuda"
    per_batch = TOKENS_PER_BATCH_CUDA if cuda else TOKENS_PER_BATCH_CPU
    block = QUESTION_BLOCK_CUDA if cuda else QUESTION_BLOCK_CPU
    nq = len(off) - 1
    done = 0
    with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        for start in range(0, nq, block):
            if deadline is not None and time.monotonic() > deadline:
                break
            stop = min(nq, start + block)
            seqs = []
            for qi in range(start, stop):
                q = d.train_q[qi]
                seqs += [pair_ids(q, d.docs[int(x)], max_len, pack.bos, pack.eos) for x in doc[off[qi] : off[qi + 1]]]
            widths = [len(x) for x in seqs]
            base = int(off[start])
            for idx in token_batches(sorted(range(len(seqs)), key=widths.__getitem__), widths, per_batch):
                ids, mask = pad([seqs[j] for j in idx], pack.pad)
                logits = model(torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)).float().cpu().numpy()
                out[[base + j for j in idx]] = logits.astype(np.float16)
            done = stop
    return out, done


def run(pack_dir: Path, weights_dir: Path, out: Path, device_name: str, minutes: float | None,
        langs: list[str] | None = None) -> dict[str, Any]:
    import torch  # type: ignore[import-not-found, unused-ignore]  # the train extra

    from service.offline.builder.q4bin import read_e5_bin
    from service.offline.training.export import build_torch, load_weights

    t0 = time.monotonic()
    deadline = t0 + minutes * 60 if minutes else None
    device = torch.device(device_name)
    pack = load_pack(pack_dir, langs)
    index, tensors = load_weights(weights_dir)
    model = build_torch(index, tensors, read_e5_bin(pack_dir / BACKBONE_FILE)).to(device)
    max_len = int(index["max_len"])
    arrays: dict[str, Any] = {}
    report: dict[str, Any] = {}
    for lang in pack.langs:
        off, doc = question_pairs(pack, lang)
        t1 = time.monotonic()
        scores, done = score(model, pack, lang, off, doc, max_len, device, device.type == "cuda", deadline)
        secs = time.monotonic() - t1
        arrays.update({f"{lang}_off": off, f"{lang}_doc": doc, f"{lang}_score": scores, f"{lang}_done": np.int64(done)})
        pairs = int(off[done])
        report[lang] = {"questions": len(off) - 1, "scored": done, "pairs": pairs, "seconds": round(secs, 1),
                        "pairs_per_s": round(pairs / max(secs, 1e-6), 1)}
        _log(f"{lang}: {done}/{len(off) - 1} questions, {pairs} pairs in {secs:.1f}s")
    meta = {"format": "teacher-scores/1", "pack_data_sha256": pack.manifest["files"]["data.npz"]["sha256"],
            "weights": [{k: s[k] for k in ("file", "sha256")} for s in index["shards"]], "kept": index.get("kept"),
            "layers": index["config"]["layers"], "max_len": max_len, "device": str(device), "report": report,
            "seconds": round(time.monotonic() - t0, 1)}
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, meta=np.array(json.dumps(meta)), **arrays)
    return meta


def load_teacher(path: Path) -> tuple[dict[str, Any], dict[str, dict[tuple[int, int], float]]]:
    """``meta`` and, per language, ``{(train question index, passage index): logit}`` for scored pairs."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        out: dict[str, dict[tuple[int, int], float]] = {}
        for lang in meta["report"]:
            off, doc, sc, done = z[f"{lang}_off"], z[f"{lang}_doc"], z[f"{lang}_score"], int(z[f"{lang}_done"])
            table: dict[tuple[int, int], float] = {}
            for qi in range(done):
                for j in range(int(off[qi]), int(off[qi + 1])):
                    table[(qi, int(doc[j]))] = float(sc[j])
            out[lang] = table
    return meta, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.offline.training.teacher", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pack", type=Path, required=True)
    p.add_argument("--weights", type=Path, required=True, help="the trainer's --out dir (weights-*.npz + weights.json)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--langs", default=None)
    p.add_argument("--minutes", type=float, default=None, help="time budget; what is scored by then is written")
    a = p.parse_args(argv)
    meta = run(a.pack, a.weights, a.out, a.device, a.minutes, a.langs.split(",") if a.langs else None)
    print(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
