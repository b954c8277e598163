"""Cached passage states: the split reranker cut at its split point (``lower.onnx`` +
``joint.onnx``) scores exactly like the one graph, stored (int8) states score like
recomputed ones up to the codec's error, and pairs without states fall back.

On tiny random fp32 weights (fast), and on the shipped int8 reranker as ``make models``
builds it (slow): there the cut graphs must give the one graph's logits to within float noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.models.manifest import MANIFEST, MODEL_FILE, TOKENIZER_FILE
from service.models.onnx_cross_encoder import OnnxCrossEncoder
from service.models.passage_states import StatesCodec, decode_states, encode_states, save_projection
from service.offline.builder.reranker import write_joint
from service.offline.builder.tiny_cross_encoder import build_tiny_split_cross_encoder
from tests.support.rerank_pairs import SPLIT_PAIRS as PAIRS


@pytest.fixture(scope="module")
def tiny_split(tmp_path_factory: pytest.TempPathFactory, e5_fp32_dir: Path) -> OnnxCrossEncoder:
    out = tmp_path_factory.mktemp("split-states")
    return OnnxCrossEncoder(build_tiny_split_cross_encoder(out, e5_fp32_dir / TOKENIZER_FILE, lower=1, upper=1,
                                                           cross_bias=0.0))


def test_codec_round_trip_and_size() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((80, 384)).astype(np.float32)
    blob = encode_states(x)
    assert len(blob) == 5 + 80 * 2 + 80 * 384  # header + fp16 scale per token + int8
    y = decode_states(blob)
    assert y.shape == x.shape
    # Per-token absmax int8: error at most half a step (plus the fp16 scale's rounding).
    step = np.abs(x).max(axis=1, keepdims=True) / 127
    assert (np.abs(y - x) <= 0.51 * step + 1e-3).all()


def test_codec_refuses_what_it_did_not_write() -> None:
    blob = encode_states(np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match="bytes"):
        decode_states(blob[:-1])
    with pytest.raises(ValueError, match="format"):
        decode_states(b"\x09" + blob[1:])
    with pytest.raises(ValueError, match="header"):
        decode_states(b"\x01")


def test_projected_codec(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    hidden, dims = 32, 8
    basis, _ = np.linalg.qr(rng.standard_normal((hidden, hidden)))
    components = basis[:, :dims].T.astype(np.float32)  # orthonormal rows
    mean = rng.standard_normal(hidden).astype(np.float32)
    save_projection(tmp_path / "p.npz", mean, components)
    codec = StatesCodec.load(tmp_path / "p.npz")
    # States inside the projected subspace come back (up to int8), outside it are dropped.
    inside = (mean + rng.standard_normal((5, dims)).astype(np.float32) @ components).astype(np.float32)
    blob = codec.encode(inside)
    assert len(blob) == 5 + 5 * 2 + 5 * dims and codec.fmt == 2
    np.testing.assert_allclose(codec.decode(blob), inside, atol=0.05)
    with pytest.raises(ValueError, match="format"):  # a full-width blob is not this model's
        codec.decode(StatesCodec().encode(inside))
    with pytest.raises(ValueError, match="format"):
        StatesCodec().decode(blob)
    save_projection(tmp_path / "bad.npz", mean[:4], components)
    with pytest.raises(ValueError, match="do not fit"):
        StatesCodec.load(tmp_path / "bad.npz")


def test_cut_graphs_equal_the_one_graph(tiny_split: OnnxCrossEncoder) -> None:
    whole = tiny_split.infer(tiny_split.tokenize(PAIRS))
    enc = tiny_split.tokenize_with_states(PAIRS, tiny_split.passage_states([p for _, p in PAIRS]))
    # Exact float states instead of the stored int8 ones: the cut itself changes nothing.
    exact = tiny_split._lower_states(tiny_split._passage_rows([p for _, p in PAIRS]))
    enc.extra["stored"] = dict(enumerate(exact))
    np.testing.assert_allclose(tiny_split.infer(enc), whole, atol=1e-5)


def test_stored_states_score_like_recomputed_ones(tiny_split: OnnxCrossEncoder) -> None:
    whole = tiny_split.infer(tiny_split.tokenize(PAIRS))
    states = tiny_split.passage_states([p for _, p in PAIRS])
    stored = tiny_split.infer(tiny_split.tokenize_with_states(PAIRS, states))
    assert np.abs(stored - whole).max() < 0.05 * (np.abs(whole).max() + 1)
    assert list(np.argsort(-stored)) == list(np.argsort(-whole))


def test_missing_states_fall_back_to_computing_them(tiny_split: OnnxCrossEncoder) -> None:
    whole = tiny_split.infer(tiny_split.tokenize(PAIRS))
    states = tiny_split.passage_states([p for _, p in PAIRS])
    half = [s if i % 2 else None for i, s in enumerate(states)]
    enc = tiny_split.tokenize_with_states(PAIRS, half)
    assert enc.extra["missing"] == [0, 2]
    mixed = tiny_split.infer(enc)
    # Recomputed rows go through the same codec as stored ones (a head ranks them alike).
    np.testing.assert_allclose(mixed, tiny_split.infer(tiny_split.tokenize_with_states(PAIRS, states)), atol=1e-4)
    # A blob this model cannot read (another format, truncated) is computed, not fatal.
    broken = [states[0][:-3], b"\x09" + states[1][1:], *states[2:]]
    enc = tiny_split.tokenize_with_states(PAIRS, broken)
    assert enc.extra["missing"] == [0, 1]
    np.testing.assert_allclose(tiny_split.infer(enc)[:2], mixed[:2], atol=1e-4)
    # No states at all: still the two graphs (every passage's states computed), scoring like
    # the one graph and exactly like a head whose states were all stored.
    none = tiny_split.tokenize_with_states(PAIRS, [None] * len(PAIRS))
    assert none.extra["missing"] == list(range(len(PAIRS)))
    computed = tiny_split.infer(none)
    np.testing.assert_allclose(computed, tiny_split.infer(tiny_split.tokenize_with_states(PAIRS, states)), atol=1e-4)
    assert list(np.argsort(-computed)) == list(np.argsort(-whole))


def test_the_one_graph_loads_only_when_called(tmp_path: Path, e5_fp32_dir: Path) -> None:
    """With the two graphs every rerank takes them, so a server never holds ``model.onnx``
    (~127 MB resident for the shipped reranker); a direct one-graph call still works."""
    ce = OnnxCrossEncoder(build_tiny_split_cross_encoder(tmp_path / "m", e5_fp32_dir / TOKENIZER_FILE))
    ce.infer(ce.tokenize_with_states(PAIRS, [None] * len(PAIRS)))
    assert ce._session is None
    assert ce.infer(ce.tokenize(PAIRS)).shape == (len(PAIRS),)
    assert ce._session is not None


def test_parallel_groups_change_nothing_but_threads(tmp_path: Path, e5_fp32_dir: Path) -> None:
    """``parallel`` runs a rerank's length groups on several threads; the groups, and so the
    logits, are those of the sequential run."""
    model_dir = build_tiny_split_cross_encoder(tmp_path / "m", e5_fp32_dir / TOKENIZER_FILE)
    sequential, fanned = OnnxCrossEncoder(model_dir), OnnxCrossEncoder(model_dir, parallel=3)
    pairs = [(q, p * (1 + i % 4)) for i, (q, p) in enumerate(PAIRS * 4)]  # several groups
    states = sequential.passage_states([p for _, p in pairs])
    assert fanned.passage_states([p for _, p in pairs]) == states
    for given in (states, [None] * len(pairs)):
        np.testing.assert_array_equal(fanned.infer(fanned.tokenize_with_states(pairs, given)),
                                      sequential.infer(sequential.tokenize_with_states(pairs, given)))


def test_states_key_names_the_lower_graph(tmp_path: Path, e5_fp32_dir: Path) -> None:
    with_states = OnnxCrossEncoder(build_tiny_split_cross_encoder(tmp_path / "a", e5_fp32_dir / TOKENIZER_FILE))
    other_seed = OnnxCrossEncoder(build_tiny_split_cross_encoder(tmp_path / "b", e5_fp32_dir / TOKENIZER_FILE, seed=1))
    without = OnnxCrossEncoder(build_tiny_split_cross_encoder(tmp_path / "c", e5_fp32_dir / TOKENIZER_FILE,
                                                              with_states=False))
    assert with_states.states_key and other_seed.states_key
    assert with_states.states_key != other_seed.states_key  # other weights: old states are stale
    assert without.states_key is None
    with pytest.raises(NotImplementedError):
        without.passage_states(["x"])


def test_a_lower_passage_cap_keys_its_states_apart(tmp_path: Path, e5_fp32_dir: Path) -> None:
    """``rerank_passage_tokens`` (or ``rerank_max_length``) below the trained passage cap cuts
    passages shorter before the lower layers: other states, so never read as (or instead
    of) the trained cap's; a cap at or above the trained one is the trained one."""
    model_dir = build_tiny_split_cross_encoder(tmp_path / "m", e5_fp32_dir / TOKENIZER_FILE)
    trained = OnnxCrossEncoder(model_dir)
    assert trained.states_key and ":cap-" not in trained.states_key
    for same in (OnnxCrossEncoder(model_dir, max_length=4096), OnnxCrossEncoder(model_dir, passage_tokens=4096)):
        assert same.states_key == trained.states_key
    long = " ".join(["insurance policy premium"] * 40)
    [full] = trained.passage_states([long])
    for capped in (OnnxCrossEncoder(model_dir, passage_tokens=24), OnnxCrossEncoder(model_dir, max_length=24)):
        assert capped.states_key == f"{trained.states_key}:cap-24"
        [short] = capped.passage_states([long])
        assert len(short) < len(full)
    with pytest.raises(ValueError, match="no room"):
        OnnxCrossEncoder(model_dir, passage_tokens=3)
    with pytest.raises(ValueError, match="rerank_passage_tokens must be 0"):
        OnnxCrossEncoder(model_dir, passage_tokens=-1)


