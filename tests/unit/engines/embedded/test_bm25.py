"""Lucene BM25 by hand: idf, length normalisation, the lossy norm byte, duplicates, ties."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.engines.embedded.bm25 import Bm25Index, byte4_to_int, int_to_byte4


def _index(*docs: list[str]) -> Bm25Index:
    index = Bm25Index()
    for slot, terms in enumerate(docs):
        index.add(slot, terms)
    return index


def _lucene(tf: float, dl: float, avgdl: float, df: int, n: int, boost: float = 1.0) -> float:
    """The textbook form of Lucene >= 8 BM25 (no (k1 + 1) factor)."""
    idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
    return boost * idf * tf / (tf + 1.2 * (1 - 0.75 + 0.75 * dl / avgdl))


@pytest.mark.parametrize(
    ("length", "byte", "decoded"),
    [(0, 0, 0), (1, 1, 1), (23, 23, 23), (24, 24, 24), (25, 25, 25), (40, 40, 40),
     (41, 40, 40), (100, 57, 96), (101, 57, 96), (1000, 87, 984), (2**31 - 1, 255, 2013265944)],
)  # fmt: skip
def test_norm_encoding_is_lucene_smallfloat(length: int, byte: int, decoded: int) -> None:
    assert int_to_byte4(length) == byte
    assert byte4_to_int(byte) == decoded


def test_norm_encoding_round_trips_every_byte() -> None:
    for b in range(256):
        assert int_to_byte4(byte4_to_int(b)) == b


def test_scores_on_a_tiny_corpus() -> None:
    # lengths 2, 3, 4 -> avgdl 3; "apple" in 2 of 3 docs -> idf ln(1.6)
    index = _index(
        ["apple", "banana"], ["apple", "apple", "cherry"], ["banana", "cherry", "date", "fig"]
    )
    hits = index.search(["apple"], 10)
    assert [slot for slot, _ in hits] == [1, 0]
    assert hits[0][1] == pytest.approx(math.log(1.6) * 2 / (2 + 1.2), rel=1e-6)  # 0.29375
    assert hits[1][1] == pytest.approx(math.log(1.6) * 1 / (1 + 1.2 * 0.75), rel=1e-6)  # 0.24737
    assert hits[0][1] == pytest.approx(_lucene(2, 3, 3, 2, 3), rel=1e-6)


def test_multi_term_query_sums_clause_scores() -> None:
    index = _index(
        ["apple", "banana"], ["apple", "apple", "cherry"], ["banana", "cherry", "date", "fig"]
    )
    (slot, score), *_ = index.search(["banana", "date"], 10)
    assert slot == 2
    assert score == pytest.approx(_lucene(1, 4, 3, 2, 3) + _lucene(1, 4, 3, 1, 3), rel=1e-6)


def test_lengths_above_23_are_scored_through_the_lossy_norm() -> None:
    long_doc = ["apple"] + ["filler"] * 99  # 100 tokens, stored as 96
    index = _index(long_doc, ["pear"] * 10)
    avgdl = (100 + 10) / 2
    ((_, score),) = index.search(["apple"], 10)
    assert score == pytest.approx(_lucene(1, 96, avgdl, 1, 2), rel=1e-6)
    assert score != pytest.approx(_lucene(1, 100, avgdl, 1, 2), rel=1e-6)


def test_lengths_sharing_a_norm_byte_tie_and_rank_by_insertion() -> None:
    index = _index(["x"] * 3 + ["pad"] * 98, ["x"] * 3 + ["pad"] * 97, ["y"])  # 101 and 100 tokens
    hits = index.search(["x"], 10)
    assert [slot for slot, _ in hits] == [0, 1]
    assert hits[0][1] == hits[1][1]


def test_identical_docs_tie_and_lower_slot_ranks_first() -> None:
    index = _index(["a"], ["b"], ["a"], ["a"])
    assert [slot for slot, _ in index.search(["a"], 2)] == [0, 2]
    assert [slot for slot, _ in index.search(["a"], 10)] == [0, 2, 3]


def test_repeated_query_term_counts_per_occurrence() -> None:
    index = _index(["a", "b"], ["b", "c"], ["c"])
    ((_, once),) = index.search(["a"], 10)
    ((_, twice),) = index.search(["a", "a"], 10)
    assert twice == 2 * once  # BooleanQuery folds duplicates into boost 2: exact in float32
    assert dict(index.search(["b", "b", "c"], 10))[1] == pytest.approx(
        2 * _lucene(1, 2, 5 / 3, 2, 3) + _lucene(1, 2, 5 / 3, 2, 3), rel=1e-6
    )


def test_filters_apply_before_ranking_but_not_to_statistics() -> None:
    index = _index(["a", "a"], ["a"], ["a", "z"], ["z"])
    unfiltered = dict(index.search(["a"], 10))
    allowed = np.array([False, False, True, True])
    assert index.search(["a"], 1, allowed) == [(2, unfiltered[2])]  # k filled from allowed docs


def test_deletes_update_statistics() -> None:
    index = _index(["a"], ["a", "b"], ["b"])
    index.delete(0)
    assert (index.doc_count, index.sum_total_term_freq) == (2, 3)
    ((slot, score),) = index.search(["a"], 10)
    assert slot == 1
    assert score == pytest.approx(_lucene(1, 2, 1.5, 1, 2), rel=1e-6)


def test_docs_without_terms_do_not_count() -> None:
    index = _index([], ["a"], [])
    assert index.doc_count == 1
    ((_, score),) = index.search(["a"], 10)
    assert score == pytest.approx(_lucene(1, 1, 1, 1, 1), rel=1e-6)


def test_compact_keeps_order_and_scores() -> None:
    index = _index(["a"], ["a", "b"], ["a"], ["c"])
    index.delete(0)
    before = index.search(["a"], 10)
    remap = np.array([-1, 0, 1, 2], dtype=np.int64)
    index.compact(remap, 3)
    assert index.search(["a"], 10) == [(remap[s], score) for s, score in before]
    index.add(3, ["a"])
    assert [slot for slot, _ in index.search(["a"], 10)] == [1, 3, 0]  # 1 and 3 tie
