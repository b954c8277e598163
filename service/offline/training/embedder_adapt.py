"""Domain adaptation of the embedder's upper layers on CPU (InsuranceQA train, or your own).

    python -m service.offline.training.embedder_adapt cache --cache .cache/adapt-cache
    python -m service.offline.training.embedder_adapt train --cache .cache/adapt-cache --out .cache/adapt-run --minutes 40
    python -m service.offline.training.embedder_adapt eval --cache .cache/adapt-cache --weights .cache/adapt-run
    python -m service.offline.training.embedder_adapt export --weights .cache/adapt-run \\
        --ship service/offline/builder/artifacts/multilingual-e5-small-iqa

Only the last ``12 - lower`` layers of multilingual-e5-small train; the first ``lower`` stay
the shipped ones. That keeps the split reranker's premise (its lower layers are the
embedder's, so a chunk's states at the split point are the same whichever model asks) and
makes training cheap: step 1 runs the frozen lower layers once (int8, as serving computes
them) over every chunk of the corpus, exactly as ingest chunks and embeds it, and over the
train and valid questions; step 2 trains the upper layers on those cached states.

The train questions that ``service eval --calibration-sample 300`` (seed 0) draws are left
out, so the quality calibration is fitted on questions the embedder never saw.

Loss: InfoNCE over in-batch positives plus one mined hard negative per question (from the
unadapted model's own dense ranking, judged positives excluded; other questions' positives
that are also this question's are masked), temperature ``--tau``, mean pooling and L2 norm
as serving. A document scores as its best chunk, as the service's knn leg collapses them.

Eval: dense nDCG@10 of valid questions over the full corpus (every chunk re-encoded through
the upper layers), for the unadapted layers and the trained ones, in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from service.offline.training.data import Ragged

CACHE_VERSION = 1
WEIGHTS_FILE = "adapt-weights.npz"
WEIGHTS_META = "adapt-weights.json"
DELTA_FILE = "upper_delta.npz"
MAX_TOKENS = 256  # serving's embedder truncation (onnx_embedder.DEFAULT_MAX_LENGTH)


def _log(msg: str) -> None:
    print(f"[adapt] {msg}", file=sys.stderr, flush=True)


# -- step 1: the cache ------------------------------------------------------------------------


@dataclass
class LangCorpus:
    """One language's corpus as ingest chunks it, and the judged questions."""

    doc_ids: list[str]
    chunk_owner: npt.NDArray[np.int64]  # chunk -> doc index
    chunk_texts: list[str]
    train_q: list[str]
    train_pos: list[list[int]]  # doc indices
    valid_q: list[str]
    valid_pos: list[list[int]]


def load_corpus(lang: str, valid_questions: int, seed: int = 0) -> LangCorpus:
    from service.config import Config
    from service.eval.datasets import load_insuranceqa
    from service.ingest.chunking import chunk_document, embedded_text

    cfg = Config()
    train = load_insuranceqa("train", lang)  # type: ignore[arg-type]
    valid = load_insuranceqa("valid", lang).sample(valid_questions, seed=seed)  # type: ignore[arg-type]
    doc_ids = sorted(train.corpus, key=int)
    slot = {d: i for i, d in enumerate(doc_ids)}
    owners: list[int] = []
    texts: list[str] = []
    for i, d in enumerate(doc_ids):
        for part in chunk_document(train.corpus[d], "", "doc", cfg.chunk_chars, cfg.parent_chars):
            owners.append(i)
            texts.append(embedded_text("", part))
    tq = sorted(train.queries)
    vq = sorted(valid.queries)
    return LangCorpus(doc_ids, np.asarray(owners, dtype=np.int64), texts,
                      [train.queries[q] for q in tq], [sorted(slot[d] for d in train.qrels[q]) for q in tq],
                      [valid.queries[q] for q in vq], [sorted(slot[d] for d in valid.qrels[q]) for q in vq])


def _tokenize(texts: list[str], prefix: str) -> list[npt.NDArray[np.int64]]:
    from tokenizers import Tokenizer

    from service.offline.training.pack import default_model_dir

    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=MAX_TOKENS)
    return [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch([prefix + t for t in texts])]