@pytest.mark.slow
def test_shipped_reranker_cut_matches_the_one_graph(models_dir: Path, tmp_path: Path) -> None:
    model_dir = models_dir / "e5-small-split-reranker-int8"
    manifest = json.loads((model_dir / MANIFEST).read_text())
    card = json.loads((model_dir / "card.json").read_text())
    # Built deterministically from the artifact: the hashes the card records.
    assert manifest["states"]["lower_onnx_sha256"] == card["builds"]["int8"]["lower_onnx_sha256"]
    assert manifest["states"]["joint_onnx_sha256"] == card["builds"]["int8"]["joint_onnx_sha256"]
    assert (model_dir / MODEL_FILE).is_file()
    ce = OnnxCrossEncoder(model_dir, scoring="joint")  # the towers: test_towers.py
    # A rerank: one query, its candidates. Cut graphs on exact states = the one graph, up
    # to float noise, pair by pair (so that both see the same batch: the dynamic int8
    # activation scales are taken over a whole call), where the joint layers carry the one
    # graph's 8-bit weights (built here from the artifact); the shipped 7-bit ones
    # (``joint_weight_bits``) move a logit by their rounding only.
    assert card["builds"]["int8"]["joint_weight_bits"] == 7
    eight_bit = tmp_path / "eight-bit-joint"
    eight_bit.mkdir()
    for f in model_dir.iterdir():
        (eight_bit / f.name).symlink_to(f)
    (eight_bit / "joint.onnx").unlink()
    write_joint(eight_bit / "joint.onnx", 8)
    cut = OnnxCrossEncoder(eight_bit, scoring="joint")
    one_query = [("what is term life insurance", p) for _, p in PAIRS]
    passages = [p for _, p in one_query]
    for pair in one_query:
        one_graph = ce.infer(ce.tokenize([pair]))
        for encoder, tolerance in ((cut, 1e-3), (ce, 0.2)):
            enc = encoder.tokenize_with_states([pair], [None])
            enc.extra["stored"], enc.extra["missing"] = {0: encoder._lower_states(encoder._passage_rows([pair[1]]))[0]}, []
            np.testing.assert_allclose(encoder.infer(enc), one_graph, atol=tolerance)
    # A whole head in length groups moves logits as much as the one graph's batch company
    # already does, and the int8 codec adds little to that. Measured with
    # tests/bench/rerank_drift.py on 553 valid pairs per language (README "Cached passage
    # states"), the shipped (continued) reranker, int8 states: mean |d| 0.18 / 0.19, max
    # 1.07 / 0.86 (en / zh); the reranker before it 0.14 / 0.11, max 0.62 / 0.50.
    whole = ce.infer(ce.tokenize(one_query))
    stored = ce.infer(ce.tokenize_with_states(one_query, ce.passage_states(passages)))
    assert np.abs(stored - whole).max() < 1.2
    # Compact (96-dim PCA) states: about a quarter of the bytes; logits move more (same
    # measurement: mean |d| 0.36 / 0.34, max 1.35 / 1.66; the reranker before it max 1.40 /
    # 1.78; this test's long repetitive passage moves 1.92), so they are opt-in and keyed apart.
    compact = OnnxCrossEncoder(model_dir, compact_states=True, scoring="joint")
    assert compact.states_key and compact.states_key != ce.states_key
    small, full = compact.passage_states(passages), ce.passage_states(passages)
    assert all(3.9 * len(a) < len(b) for a, b in zip(small, full))  # 98 vs 386 bytes a token
    assert np.abs(compact.infer(compact.tokenize_with_states(one_query, small)) - whole).max() < 2.5
    # Several queries in one batch: each distinct query's lower layers run once (not once
    # per pair); each pair still scores as it does alone.
    mixed = ce.infer(ce.tokenize_with_states(PAIRS, ce.passage_states([p for _, p in PAIRS])))
    alone = np.array([ce.infer(ce.tokenize_with_states([pair], ce.passage_states([pair[1]])))[0] for pair in PAIRS])
    assert np.abs(mixed - alone).max() < 0.8


