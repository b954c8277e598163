"""The bge builder: CLS pooling + L2 appended to the jar's graph, a servable tokenizer, and
(when the jar is in the local Maven repository) a real build that matches the jar's graph."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from service.models.onnx_embedder import load_embedder
from service.offline.builder import bge
from service.offline.builder.bge import (
    INSTRUCTION_EN,
    VARIANTS,
    add_cls_pooling,
    build_bge,
    build_shipped,
    jar_path,
    serving_tokenizer,
    shipped_cards,
)
from service.offline.builder.reranker import ArtifactMismatch


def _jar_like_graph(dim: int = 4) -> onnx.ModelProto:
    """A stand-in for the jars' interface: three int64 inputs, ``last_hidden_state`` out;
    hidden = embedding(ids) + 10 * token_type (so a non-zero type id would show)."""
    vocab = 16
    table = np.arange(vocab * dim, dtype=np.float32).reshape(vocab, dim) - 20.0
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["emb"], axis=0),
        helper.make_node("Cast", ["token_type_ids"], ["types_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["types_f", "ten"], ["types_scaled"]),
        helper.make_node("Unsqueeze", ["types_scaled", "last_axis"], ["types_3d"]),
        helper.make_node("Add", ["emb", "types_3d"], ["last_hidden_state"]),
    ]
    ints = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch_size", "sequence_length"])
            for n in ("input_ids", "attention_mask", "token_type_ids")]
    out = helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch_size", "sequence_length", dim])
    graph = helper.make_graph(nodes, "jar_like", ints, [out], initializer=[
        onnx.numpy_helper.from_array(table, "table"),
        helper.make_tensor("ten", TensorProto.FLOAT, [], [10.0]),
        helper.make_tensor("last_axis", TensorProto.INT64, [1], [2]),
    ])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_cls_pooling_is_token_zero_normalised_and_types_are_zero() -> None:
    model = add_cls_pooling(_jar_like_graph())
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in model.graph.output] == ["sentence_embedding"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[3, 7, 9], [12, 1, 0]], dtype=np.int64)
    out = session.run(["sentence_embedding"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    table = np.arange(16 * 4, dtype=np.float32).reshape(16, 4) - 20.0
    cls = table[ids[:, 0]]  # token 0 of each row, type ids all zero (no +10)
    np.testing.assert_allclose(out, cls / np.linalg.norm(cls, axis=1, keepdims=True), rtol=1e-6)
    assert out.shape == (2, 4)


def test_cls_pooling_refuses_an_unexpected_graph() -> None:
    model = _jar_like_graph()
    model.graph.output[0].name = "pooled"
    with pytest.raises(ValueError, match="last_hidden_state"):
        add_cls_pooling(model)


def test_serving_tokenizer_declares_the_pad_token() -> None:
    raw = json.dumps({"model": {"type": "WordPiece", "vocab": {"[PAD]": 0, "[UNK]": 100}},
                      "padding": None, "truncation": {"max_length": 512}})
    tok = json.loads(serving_tokenizer(raw))
    assert tok["padding"]["pad_id"] == 0 and tok["padding"]["pad_token"] == "[PAD]"
    assert tok["truncation"] is None  # the embedder truncates to its own max length


def test_variants_carry_bge_instructions() -> None:
    assert VARIANTS["bge-small-en-v1.5-int8"].query_prefix == INSTRUCTION_EN
    assert VARIANTS["bge-small-en-v1.5-int8-noinst"].query_prefix == ""
    assert VARIANTS["bge-small-zh-v1.5-fp32"].query_prefix.startswith("为这个句子")
    assert VARIANTS["bge-small-en-v1.5-int8"].artifact.endswith("-v15-q")
    assert VARIANTS["bge-small-zh-v1.5-fp32"].stem == "bge-small-zh-v1.5"


@pytest.mark.skipif(not jar_path(VARIANTS["bge-small-en-v1.5-int8"].artifact).is_file(),
                    reason="bge-small-en-v15-q jar not in ~/.m2 (mvn dependency:get fetches it)")
def test_real_build_matches_the_jars_graph(tmp_path: Path) -> None:
    variant = VARIANTS["bge-small-en-v1.5-int8"]
    [model_dir] = build_bge(tmp_path, (variant.model_id,))
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert manifest["pooling"] == "cls" and manifest["dimension"] == 384 and manifest["query_prefix"] == INSTRUCTION_EN
    # Deterministic: a forced rebuild writes the same ONNX bytes.
    sha = manifest["onnx_sha256"]
    build_bge(tmp_path, (variant.model_id,), force=True)
    assert json.loads((model_dir / "manifest.json").read_text())["onnx_sha256"] == sha

    embedder = load_embedder(model_dir)
    texts = ["How do I cancel my life insurance policy?", "Car insurance covers collisions."]
    encoded = embedder.tokenize(texts, "passage")
    vectors = embedder.infer(encoded)
    with zipfile.ZipFile(jar_path(variant.artifact)) as z:
        original = ort.InferenceSession(z.read(f"{variant.stem}.onnx"), providers=["CPUExecutionProvider"])
    hidden = original.run(["last_hidden_state"], {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
                                                  "token_type_ids": np.zeros_like(encoded.input_ids)})[0][:, 0]
    np.testing.assert_allclose(vectors, hidden / np.linalg.norm(hidden, axis=1, keepdims=True), atol=1e-5)
    query = embedder.infer(embedder.tokenize(["cancel life insurance"], "query"))[0]
    assert float(query @ vectors[0]) > float(query @ vectors[1])  # the on-topic passage is nearer


def test_the_english_int8_is_carded_for_make_models() -> None:
    cards = {c["name"]: c for c in shipped_cards()}
    card = cards["bge-small-en-v1.5-int8"]
    assert card["kind"] == "embedding" and len(card["source"]["jar_sha256"]) == 64 and len(card["onnx_sha256"]) == 64


def test_shipped_build_is_skipped_without_the_jar_or_mvn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(bge, "maven_repo", lambda: tmp_path / "empty-m2")
    monkeypatch.setattr(bge.shutil, "which", lambda name: None)
    notes: list[str] = []
    assert build_shipped(tmp_path / "models", log=notes.append) == []
    assert any("skipped" in n and "mvn is not installed" in n for n in notes)


def test_shipped_build_refuses_a_jar_the_card_does_not_pin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    card = next(c for c in shipped_cards() if c["name"] == "bge-small-en-v1.5-int8")
    fake = jar_path(card["source"]["maven"].split(":")[1], tmp_path)
    fake.parent.mkdir(parents=True)
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr("README", "not the pinned jar")
    monkeypatch.setattr(bge, "maven_repo", lambda: tmp_path)
    with pytest.raises(ArtifactMismatch, match="the card pins"):
        build_shipped(tmp_path / "models")
    assert not (tmp_path / "models" / card["name"]).exists()


@pytest.mark.slow
@pytest.mark.skipif(not jar_path(VARIANTS["bge-small-en-v1.5-int8"].artifact).is_file(),
                    reason="bge-small-en-v15-q jar not in ~/.m2 (mvn dependency:get fetches it)")
def test_shipped_build_gives_the_carded_onnx(tmp_path: Path) -> None:
    [model_dir] = build_shipped(tmp_path)
    card = next(c for c in shipped_cards() if c["name"] == model_dir.name)
    assert json.loads((model_dir / "manifest.json").read_text())["onnx_sha256"] == card["onnx_sha256"]


def test_bert_weights_are_read_from_an_export_whose_linears_are_unnamed() -> None:
    # Hugging Face's ONNX export names LayerNorms, biases and embeddings but calls every linear's
    # weight "onnx::MatMul_N": the reader finds each by the named bias added to its MatMul.
    from service.offline.builder.bert_graph import GraphOptions, build_bert_graph
    from service.offline.builder.q4bin import BertConfig, BertWeights, LayerWeights

    rng = np.random.default_rng(0)

    def m(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.2, shape).astype(np.float32)

    config = BertConfig(8, 2, 2, 16, 20, 12, 2, 1e-12)
    layers = [LayerWeights(m(8, 8), m(8), m(8, 8), m(8), m(8, 8), m(8), m(8, 8), m(8), 1 + m(8), m(8), m(8, 16), m(16),
                           m(16, 8), m(8), 1 + m(8), m(8)) for _ in range(2)]
    weights = BertWeights(m(20, 8), m(12, 8), m(2, 8), 1 + m(8), m(8), layers)
    model = build_bert_graph(config, weights, GraphOptions(head="hidden", token_type_input=True), "hf-like")
    matmul_weights = {n.input[1] for n in model.graph.node if n.op_type == "MatMul"} & {t.name for t in model.graph.initializer}
    renames = {name: f"onnx::MatMul_{i}" for i, name in enumerate(sorted(matmul_weights))}
    assert len(renames) == 12  # six linears a layer
    for t in model.graph.initializer:
        t.name = renames.get(t.name, t.name)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = renames.get(name, name)
    read_config, read = bge.bert_weights(model, heads=2)
    assert read_config == config
    for got, want in zip(read.layers, layers):
        for field in LayerWeights.__dataclass_fields__:
            assert np.array_equal(getattr(got, field), getattr(want, field)), field
    assert np.array_equal(read.word, weights.word) and np.array_equal(read.token_type, weights.token_type)
    with pytest.raises(ValueError, match="do not divide"):
        bge.bert_weights(model, heads=3)