def build_cache(cache: Path, langs: list[str], lower: int, valid_questions: int, threads: int) -> None:
    from service.offline.training.split import _e5_source, encode_states, lower_session

    cache.mkdir(parents=True, exist_ok=True)
    src = _e5_source()
    session = lower_session(src, lower, threads, int8=True)
    for lang in langs:
        corpus = load_corpus(lang, valid_questions)
        (cache / f"{lang}_corpus.json").write_text(json.dumps({
            "doc_ids": corpus.doc_ids, "chunk_owner": corpus.chunk_owner.tolist(),
            "train_pos": corpus.train_pos, "valid_pos": corpus.valid_pos}))
        for name, texts, prefix in (("train_q", corpus.train_q, "query: "), ("valid_q", corpus.valid_q, "query: "),
                                    ("chunks", corpus.chunk_texts, "passage: ")):
            target = cache / f"{lang}_{name}.npy"
            if target.exists():
                _log(f"{target.name}: cached")
                continue
            flat, off = encode_states(session, _tokenize(texts, prefix), src.vocab.pad_id, label=f"{lang}/{name}")
            np.save(cache / f"{lang}_{name}_off.npy", off)
            np.save(target, flat)
    (cache / "cache.json").write_text(json.dumps({"version": CACHE_VERSION, "lower": lower, "langs": langs,
                                                  "valid_questions": valid_questions, "lower_precision": "int8",
                                                  "max_tokens": MAX_TOKENS}, indent=2))


@dataclass
class LangStates:
    chunks: Ragged
    train_q: Ragged
    valid_q: Ragged
    chunk_owner: npt.NDArray[np.int64]
    n_docs: int
    train_pos: list[list[int]]
    valid_pos: list[list[int]]


def load_cache(cache: Path, lang: str) -> LangStates:
    def rag(name: str) -> Ragged:
        return Ragged(np.load(cache / f"{lang}_{name}.npy", mmap_mode="r"), np.load(cache / f"{lang}_{name}_off.npy"))

    meta = json.loads((cache / f"{lang}_corpus.json").read_text())
    return LangStates(rag("chunks"), rag("train_q"), rag("valid_q"), np.asarray(meta["chunk_owner"], dtype=np.int64),
                      len(meta["doc_ids"]), meta["train_pos"], meta["valid_pos"])


# -- the trainable upper layers ----------------------------------------------------------------


def make_upper(lower: int, dropout: float) -> Any:
    import torch
    from torch import nn

    from service.offline.training.model import Layer, load_layer
    from service.offline.training.split import _e5_source

    src = _e5_source()
    cfg = src.config

    class Upper(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer(cfg.hidden, cfg.heads, cfg.intermediate, cfg.eps, dropout)
                                        for _ in range(cfg.layers - lower))

        def forward(self, x: Any, m: Any) -> Any:
            ext = (1.0 - m[:, None, None, :].float()) * -10000.0
            for layer in self.layers:
                x = layer(x, ext)
            mf = m.float()[:, :, None]
            v = (x * mf).sum(1) / mf.sum(1).clamp_min(1e-9)
            return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    model = Upper()
    with torch.no_grad():
        for layer, lw in zip(model.layers, src.weights.layers[lower:]):
            load_layer(cast(Layer, layer), lw)
    return model


def encode(model: Any, rag: Ragged, idx: npt.NDArray[np.int64] | list[int], micro: int = 32, bf16: bool | None = None,
           grad: bool = False) -> Any:
    """Vectors [len(idx), hidden] in ``idx`` order, micro-batches of similar length. ``bf16``
    None: autocast only where the CPU runs bf16 natively (``split.bf16_native``)."""
    import torch

    from service.offline.training.split import bf16_native, pad_states

    if bf16 is None:
        bf16 = bf16_native()

    idx = np.asarray(idx, dtype=np.int64)
    lens = rag.lengths()[idx]
    order = np.argsort(lens, kind="stable")
    parts, where = [], []
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with ctx:
        for s in range(0, len(order), micro):
            sel = order[s : s + micro]
            x, m = pad_states([np.asarray(rag[int(i)]) for i in idx[sel]])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                parts.append(model(x, m).float())
            where.append(sel)
        flat = torch.from_numpy(np.concatenate(where).astype(np.int64))
        out = torch.zeros(len(idx), parts[0].shape[1], dtype=torch.float32)
        return out.index_put((flat,), torch.cat(parts))