def test_the_one_graph_unshares_only_its_matmul_weights(models_dir: Path) -> None:
    """The exact int8 kernels' weight rewrite refuses an int8 weight two matmuls share (the
    one graph's query and passage paths run the same lower layers): loading gives each
    ``MatMulInteger`` its own copy, and only those; the 96 MB word embedding stays one."""
    from collections import Counter

    import onnx
    import onnxruntime as ort

    from service.models._ort import _unshared_int8_weights, session_options

    path = models_dir / "e5-small-split-reranker-int8" / MODEL_FILE

    def int8_uses(model: onnx.ModelProto) -> tuple[Counter[tuple[str, str]], set[str]]:
        int8 = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8}
        return Counter((n.op_type, x) for n in model.graph.node for x in n.input if x in int8), int8

    before, int8_before = int8_uses(onnx.load(str(path), load_external_data=False))
    data = _unshared_int8_weights(path)
    after, int8_after = int8_uses(onnx.load_from_string(data))
    assert any(n > 1 for (op, _), n in before.items() if op == "MatMulInteger")  # the file shares them
    assert all(n == 1 for (op, _), n in after.items() if op == "MatMulInteger")
    gathers = {k: n for k, n in after.items() if k[0] == "Gather"}
    assert gathers == {k: n for k, n in before.items() if k[0] == "Gather"} and max(gathers.values()) == 2
    assert len(int8_after) > len(int8_before)
    opts = session_options(1, exact_int8=True)
    ort.InferenceSession(data, sess_options=opts, providers=["CPUExecutionProvider"])


