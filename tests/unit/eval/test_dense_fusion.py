"""Offline fusion of several captured leg rankings (the two-dense-leg estimate)."""

from __future__ import annotations

import pytest

from service.eval.dense_fusion import _parse_leg, fuse_runs, rrf_fuse_legs


def test_a_duplicate_counts_once_at_its_best_rank() -> None:
    # bm25 lists b twice (ranks 2 and 4): only 1/(10+2) counts, so c (1/13 + 1/11) stays first.
    fused = rrf_fuse_legs([(["a", "b", "c", "b"], 1.0), (["c"], 1.0)], k=10)
    assert fused == ["c", "a", "b"]


def test_a_third_leg_adds_its_reciprocal_ranks() -> None:
    # b is second in both dense legs and absent from bm25: 2 * 1/(10+2) beats a's 0.4/(10+1) + 1/(10+3).
    fused = rrf_fuse_legs([(["a"], 0.4), (["x", "b", "a"], 1.0), (["y", "b"], 1.0)], k=10)
    assert fused[0] == "b"
    assert set(fused) == {"a", "b", "x", "y"}


def test_fuse_runs_covers_every_query_of_any_leg() -> None:
    run = fuse_runs([({"q1": ["a"]}, 1.0), ({"q2": ["b"]}, 1.0)], k=10)
    assert run == {"q1": ["a"], "q2": ["b"]}


def test_leg_spec_parsing() -> None:
    assert _parse_leg("bge=/tmp/runs/x-knn.json:0.5")[::2] == ("bge", 0.5)
    with pytest.raises(Exception, match="NAME=PATH:WEIGHT"):
        _parse_leg("=x.json:1")


def test_grid_search_finds_the_leg_that_carries_the_answers() -> None:
    from service.eval.dense_fusion import grid_search

    qrels = {"q1": {"a"}, "q2": {"b"}}
    good = {"q1": ["a", "x"], "q2": ["b", "y"]}
    bad = {"q1": ["x", "y", "z", "w", "a"], "q2": ["y", "x", "z", "w", "b"]}
    best = grid_search([("good", good), ("bad", bad)], qrels)
    assert best["ndcg@10"] == 1.0
    assert best["weights"] == {"good": 1.0, "bad": 0.0}