def doc_scores(q_vecs: npt.NDArray[np.float32], chunk_vecs: npt.NDArray[np.float32], owner: npt.NDArray[np.int64],
               n_docs: int) -> npt.NDArray[np.float32]:
    """[queries, docs]: the best chunk's cosine per document."""
    sims = q_vecs @ chunk_vecs.T
    out = np.full((len(q_vecs), n_docs), -np.inf, dtype=np.float32)
    # Chunks are laid out document by document: reduce each document's run of columns.
    starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    reduced = np.maximum.reduceat(sims, starts, axis=1)
    out[:, owner[starts]] = reduced
    return out


def ndcg10(scores: npt.NDArray[np.float32], positives: list[list[int]]) -> float:
    top = np.argsort(-scores, axis=1)[:, :10]
    vals = []
    for row, pos in zip(top, positives):
        rel = set(pos)
        dcg = sum(1.0 / math.log2(r + 2) for r, d in enumerate(row) if int(d) in rel)
        idcg = sum(1.0 / math.log2(r + 2) for r in range(min(10, len(rel))))
        vals.append(dcg / idcg if idcg else 0.0)
    return float(np.mean(vals))


def corpus_vectors(model: Any, st: LangStates, label: str) -> npt.NDArray[np.float32]:
    t0 = time.perf_counter()
    n = len(st.chunks)
    out = np.zeros((n, 384), dtype=np.float32)
    step = 2048
    for s in range(0, n, step):
        out[s : s + step] = encode(model, st.chunks, np.arange(s, min(n, s + step))).numpy()
        if s // step % 5 == 0:
            _log(f"{label}: {min(n, s + step)}/{n} chunks ({time.perf_counter() - t0:.0f}s)")
    return out


def evaluate(model: Any, st: LangStates, label: str) -> tuple[float, npt.NDArray[np.float32]]:
    model.eval()
    chunks = corpus_vectors(model, st, label)
    qv = encode(model, st.valid_q, np.arange(len(st.valid_q))).numpy()
    return ndcg10(doc_scores(qv, chunks, st.chunk_owner, st.n_docs), st.valid_pos), chunks


# -- step 2: training ---------------------------------------------------------------------------


def mine(model: Any, st: LangStates, chunks: npt.NDArray[np.float32], depth: int) -> tuple[list[list[int]], list[list[int]]]:
    """Per train question: its positives' best chunk (by the unadapted model), and the best
    chunks of the top-``depth`` non-positive documents."""
    qv = np.concatenate([encode(model, st.train_q, np.arange(s, min(len(st.train_q), s + 2048))).numpy()
                         for s in range(0, len(st.train_q), 2048)])
    starts = np.flatnonzero(np.r_[True, st.chunk_owner[1:] != st.chunk_owner[:-1]])
    doc_first = np.zeros(st.n_docs + 1, dtype=np.int64)
    doc_first[st.chunk_owner[starts]] = starts
    doc_first[st.n_docs] = len(st.chunk_owner)
    pos_chunks, neg_chunks = [], []
    for s in range(0, len(qv), 512):
        sims = qv[s : s + 512] @ chunks.T
        reduced = np.maximum.reduceat(sims, starts, axis=1)
        best = np.argsort(-reduced, axis=1)[:, : depth + 8]
        for r in range(len(sims)):
            qi = s + r
            pos = set(st.train_pos[qi])
            pc = []
            for d in pos:
                lo, hi = doc_first[d], (doc_first[d + 1] if d + 1 < st.n_docs else len(st.chunk_owner))
                pc.append(int(lo + np.argmax(sims[r, lo:hi])))
            pos_chunks.append(pc)
            negs = []
            for d in best[r]:
                d = int(d)
                if d in pos:
                    continue
                lo, hi = doc_first[d], (doc_first[d + 1] if d + 1 < st.n_docs else len(st.chunk_owner))
                negs.append(int(lo + np.argmax(sims[r, lo:hi])))
                if len(negs) == depth:
                    break
            neg_chunks.append(negs)
    return pos_chunks, neg_chunks


