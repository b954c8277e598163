"""How the rerank stage orders its head (service/pipeline/head_order.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from service.engines.base import ChunkRecord
from service.pipeline.fusion import Candidate, interpolate
from service.pipeline.head_order import (
    ORDER_FILE,
    HeadOrder,
    HeadOrderError,
    head_signals,
    normalised,
    order_sha256,
    read_order,
)


def test_normalised_counts_a_missing_value_as_the_lowest() -> None:
    assert normalised([2.0, None, 4.0, 3.0]) == [0.0, 0.0, 1.0, 0.5]
    assert normalised([None, None]) == [0.0, 0.0]
    assert normalised([5.0, 5.0, None]) == [0.0, 0.0, 0.0]
    assert normalised([]) == []


def test_an_alpha_orders_exactly_like_the_interpolation() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 20)
        rerank = [rng.uniform(-5, 20) for _ in range(n)]
        fused = sorted((rng.uniform(0, 0.05) for _ in range(n)), reverse=True)
        alpha = rng.choice([0.0, 0.3, 0.5, 0.7, 1.0])
        mixed = interpolate(rerank, fused, alpha)
        expected = sorted(range(n), key=lambda i: -mixed[i])
        signals = {"rerank": list(rerank), "fused": list(fused), "bm25": [None] * n, "dense": [None] * n}
        assert HeadOrder.from_alpha(alpha).order(signals, cjk=rng.random() < 0.5) == expected


def test_each_script_has_its_own_weights() -> None:
    order = HeadOrder.from_weights({"latin": {"rerank": 1.0}, "cjk": {"rerank": 0.1, "bm25": 1.0}})
    signals = {"rerank": [1.0, 2.0, 3.0], "fused": [0.3, 0.2, 0.1], "bm25": [9.0, None, 1.0], "dense": [0.8, 0.9, 0.7]}
    assert order.order(signals, cjk=False) == [2, 1, 0]  # the reranker alone
    assert order.order(signals, cjk=True) == [0, 2, 1]  # BM25 dominates; its miss counts as lowest


def test_ties_keep_the_first_stage_order() -> None:
    signals = {"rerank": [1.0, 1.0, 1.0], "fused": [0.0, 0.0, 0.0], "bm25": [None] * 3, "dense": [None] * 3}
    assert HeadOrder.from_alpha(0.7).order(signals, cjk=False) == [0, 1, 2]


@pytest.mark.parametrize("weights, message", [
    ({"latin": {"rerank": 1.0}}, "no weights for 'cjk'"),
    ({"latin": {"rerank": 1.0}, "cjk": {"rerank": 1.0, "title": 1.0}}, "unknown feature 'title'"),
    ({"latin": {"rerank": 1.0}, "cjk": {"rerank": float("nan")}}, "not a finite number"),
    ({"latin": {"rerank": 1.0}, "cjk": {"fused": 1.0}}, "no positive weight"),
    ({"latin": {"rerank": 1.0}, "cjk": {"rerank": 1.0}, "greek": {"rerank": 1.0}}, "unknown script"),
])
def test_bad_weights_are_refused(weights: dict[str, dict[str, float]], message: str) -> None:
    with pytest.raises(HeadOrderError, match=message):
        HeadOrder.from_weights(weights)


def test_a_shipped_order_round_trips_and_is_named_by_its_hash(tmp_path: Path) -> None:
    assert read_order(tmp_path) is None and order_sha256(tmp_path) is None
    order = HeadOrder.from_weights({"latin": {"rerank": 1.1, "fused": 0.3, "bm25": 0.15, "dense": -0.1},
                                    "cjk": {"rerank": 0.8, "fused": 0.2}})
    (tmp_path / ORDER_FILE).write_text(order.to_json(fitted_on={"note": "test"}))
    loaded = read_order(tmp_path)
    assert loaded is not None and loaded.weights == order.weights
    assert loaded.sha256 == order_sha256(tmp_path) and loaded.sha256 is not None
    assert loaded.sha256[:12] in loaded.source and loaded.meta["fitted_on"] == {"note": "test"}
    (tmp_path / ORDER_FILE).write_text(json.dumps({"version": 99, "weights": {}}))
    with pytest.raises(HeadOrderError, match="version-1"):
        read_order(tmp_path)
    (tmp_path / ORDER_FILE).write_text("{not json")
    with pytest.raises(HeadOrderError, match="not JSON"):
        read_order(tmp_path)


def _chunk(cid: str) -> ChunkRecord:
    return ChunkRecord(chunk_id=cid, source_id=cid, version="1", chunk_index=0, collection="doc", status="approved",
                       title="", breadcrumb="", text="", parent_text="", search_text="")


def test_head_signals_are_what_the_eval_dumps_record() -> None:
    a = Candidate(_chunk("a"), fused_score=0.03, bm25_score=7.5, distance=0.6, rerank_score=4.0)
    b = Candidate(_chunk("b"), fused_score=0.02, distance=None, bm25_score=None, rerank_score=-1.0)
    s = head_signals([a, b])
    assert s["rerank"] == [4.0, -1.0] and s["fused"] == [0.03, 0.02] and s["bm25"] == [7.5, None]
    assert s["dense"][0] == pytest.approx(1 - 0.36 / 2) and s["dense"][1] is None
    assert s["latin_dense"] == [None, None]  # no Latin-script leg ran
    b.latin_distance = 0.4
    assert head_signals([a, b])["latin_dense"] == [None, pytest.approx(1 - 0.16 / 2)]