def test_states_off_means_no_states_key_and_no_states_batcher(tiny_split: OnnxCrossEncoder) -> None:
    """``rerank_states = false``: ingest computes none and the rerank stage reads none."""
    from service.models.dummy import HashEmbedder
    from service.models.runtime import ModelRuntime

    assert tiny_split.states_key is not None
    off = ModelRuntime(HashEmbedder(), tiny_split, workers=1, passage_states=False)
    on = ModelRuntime(HashEmbedder(), tiny_split, workers=1)
    assert off.states_key is None and off._states is None
    assert on.states_key == tiny_split.states_key and on._states is not None


def test_passage_states_depend_on_the_passage_alone(models_dir: Path) -> None:
    """The int8 lower graph takes activation scales over a whole call, so states computed
    with company would differ from states computed alone. Each passage is its own call:
    at ingest (one document's chunks), inside a rerank (its head, written back) and alone,
    a passage's states are the same bytes, so a rerank over written-back states does not
    depend on which queries ran before it."""
    ce = OnnxCrossEncoder(models_dir / "e5-small-split-reranker-int8", parallel=2)
    passages = [p for _, p in PAIRS]
    alone = [ce.passage_states([p])[0] for p in passages]
    assert ce.passage_states(passages) == alone
    assert ce.passage_states(list(reversed(passages))) == list(reversed(alone))
    enc = ce.tokenize_with_states([("what is term life insurance", p) for p in passages], [None] * len(passages))
    ce.infer(enc)
    assert enc.extra["computed_states"] == dict(enumerate(alone))