def held_out(lang: str, n: int, seed: int) -> set[int]:
    """Cache indices of the train questions ``service eval --calibration-sample n --seed
    seed`` draws: the quality calibration is fitted on them, so the adapted embedder must not
    have seen them (a cosine on a trained-on question is higher than on a new one)."""
    from service.eval.datasets import load_insuranceqa

    if n <= 0:
        return set()
    train = load_insuranceqa("train", lang)  # type: ignore[arg-type]
    index = {q: i for i, q in enumerate(sorted(train.queries))}
    return {index[q] for q in train.sample(n, seed=seed).queries}


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from service.offline.training.model import optimizer_step, save_checkpoint

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    meta = json.loads((args.cache / "cache.json").read_text())
    lower = int(meta["lower"])
    langs = [s for s in (args.langs or ",".join(meta["langs"])).split(",") if s]
    states = {lang: load_cache(args.cache, lang) for lang in langs}
    model = make_upper(lower, args.dropout)
    args.out.mkdir(parents=True, exist_ok=True)
    mined_path = args.out / "mined.json"
    report: dict[str, Any] = {"base": {}, "adapted": {}}
    if mined_path.exists():
        mined = json.loads(mined_path.read_text())
        report["base"] = mined.pop("_base")
    else:
        mined = {}
        for lang, st in states.items():
            base, chunks = evaluate(model, st, f"base {lang}")
            report["base"][lang] = round(base, 4)
            _log(f"base dense nDCG@10 {lang}: {base:.4f}")
            best_pos, hard_neg = mine(model, st, chunks, args.neg_depth)
            mined[lang] = {"pos": best_pos, "neg": hard_neg}
        mined_path.write_text(json.dumps({**mined, "_base": report["base"]}))
    held = {lang: held_out(lang, args.holdout_sample, args.holdout_seed) for lang in langs}
    items = [(lang, qi) for lang in langs for qi in range(len(states[lang].train_q))
             if mined[lang]["pos"][qi] and mined[lang]["neg"][qi] and qi not in held[lang]]
    _log(f"{len(items)} training questions ({sum(map(len, held.values()))} held out for the quality calibration)")
    steps_per_epoch = len(items) // args.batch
    planned = max(1, int(args.epochs * steps_per_epoch))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    step, train_seconds = 0, 0.0
    ckpt = args.out / "ckpt.pt"
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, train_seconds = int(state["step"]), float(state["train_seconds"])
        _log(f"resumed at step {step}")
    budget = args.minutes * 60 if args.minutes else None
    rng = random.Random(args.seed * 1000 + step)
    # Batches hold one language each, so in-batch negatives are same-language passages.
    by_lang: dict[str, list[int]] = {lang: [qi for (l_, qi) in items if l_ == lang] for lang in langs}
    last_ckpt = time.perf_counter()
    losses: list[float] = []
    model.train()

    def progress() -> float:
        p = step / planned
        if budget is not None:
            p = max(p, train_seconds / budget)
        return min(p, 1.0)

    while progress() < 1.0:
        t0 = time.perf_counter()
        p = progress()
        scale = p / args.warmup if p < args.warmup else (1.0 - p) / (1.0 - args.warmup)
        for g in opt.param_groups:
            g["lr"] = args.lr * max(scale, 0.0)
        lang = langs[step % len(langs)]
        st, mn = states[lang], mined[lang]
        qis: list[int] = rng.sample(by_lang[lang], args.batch)
        pos: list[int] = [int(rng.choice(mn["pos"][qi])) for qi in qis]
        neg: list[int] = [int(rng.choice(mn["neg"][qi][: args.neg_depth])) for qi in qis]
        qv = encode(model, st.train_q, qis, micro=args.batch, grad=True)
        pv = encode(model, st.chunks, pos + neg, micro=args.micro, grad=True)
        sims = qv @ pv.T / args.tau
        # Mask columns that are another judged positive of this question (shared answers).
        owner_cols = [int(st.chunk_owner[c]) for c in pos + neg]
        mask = torch.zeros_like(sims, dtype=torch.bool)
        for r, qi in enumerate(qis):
            rel = set(st.train_pos[qi])
            for c, d in enumerate(owner_cols):
                if c != r and d in rel:
                    mask[r, c] = True
        sims = sims.masked_fill(mask, -1e4)
        loss = torch.nn.functional.cross_entropy(sims, torch.arange(len(qis)))
        optimizer_step(model, opt, loss)
        step += 1
        train_seconds += time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if step % args.log_every == 0:
            _log(f"step {step}/{planned} loss {np.mean(losses[-args.log_every:]):.3f} "
                 f"(chance {math.log(2 * args.batch):.3f}) progress {progress():.1%} "
                 f"{step * args.batch / max(train_seconds, 1e-9):.1f} q/s")
        if time.perf_counter() - last_ckpt > args.ckpt_every_min * 60:
            save_checkpoint(ckpt, model, opt, step, train_seconds)
            last_ckpt = time.perf_counter()
    save_checkpoint(ckpt, model, opt, step, train_seconds)
    save_weights(model, args.out, {"lower": lower, "steps": step, "train_seconds": round(train_seconds, 1),
                                   "args": {k: str(v) for k, v in vars(args).items()}, "base": report["base"]})
    if not args.no_eval:
        for lang, st in states.items():
            score, _ = evaluate(model, st, f"adapted {lang}")
            report["adapted"][lang] = round(score, 4)
            _log(f"adapted dense nDCG@10 {lang}: {score:.4f} (base {report['base'].get(lang)})")
        meta_path = args.out / WEIGHTS_META
        saved = json.loads(meta_path.read_text())
        saved["valid_dense_ndcg10"] = report
        meta_path.write_text(json.dumps(saved, indent=2))
    return report


