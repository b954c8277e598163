"""Pack reader, pair layout and batching for the trainer (numpy only).

Pairs are laid out exactly like serving's ``OnnxCrossEncoder.tokenize`` does with the e5
tokenizer's pair template: ``<s> q </s> </s> p </s>``, type ids all 0, the query clipped to
``max_len // 2`` tokens and the passage to what is left of ``max_len - 4``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.models.base import pad_rows
from service.offline.training.pack import DATA_FILE, MANIFEST_FILE

U16 = npt.NDArray[np.uint16]
I64 = npt.NDArray[np.int64]
PAIR_SPECIALS = 4  # <s> q </s> </s> p </s>


@dataclass
class Ragged:
    flat: npt.NDArray[Any]
    off: I64

    def __len__(self) -> int:
        return len(self.off) - 1

    def __getitem__(self, i: int) -> npt.NDArray[Any]:
        return self.flat[self.off[i] : self.off[i + 1]]

    def lengths(self) -> I64:
        return np.diff(self.off)


@dataclass
class LangData:
    lang: str
    docs: Ragged
    train_q: Ragged
    train_pos: Ragged
    train_neg: Ragged
    train_neg_src: Ragged
    valid_q: Ragged
    valid_cand: npt.NDArray[np.int32]
    valid_cand_score: npt.NDArray[np.float32]
    valid_rel: npt.NDArray[np.bool_]
    valid_nrel: npt.NDArray[np.int32]
    null_q: Ragged | None = None  # questions no passage answers (pack --null-questions)
    null_cand: Ragged | None = None  # their first-stage candidates, all negatives
    train_neg_rank: Ragged | None = None  # each negative's fused first-stage rank (packs since 2026-12-06)


@dataclass
class Pack:
    path: Path
    manifest: dict[str, Any]
    langs: dict[str, LangData]
    bos: int
    eos: int
    pad: int
    vocab_keep: I64


def load_pack(path: Path, langs: list[str] | None = None) -> Pack:
    manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    with np.load(path / DATA_FILE, allow_pickle=False) as z:
        a = {k: z[k] for k in z.files}

    def rag(name: str, off: str | None = None) -> Ragged:
        return Ragged(a[name], a[off or name + "_off"].astype(np.int64))

    out: dict[str, LangData] = {}
    for lang in langs or manifest["langs"]:
        if f"{lang}_doc_tok" not in a:
            raise ValueError(f"{path}: no {lang!r} data (pack has {manifest['langs']})")
        out[lang] = LangData(
            lang=lang,
            docs=rag(f"{lang}_doc_tok"),
            train_q=rag(f"{lang}_train_q_tok"),
            train_pos=rag(f"{lang}_train_pos"),
            train_neg=rag(f"{lang}_train_neg"),
            train_neg_src=rag(f"{lang}_train_neg_src", f"{lang}_train_neg_off"),
            valid_q=rag(f"{lang}_valid_q_tok"),
            valid_cand=a[f"{lang}_valid_cand"],
            valid_cand_score=a[f"{lang}_valid_cand_score"],
            valid_rel=a[f"{lang}_valid_rel"],
            valid_nrel=a[f"{lang}_valid_nrel"],
            null_q=rag(f"{lang}_null_q_tok") if f"{lang}_null_q_tok" in a else None,
            null_cand=rag(f"{lang}_null_cand") if f"{lang}_null_cand" in a else None,
            train_neg_rank=(rag(f"{lang}_train_neg_rank", f"{lang}_train_neg_off")
                            if f"{lang}_train_neg_rank" in a else None),
        )
    sp = manifest["tokenizer"]["special_ids"]
    return Pack(path, manifest, out, int(sp["<s>"]), int(sp["</s>"]), int(sp["<pad>"]), a["vocab_keep"])


def pair_ids(q: npt.NDArray[Any], p: npt.NDArray[Any], max_len: int, bos: int, eos: int) -> I64:
    """Token ids of one pair, truncated like serving (query first capped, then the passage)."""
    q = q[: max_len // 2]
    p = p[: max_len - PAIR_SPECIALS - len(q)]
    out = np.empty(len(q) + len(p) + PAIR_SPECIALS, dtype=np.int64)
    out[0] = bos
    out[1 : 1 + len(q)] = q
    out[1 + len(q) : 3 + len(q)] = eos
    out[3 + len(q) : 3 + len(q) + len(p)] = p
    out[-1] = eos
    return out


def pair_len(q_len: int, p_len: int, max_len: int) -> int:
    q_len = min(q_len, max_len // 2)
    return q_len + min(p_len, max_len - PAIR_SPECIALS - q_len) + PAIR_SPECIALS


def pad(seqs: list[I64], pad_id: int, multiple: int = 8) -> tuple[I64, I64]:
    """[n, width] ids and attention mask (width rounded up to ``multiple``)."""
    return pad_rows(seqs, pad_id, multiple)


def token_batches(order: Sequence[int], widths: Sequence[int], budget: int) -> Iterator[list[int]]:
    """Consecutive runs of ``order`` whose rows x widest width stay within ``budget`` tokens
    (a single row may exceed it alone). Sized on the widest row of the run, so an order that
    is not sorted by width (blocks of questions, each sorted) never overruns the budget."""
    i = 0
    while i < len(order):
        n = max(1, budget // max(1, widths[order[i]]))
        idx = list(order[i : i + n])
        while len(idx) > 1 and len(idx) * max(widths[j] for j in idx) > budget:
            idx = idx[: max(1, len(idx) // 2)]
        yield idx
        i += len(idx)


@dataclass
class Group:
    lang: str
    q: int  # train question index
    docs: list[int]  # positive first
    length: int  # longest pair in the group


def epoch_groups(pack: Pack, epoch: int, group: int, max_len: int, seed: int) -> list[Group]:
    """One positive + ``group - 1`` negatives per train question (seeded per epoch)."""
    rng = np.random.default_rng([seed, epoch, 7])
    groups: list[Group] = []
    for lang, d in pack.langs.items():
        doc_lens = d.docs.lengths()
        q_lens = d.train_q.lengths()
        for qi in range(len(d.train_q)):
            pos = d.train_pos[qi]
            neg = d.train_neg[qi]
            if len(pos) == 0 or len(neg) == 0:
                continue
            need = group - 1
            chosen = rng.choice(neg, size=need, replace=len(neg) < need)
            docs = [int(rng.choice(pos))] + [int(x) for x in chosen]
            length = max(pair_len(int(q_lens[qi]), int(doc_lens[x]), max_len) for x in docs)
            groups.append(Group(lang, qi, docs, length))
    return groups


def epoch_batches(groups: list[Group], batch_groups: int, epoch: int, seed: int) -> list[list[Group]]:
    """Length-bucketed batches: shuffle, sort within windows of 50 batches, shuffle batches."""
    rng = np.random.default_rng([seed, epoch, 11])
    order = rng.permutation(len(groups))
    window = batch_groups * 50
    batches: list[list[Group]] = []
    for start in range(0, len(order), window):
        chunk = sorted((groups[i] for i in order[start : start + window]), key=lambda g: g.length)
        batches += [chunk[i : i + batch_groups] for i in range(0, len(chunk), batch_groups)]
    perm = rng.permutation(len(batches))
    return [batches[i] for i in perm]


def batch_arrays(pack: Pack, batch: list[Group], max_len: int) -> tuple[I64, I64]:
    seqs = []
    for g in batch:
        d = pack.langs[g.lang]
        q = d.train_q[g.q]
        seqs += [pair_ids(q, d.docs[x], max_len, pack.bos, pack.eos) for x in g.docs]
    return pad(seqs, pack.pad)


def ndcg10_from_order(rel_sorted: npt.NDArray[np.bool_], n_rel: int) -> float:
    gains = rel_sorted[:10].astype(np.float64) / np.log2(np.arange(2, 2 + min(10, len(rel_sorted))))
    ideal = (1.0 / np.log2(np.arange(2, 2 + min(n_rel, 10)))).sum()
    return float(gains.sum() / ideal) if ideal > 0 else 0.0
