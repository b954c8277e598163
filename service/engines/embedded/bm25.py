"""Lucene BM25 (k1=1.2, b=0.75) over one text field, scored the way OpenSearch scores a
single-field ``match`` query, down to Lucene's float32 arithmetic.

What Lucene does and this mirrors:
- the field length is stored lossily (``SmallFloat.intToByte4``), and scoring reads it back
  through ``byte4ToInt``; avgdl uses exact ``sumTotalTermFreq / docCount``;
- idf = ln(1 + (docCount - df + 0.5) / (df + 0.5)); per term,
  score = w - w / (1 + freq * normInverse) with w = boost * idf and
  normInverse = 1 / (k1 * ((1 - b) + b * dl / avgdl)), all in float32 (no (k1 + 1) factor);
- ``match`` ORs one SHOULD term clause per query token; BooleanQuery folds duplicate clauses
  into one clause with boost = repeat count, so a repeated query term counts per occurrence;
- clause scores are summed in double and cast to float; ties rank the lower doc id first.

Postings are per-term int32 arrays appended in slot order, so adds are incremental; deletes
only clear a live flag, and ``compact`` drops dead slots when the caller decides to.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

K1 = np.float32(1.2)
B = np.float32(0.75)

BoolArray = npt.NDArray[np.bool_]


def _long_to_int4(i: int) -> int:
    num_bits = i.bit_length()
    if num_bits < 4:
        return i  # subnormal
    shift = num_bits - 4
    return ((i >> shift) & 0x07) | ((shift + 1) << 3)


def _int4_to_long(i: int) -> int:
    bits, shift = i & 0x07, (i >> 3) - 1
    return bits if shift == -1 else (bits | 0x08) << shift


_NUM_FREE_VALUES = 255 - _long_to_int4(2**31 - 1)  # = 24: lengths below this are exact


def int_to_byte4(i: int) -> int:
    """``SmallFloat.intToByte4``: the norm byte Lucene stores for a field length."""
    if i < 0:
        raise ValueError(f"negative length {i}")
    if i < _NUM_FREE_VALUES:
        return i
    return _NUM_FREE_VALUES + _long_to_int4(i - _NUM_FREE_VALUES)


def byte4_to_int(b: int) -> int:
    """``SmallFloat.byte4ToInt``: the (approximate) length scoring reads back."""
    if b < _NUM_FREE_VALUES:
        return b
    return _NUM_FREE_VALUES + _int4_to_long(b - _NUM_FREE_VALUES)


LENGTH_TABLE = np.array([byte4_to_int(i) for i in range(256)], dtype=np.float32)


def idf(doc_freq: int, doc_count: int) -> np.float32:
    return np.float32(math.log(1 + (doc_count - doc_freq + 0.5) / (doc_freq + 0.5)))


def norm_inverse_table(avgdl: np.float32) -> npt.NDArray[np.float32]:
    """BM25Similarity's per-norm-byte cache, evaluated in Lucene's float32 operation order."""
    table: npt.NDArray[np.float32] = np.float32(1) / (
        K1 * ((np.float32(1) - B) + B * LENGTH_TABLE / avgdl)
    )
    return table


class Bm25Index:
    """Inverted index over integer doc slots (slot order = Lucene doc id order)."""

    def __init__(self) -> None:
        self._term_ids: dict[str, int] = {}
        self._slots: list[array[int]] = []  # per term: slots holding it, ascending
        self._freqs: list[array[int]] = []  # per term: term frequency in that slot
        self._norms = np.zeros(0, dtype=np.uint8)
        self._lengths = np.zeros(0, dtype=np.int64)  # exact, for sumTotalTermFreq upkeep
        self._live = np.zeros(0, dtype=np.bool_)
        self._size = 0
        self.doc_count = 0  # live docs with at least one term (Lucene's Terms.getDocCount)
        self.sum_total_term_freq = 0

    def _reserve(self, n: int) -> None:
        if n <= len(self._live):
            return
        cap = max(n, 2 * len(self._live), 1024)
        for name in ("_norms", "_lengths", "_live"):
            old = getattr(self, name)
            grown = np.zeros(cap, dtype=old.dtype)
            grown[: len(old)] = old
            setattr(self, name, grown)

    def add(self, slot: int, terms: Sequence[str]) -> None:
        """Index one doc's analysed terms at ``slot`` (slots must be added in increasing order)."""
        if slot < self._size:
            raise ValueError(f"slot {slot} already used")
        self._reserve(slot + 1)
        self._size = slot + 1
        for term, freq in Counter(terms).items():
            tid = self._term_ids.get(term)
            if tid is None:
                tid = self._term_ids[term] = len(self._slots)
                self._slots.append(array("i"))
                self._freqs.append(array("i"))
            self._slots[tid].append(slot)
            self._freqs[tid].append(freq)
        self._norms[slot] = int_to_byte4(len(terms))
        self._lengths[slot] = len(terms)
        self._live[slot] = True
        if terms:
            self.doc_count += 1
            self.sum_total_term_freq += len(terms)

    def delete(self, slot: int) -> None:
        if slot >= self._size or not self._live[slot]:
            return
        self._live[slot] = False
        length = int(self._lengths[slot])
        if length:
            self.doc_count -= 1
            self.sum_total_term_freq -= length

    def search(
        self, query_terms: Sequence[str], k: int, allowed: BoolArray | None = None
    ) -> list[tuple[int, float]]:
        """Top ``k`` ``(slot, score)`` among live slots (and ``allowed`` ones, when given),
        score descending then slot ascending. Filters apply before ranking."""
        if k <= 0 or self.doc_count == 0:
            return []
        mask = self._live[: self._size]
        if allowed is not None:
            mask = mask & allowed[: self._size]
        avgdl = np.float32(self.sum_total_term_freq / self.doc_count)
        norm_inv = norm_inverse_table(avgdl)
        hit_slots: list[npt.NDArray[np.int64]] = []
        hit_scores: list[npt.NDArray[np.float32]] = []
        for term, count in Counter(query_terms).items():
            tid = self._term_ids.get(term)
            if tid is None:
                continue
            slots = np.array(self._slots[tid], dtype=np.int64)
            live = self._live[slots]
            doc_freq = int(np.count_nonzero(live))  # stats cover every live doc, filtered or not
            if doc_freq == 0:
                continue
            keep = live & mask[slots]
            slots = slots[keep]
            freqs = np.array(self._freqs[tid], dtype=np.float32)[keep]
            weight = np.float32(count) * idf(doc_freq, self.doc_count)
            scores = weight - weight / (np.float32(1) + freqs * norm_inv[self._norms[slots]])
            hit_slots.append(slots)
            hit_scores.append(scores)
        if not hit_slots:
            return []
        all_slots = np.concatenate(hit_slots)
        summed = np.bincount(
            all_slots, weights=np.concatenate(hit_scores).astype(np.float64), minlength=self._size
        )
        matched = np.zeros(self._size, dtype=np.bool_)
        matched[all_slots] = True
        cand = np.flatnonzero(matched)
        return top_k(cand, summed[cand].astype(np.float32), k, descending=True)

    def compact(self, remap: npt.NDArray[np.int64], new_size: int) -> None:
        """Renumber slots: ``remap[old]`` is the new slot, or -1 to drop it. Order-preserving
        remaps keep Lucene's doc-id tie-break stable."""
        remap = remap[: self._size]
        for tid in range(len(self._slots)):
            old = np.array(self._slots[tid], dtype=np.int64)
            new = remap[old]
            keep = new >= 0
            self._slots[tid] = array("i", new[keep].astype(np.int32).tobytes())
            self._freqs[tid] = array(
                "i", np.array(self._freqs[tid], dtype=np.int32)[keep].tobytes()
            )
        kept = remap >= 0
        targets = remap[kept]
        for name in ("_norms", "_lengths", "_live"):
            old_arr = getattr(self, name)
            fresh = np.zeros(max(new_size, 1024), dtype=old_arr.dtype)
            fresh[targets] = old_arr[: self._size][kept]
            setattr(self, name, fresh)
        self._size = new_size


def top_k(
    slots: npt.NDArray[np.int64],
    values: npt.NDArray[np.float32],
    k: int,
    *,
    descending: bool,
) -> list[tuple[int, float]]:
    """The ``k`` best ``(slot, value)`` pairs, ties broken by lower slot, like Lucene's
    TopDocs ordering. Partitions first so only the survivors are sorted."""
    if len(slots) == 0 or k <= 0:
        return []
    keys = -values if descending else values
    if len(slots) > k:
        kth = np.partition(keys, k - 1)[k - 1]
        sel = keys <= kth
        slots, values, keys = slots[sel], values[sel], keys[sel]
    order = np.lexsort((slots, keys))[:k]
    return [(int(slots[i]), float(values[i])) for i in order]