def save_weights(model: Any, out: Path, meta: dict[str, Any]) -> None:
    np.savez(out / WEIGHTS_FILE, **{k: v.detach().float().numpy() for k, v in model.state_dict().items()})
    (out / WEIGHTS_META).write_text(json.dumps(meta, indent=2))


def export_delta(weights: Path, ship: Path) -> Path:
    """The trained upper layers as ``upper_delta.npz`` in the builder's ``[in, out]`` layout
    (2-D weights fp16, biases and norms fp32): what ``builder/e5.py`` swaps in."""
    meta = json.loads((weights / WEIGHTS_META).read_text())
    lower = int(meta["lower"])
    w = np.load(weights / WEIGHTS_FILE)
    arrays: dict[str, npt.NDArray[Any]] = {}
    names = {"q": ("q_w", "q_b"), "k": ("k_w", "k_b"), "v": ("v_w", "v_b"), "ao": ("ao_w", "ao_b"),
             "fi": ("fi_w", "fi_b"), "fo": ("fo_w", "fo_b")}
    n_upper = len({k.split(".")[1] for k in w.files if k.startswith("layers.")})
    for j in range(n_upper):
        layer = lower + j
        for mod, (wn, bn) in names.items():
            arrays[f"{layer}.{wn}"] = np.ascontiguousarray(w[f"layers.{j}.{mod}.weight"].T).astype(np.float16)
            arrays[f"{layer}.{bn}"] = w[f"layers.{j}.{mod}.bias"].astype(np.float32)
        for ln, (wn, bn) in (("aln", ("aln_w", "aln_b")), ("oln", ("oln_w", "oln_b"))):
            arrays[f"{layer}.{wn}"] = w[f"layers.{j}.{ln}.weight"].astype(np.float32)
            arrays[f"{layer}.{bn}"] = w[f"layers.{j}.{ln}.bias"].astype(np.float32)
    ship.mkdir(parents=True, exist_ok=True)
    path = ship / DELTA_FILE
    np.savez_compressed(path, **arrays)  # type: ignore[arg-type]
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m service.offline.training.embedder_adapt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["cache", "train", "export"])
    p.add_argument("--cache", type=Path, default=Path(".cache/adapt-cache"))
    p.add_argument("--out", type=Path, default=Path(".cache/adapt-run"))
    p.add_argument("--weights", type=Path, default=Path(".cache/adapt-run"))
    p.add_argument("--ship", type=Path, default=Path("service/offline/builder/artifacts/multilingual-e5-small-iqa"))
    p.add_argument("--langs", default=None, help="comma list (cache default: en,zh)")
    p.add_argument("--lower", type=int, default=10)
    p.add_argument("--valid-questions", type=int, default=500)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="questions per step (one language per step)")
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--holdout-sample", type=int, default=300,
                   help="train questions left out: those `service eval --calibration-sample N` fits the calibration on")
    p.add_argument("--holdout-seed", type=int, default=0)
    p.add_argument("--neg-depth", type=int, default=20, help="hard negatives drawn from the base ranking's top-k")
    p.add_argument("--tau", type=float, default=0.02)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=float, default=0.05)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--minutes", type=float, default=None)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--ckpt-every-min", type=float, default=5.0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.step == "cache":
        build_cache(args.cache, [s for s in (args.langs or "en,zh").split(",") if s], args.lower,
                    args.valid_questions, args.threads)
    elif args.step == "train":
        print(json.dumps(train(args), indent=2))
    else:
        print(export_delta(args.weights, args.ship))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
