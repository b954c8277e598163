"""Two-tower scoring of the split reranker (service/models/towers.py, README "Two towers"):
the tower graph is the joint graph with its cross attention shut, a passage's stored form is
one small vector that scores exactly like a computed one, the artifact's ``scoring`` picks the
mode, and a gate only admits the mode it measured."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from service.app import DEFAULT_RERANKER, GATE_FILE, gate_failure, resolve_reranker
from service.config import Config
from service.models.manifest import MANIFEST, TOKENIZER_FILE, read_manifest
from service.models.onnx_cross_encoder import OnnxCrossEncoder
from service.models.passage_states import VECTOR_FORMAT, encode_states
from service.models.towers import SCORING_JOINT, SCORING_TOWERS, served_scoring, tower_logits
from service.offline.builder.tiny_cross_encoder import build_tiny_split_cross_encoder
from tests.support.rerank_pairs import SPLIT_PAIRS as PAIRS

HIDDEN = 64  # the tiny model's


def _tiny(root: Path, tokenizer: Path, name: str, **kw: object) -> Path:
    return build_tiny_split_cross_encoder(root / name, tokenizer, lower=1, upper=2, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("cross_bias, same", [(-1e4, True), (0.0, False)])
def test_the_towers_are_the_joint_graph_with_its_cross_attention_shut(
        tmp_path: Path, e5_fp32_dir: Path, cross_bias: float, same: bool) -> None:
    """fp32 graphs: with the cross-attention bias at -1e4 (shut) the towers' exact vectors give
    the joint graph's logits; with it open (0) they do not (the test can fail). Served, a
    passage's vector goes through the int8 codec (stored or computed alike), which moves a
    logit by its rounding only."""
    model_dir = _tiny(tmp_path, e5_fp32_dir / TOKENIZER_FILE, "m", cross_bias=cross_bias)
    joint, towers = OnnxCrossEncoder(model_dir, scoring="joint"), OnnxCrossEncoder(model_dir, scoring="towers")
    assert (joint.scoring, towers.scoring) == (SCORING_JOINT, SCORING_TOWERS)
    enc = joint.tokenize_with_states(PAIRS, [None] * len(PAIRS))
    enc.extra["stored"], enc.extra["missing"] = dict(enumerate(joint.lower_states(enc.extra["missing_rows"]))), []
    by_joint = joint.infer(enc)  # exact float states, as the towers below get
    np.testing.assert_allclose(by_joint, joint.infer(joint.tokenize(PAIRS)), atol=1e-4)  # the cut is the one graph
    rows = towers.tokenize_with_states(PAIRS, [None] * len(PAIRS)).extra
    queries = np.concatenate(towers._tower_vectors(towers.lower_states(rows["query_rows"])))[rows["query_of"]]
    passages = np.concatenate(towers._tower_vectors(towers.lower_states(rows["missing_rows"])))
    exact = tower_logits(queries, passages, towers._head_w, towers._head_b)
    assert np.allclose(exact, by_joint, atol=1e-4) == same, (exact, by_joint)
    served = towers.infer(towers.tokenize_with_states(PAIRS, [None] * len(PAIRS)))
    np.testing.assert_allclose(served, exact, atol=0.01 * np.abs(exact).max())


def test_a_passage_is_stored_as_one_small_vector(tmp_path: Path, e5_fp32_dir: Path) -> None:
    model_dir = _tiny(tmp_path, e5_fp32_dir / TOKENIZER_FILE, "m", scoring="towers")
    towers, joint = OnnxCrossEncoder(model_dir), OnnxCrossEncoder(model_dir, scoring="joint")
    assert towers.scoring == SCORING_TOWERS  # the manifest's choice under "auto"
    assert towers.states_key and ":tower-" in towers.states_key and f":f{VECTOR_FORMAT}:" in towers.states_key
    assert joint.states_key and towers.states_key != joint.states_key  # never read across modes
    passages = [p for _, p in PAIRS]
    blobs = towers.passage_states(passages)
    assert all(len(b) == 5 + 2 + HIDDEN for b in blobs)  # header + fp16 scale + int8 row, whatever the length
    # Stored vectors score exactly like computed ones (computed ones go through the codec too),
    # and a rerank hands back what it computed for a write-back: the same bytes.
    stored = towers.infer(towers.tokenize_with_states(PAIRS, blobs))
    enc = towers.tokenize_with_states(PAIRS, [None, blobs[1], None, blobs[3]])
    np.testing.assert_array_equal(towers.infer(enc), stored)
    assert enc.extra["computed_states"] == {0: blobs[0], 2: blobs[2]}
    # What the embedding pass gives (the lower states) becomes the same vector.
    lower = towers.lower_states(towers.passage_rows(passages))
    assert [towers.encode_states(x) for x in lower] == blobs
    # A blob this mode cannot read (a joint-mode states blob, a vector blob of two rows) is
    # computed instead, not fatal.
    states_blob = joint.passage_states(passages[:1])[0]
    two_rows = encode_states(np.ones((2, HIDDEN), np.float32), VECTOR_FORMAT)
    enc = towers.tokenize_with_states(PAIRS, [states_blob, two_rows, *blobs[2:]])
    assert enc.extra["missing"] == [0, 1]
    np.testing.assert_array_equal(towers.infer(enc), stored)
    # Several queries: each pair scores as it does alone.
    alone = [towers.infer(towers.tokenize_with_states([pair], [blob]))[0] for pair, blob in zip(PAIRS, blobs)]
    np.testing.assert_allclose(stored, alone, atol=1e-5)


def test_served_scoring(tmp_path: Path, e5_fp32_dir: Path) -> None:
    with_towers = read_manifest(_tiny(tmp_path, e5_fp32_dir / TOKENIZER_FILE, "a", scoring="towers"), "cross-encoder")
    assert served_scoring(with_towers) == SCORING_TOWERS
    assert served_scoring(with_towers, "joint") == SCORING_JOINT
    joint_card = dict(with_towers, scoring="joint")
    assert served_scoring(joint_card) == SCORING_JOINT and served_scoring(joint_card, "towers") == SCORING_TOWERS
    older = {k: v for k, v in with_towers.items() if k != "scoring"}  # a manifest from before the towers
    assert served_scoring(older) == SCORING_JOINT
    no_graph = dict(with_towers, states={k: v for k, v in with_towers["states"].items() if not k.startswith("tower")})
    assert served_scoring(no_graph) == SCORING_JOINT  # the card asks for towers the build lacks
    with pytest.raises(ValueError, match="no tower graph"):
        served_scoring(no_graph, "towers")
    with pytest.raises(ValueError, match="rerank_scoring must be"):
        served_scoring(with_towers, "dot")


@pytest.mark.slow
def test_auto_reranks_only_with_a_gate_measured_in_the_served_mode(tmp_path: Path, e5_fp32_dir: Path) -> None:
    models = tmp_path / "models"
    model_dir = build_tiny_split_cross_encoder(models / DEFAULT_RERANKER, e5_fp32_dir / TOKENIZER_FILE,
                                               scoring="towers")
    sha = read_manifest(model_dir, "cross-encoder")["onnx_sha256"]
    rows = {lang: {"hybrid": 0.3, "hybrid_rerank": 0.4, "full_split": True, "queries": 2000} for lang in ("en", "zh")}

    def gate(**extra: object) -> None:
        (model_dir / GATE_FILE).write_text(json.dumps({"onnx_sha256": sha, "alpha": 0.6, "languages": rows, **extra}))

    cfg = dataclasses.replace(Config(), models_dir=models, reranker_model="auto", rerank_alpha=0.6)
    gate()  # no "scoring": a gate measured on the joint graph
    choice = resolve_reranker(cfg)
    assert choice.backend is None and "scoring with joint" in choice.reason and "towers" in choice.reason
    joint_choice = resolve_reranker(dataclasses.replace(cfg, rerank_scoring="joint"))
    assert joint_choice.backend is not None and joint_choice.backend.scoring == SCORING_JOINT
    gate(scoring="towers")
    choice = resolve_reranker(cfg)
    assert choice.backend is not None and choice.backend.scoring == SCORING_TOWERS
    assert gate_failure(json.loads((model_dir / GATE_FILE).read_text()), sha, None, SCORING_JOINT)
    with pytest.raises(ValueError, match="rerank_scoring must be"):
        resolve_reranker(dataclasses.replace(cfg, rerank_scoring="both"))


@pytest.mark.slow
def test_the_shipped_reranker_serves_towers(models_dir: Path) -> None:
    """The shipped artifact's card says towers; the build writes the tower graph the card
    hashes; its logits stay within the joint graph's own noise of the one graph's (measured
    over 553 valid pairs per language with tests/bench/rerank_drift.py, README "Two towers")."""
    model_dir = models_dir / "e5-small-split-reranker-int8"
    manifest = json.loads((model_dir / MANIFEST).read_text())
    card = json.loads((model_dir / "card.json").read_text())
    assert card["scoring"] == manifest["scoring"] == SCORING_TOWERS
    assert manifest["states"]["tower_onnx_sha256"] == card["builds"]["int8"]["tower_onnx_sha256"]
    towers = OnnxCrossEncoder(model_dir)
    assert towers.scoring == SCORING_TOWERS
    one_query = [("what is term life insurance", p) for _, p in PAIRS]
    blobs = towers.passage_states([p for _, p in one_query])
    assert all(len(b) == 5 + 2 + 384 for b in blobs)
    whole = towers.infer(towers.tokenize(one_query))  # the one graph, cross attention and all
    stored = towers.infer(towers.tokenize_with_states(one_query, blobs))
    assert np.abs(stored - whole).max() < 1.2
