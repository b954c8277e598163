"""Metrics on hand-computed cases."""

from __future__ import annotations

import math

import pytest

from service.eval.metrics import evaluate, mrr, ndcg_at_k, percentile, recall_at_k


def test_recall_at_k() -> None:
    ranked = ["a", "x", "b", "y", "c"]
    assert recall_at_k(ranked, {"a", "b", "c", "d"}, 1) == 0.25
    assert recall_at_k(ranked, {"a", "b", "c", "d"}, 3) == 0.5
    assert recall_at_k(ranked, {"a", "b", "c", "d"}, 100) == 0.75
    assert recall_at_k(ranked, {"z"}, 10) == 0.0
    assert recall_at_k(ranked, set(), 10) == 0.0


def test_recall_ignores_repeated_ids() -> None:
    # Two chunks of the same source: the second occurrence does not push "b" out of the top 2.
    assert recall_at_k(["a", "a", "b"], {"b"}, 2) == 1.0


def test_mrr() -> None:
    assert mrr(["x", "y", "a"], {"a"}) == pytest.approx(1 / 3)
    assert mrr(["a", "b"], {"b", "a"}) == 1.0
    assert mrr(["x"] * 0 + [f"n{i}" for i in range(150)] + ["a"], {"a"}) == 0.0  # rank 151 > 100
    assert mrr([f"n{i}" for i in range(150)] + ["a"], {"a"}, k=None) == pytest.approx(1 / 151)
    assert mrr([], {"a"}) == 0.0


def test_ndcg_single_relevant() -> None:
    # One relevant at rank 3: DCG = 1/log2(4) = 0.5, IDCG = 1.
    assert ndcg_at_k(["x", "y", "a"], {"a"}) == pytest.approx(0.5)
    assert ndcg_at_k(["a"], {"a"}) == 1.0
    # Rank 11 is outside the cut.
    assert ndcg_at_k([f"n{i}" for i in range(10)] + ["a"], {"a"}) == 0.0


def test_ndcg_two_relevant() -> None:
    # Relevant at ranks 1 and 3 of two: DCG = 1 + 0.5, IDCG = 1 + 1/log2(3).
    expected = 1.5 / (1 + 1 / math.log2(3))
    assert ndcg_at_k(["a", "x", "b"], {"a", "b"}) == pytest.approx(expected)
    assert expected == pytest.approx(0.9197, abs=1e-4)
    # More relevant than k: the ideal is capped at k.
    rel = {f"r{i}" for i in range(12)}
    assert ndcg_at_k(sorted(rel)[:2], rel, k=2) == 1.0


def test_evaluate_means_and_missing_queries() -> None:
    run = {"q1": ["a", "x"], "q2": ["x", "b"]}
    qrels = {"q1": {"a"}, "q2": {"b"}, "q3": {"c"}}  # q3 was never answered: zeros
    m = evaluate(run, qrels)
    assert m["mrr@100"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert m["recall@10"] == pytest.approx(2 / 3)
    assert m["ndcg@10"] == pytest.approx((1 + 1 / math.log2(3)) / 3)


def test_percentile_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == 50.0
    assert percentile(xs, 95) == 95.0
    assert percentile([3.0], 95) == 3.0
    assert percentile([], 50) == 0.0
