"""Writes a BERT encoder as an ONNX graph with ``onnx.helper`` (no torch, no exporter).

The node pattern deliberately mirrors what the PyTorch exporter emits for Hugging Face
BERT (Erf GELU, additive ``(1 - mask) * -10000`` attention mask, Reshape/Transpose head
split, LayerNormalization after residual Add), because onnxruntime's transformer
optimizer recognises exactly that pattern and fuses it into ``Attention``,
``SkipLayerNormalization`` and ``BiasGelu``. One writer serves the e5 embedder
(mean pooling + L2) and the test cross-encoder (CLS -> linear -> one logit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.offline.builder.q4bin import BertConfig, BertWeights, LayerWeights

OPSET = 17
Head = Literal["mean_l2", "cls_logit", "hidden"]  # hidden: last layer states [batch, seq, hidden]
EMBEDDING_OUTPUT = "sentence_embedding"
LOGITS_OUTPUT = "logits"
HIDDEN_OUTPUT = "last_hidden_state"


@dataclass(frozen=True)
class GraphOptions:
    head: Head = "mean_l2"
    # Without a token_type_ids input, type row 0 is folded into the position table.
    token_type_input: bool = False
    # Store the word table as int8 + one fp32 scale per row: the table is ~90 % of the
    # parameters, and quantize_dynamic would only give it a single per-tensor scale.
    int8_word_embedding: bool = False
    # Weights of the "cls_logit" head: [hidden, 1] and [1].
    classifier_w: npt.NDArray[np.float32] | None = None
    classifier_b: npt.NDArray[np.float32] | None = None


class _Graph:
    """Accumulates nodes and initializers with unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._names: set[str] = set()
        self._n = 0

    def const(self, name: str, value: npt.ArrayLike, dtype: type = np.float32) -> str:
        # A name is one tensor: a subgraph written twice (the split cross-encoder's lower
        # layers, once for the query and once for the passage) shares its weights.
        if name not in self._names:
            self._names.add(name)
            self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], name: str | None = None, **attrs: Any) -> str:
        self._n += 1
        out = name or f"{op_type.lower()}_{self._n}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"{op_type}_{self._n}", **attrs))
        return out

    def linear(self, x: str, w: npt.NDArray[np.float32], b: npt.NDArray[np.float32], prefix: str) -> str:
        y = self.op("MatMul", [x, self.const(prefix + ".weight", w)])
        return self.op("Add", [y, self.const(prefix + ".bias", b)])

    def layer_norm(self, x: str, w: npt.NDArray[np.float32], b: npt.NDArray[np.float32], prefix: str, eps: float) -> str:
        return self.op(
            "LayerNormalization",
            [x, self.const(prefix + ".weight", w), self.const(prefix + ".bias", b)],
            axis=-1,
            epsilon=eps,
        )


def _quantize_rows(table: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
    scale = np.abs(table).max(axis=1, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(table / scale), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def embed(g: _Graph, ids: str, config: BertConfig, weights: BertWeights, options: GraphOptions) -> str:
    """Word + position (+ token type) embeddings, then LayerNorm: [batch, seq, hidden]."""
    if options.int8_word_embedding:
        q, scale = _quantize_rows(weights.word)
        rows = g.op("Cast", [g.op("Gather", [g.const("embeddings.word_embeddings.weight_int8", q, np.int8), ids])], to=TensorProto.FLOAT)
        word = g.op("Mul", [rows, g.op("Gather", [g.const("embeddings.word_embeddings.scale", scale), ids])])
    else:
        word = g.op("Gather", [g.const("embeddings.word_embeddings.weight", weights.word), ids])
    pos_table = weights.position if options.token_type_input else weights.position + weights.token_type[0]
    seq_len = g.op("Gather", [g.op("Shape", [ids]), g.const("const_one_idx", 1, np.int64)], axis=0)
    positions = g.op("Range", [g.const("const_zero", 0, np.int64), seq_len, g.const("const_one", 1, np.int64)])
    emb = g.op("Add", [word, g.op("Gather", [g.const("embeddings.position_embeddings.weight", pos_table), positions])])
    if options.token_type_input:
        types = g.op("Gather", [g.const("embeddings.token_type_embeddings.weight", weights.token_type), "token_type_ids"])
        emb = g.op("Add", [emb, types])
    return g.layer_norm(emb, weights.emb_ln_w, weights.emb_ln_b, "embeddings.LayerNorm", config.eps)


def padding_mask(g: _Graph, mask: str) -> str:
    """Additive attention mask [batch, 1, 1, seq]: 0 for tokens, -10000 for padding."""
    m = g.op("Unsqueeze", [mask, g.const("axes_1", [1], np.int64)])
    m = g.op("Unsqueeze", [m, g.const("axes_2", [2], np.int64)])
    m = g.op("Cast", [m], to=TensorProto.FLOAT)
    m = g.op("Sub", [g.const("const_1f", 1.0), m])
    return g.op("Mul", [m, g.const("const_neg10000", -10000.0)])


def encoder_layer(g: _Graph, x: str, ext_mask: str, lw: LayerWeights, p: str, config: BertConfig) -> str:
    """One post-LN BERT layer; ``ext_mask`` is added to the attention scores (broadcast)."""
    h, nh = config.hidden, config.heads
    hd = h // nh
    split_shape = g.const("shape_split_heads", [0, 0, nh, hd], np.int64)
    merge_shape = g.const("shape_merge_heads", [0, 0, h], np.int64)

    def heads(t: str, perm: list[int]) -> str:
        return g.op("Transpose", [g.op("Reshape", [t, split_shape])], perm=perm)

    q_ = heads(g.linear(x, lw.q_w, lw.q_b, p + ".attention.self.query"), [0, 2, 1, 3])
    k_ = heads(g.linear(x, lw.k_w, lw.k_b, p + ".attention.self.key"), [0, 2, 3, 1])
    v_ = heads(g.linear(x, lw.v_w, lw.v_b, p + ".attention.self.value"), [0, 2, 1, 3])
    scores = g.op("Div", [g.op("MatMul", [q_, k_]), g.const(p + ".scale", math.sqrt(hd))])
    probs = g.op("Softmax", [g.op("Add", [scores, ext_mask])], axis=-1)
    ctx = g.op("Transpose", [g.op("MatMul", [probs, v_])], perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, merge_shape])
    attn = g.linear(ctx, lw.ao_w, lw.ao_b, p + ".attention.output.dense")
    x = g.layer_norm(g.op("Add", [attn, x]), lw.aln_w, lw.aln_b, p + ".attention.output.LayerNorm", config.eps)

    inter = g.linear(x, lw.fi_w, lw.fi_b, p + ".intermediate.dense")
    erf = g.op("Erf", [g.op("Div", [inter, g.const(p + ".sqrt2", math.sqrt(2.0))])])
    gelu = g.op("Mul", [g.op("Mul", [inter, g.op("Add", [erf, g.const(p + ".one", 1.0)])]), g.const(p + ".half", 0.5)])
    out = g.linear(gelu, lw.fo_w, lw.fo_b, p + ".output.dense")
    return g.layer_norm(g.op("Add", [out, x]), lw.oln_w, lw.oln_b, p + ".output.LayerNorm", config.eps)


def mean_l2(g: _Graph, x: str, mask: str, name: str | None = None) -> str:
    """Masked mean over the sequence, L2-normalised: [batch, hidden]."""
    mf = g.op("Cast", [g.op("Unsqueeze", [mask, g.const("axes_last", [2], np.int64)])], to=TensorProto.FLOAT)
    summed = g.op("ReduceSum", [g.op("Mul", [x, mf]), g.const("axes_seq", [1], np.int64)], keepdims=0)
    count = g.op("Max", [g.op("ReduceSum", [mf, "axes_seq"], keepdims=0), g.const("min_count", 1e-9)])
    mean = g.op("Div", [summed, count])
    sq = g.op("ReduceSum", [g.op("Mul", [mean, mean]), g.const("axes_hidden", [1], np.int64)], keepdims=1)
    norm = g.op("Max", [g.op("Sqrt", [sq]), g.const("min_norm", 1e-12)])
    return g.op("Div", [mean, norm], name=name)


def finish(g: _Graph, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, name, inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="service.offline.builder")
    model.ir_version = 8
    return model


def build_bert_graph(config: BertConfig, weights: BertWeights, options: GraphOptions, name: str) -> onnx.ModelProto:
    """Encoder + head as an ONNX model (inputs int64 [batch, seq])."""
    g = _Graph()
    h = config.hidden
    ids, mask = "input_ids", "attention_mask"
    x = embed(g, ids, config, weights, options)
    ext_mask = padding_mask(g, mask)
    for i, lw in enumerate(weights.layers):
        x = encoder_layer(g, x, ext_mask, lw, f"encoder.layer.{i}", config)

    batch, seq = "batch", "sequence"
    if options.head == "mean_l2":
        mean_l2(g, x, mask, name=EMBEDDING_OUTPUT)
        output = helper.make_tensor_value_info(EMBEDDING_OUTPUT, TensorProto.FLOAT, [batch, h])
    elif options.head == "hidden":
        g.op("Identity", [x], name=HIDDEN_OUTPUT)
        output = helper.make_tensor_value_info(HIDDEN_OUTPUT, TensorProto.FLOAT, [batch, seq, h])
    else:
        if options.classifier_w is None or options.classifier_b is None:
            raise ValueError("cls_logit head needs classifier weights")
        cls = g.op("Gather", [x, g.const("cls_index", 0, np.int64)], axis=1)
        logits = g.op("MatMul", [cls, g.const("classifier.weight", options.classifier_w)])
        g.op("Add", [logits, g.const("classifier.bias", options.classifier_b)], name=LOGITS_OUTPUT)
        output = helper.make_tensor_value_info(LOGITS_OUTPUT, TensorProto.FLOAT, [batch, 1])

    inputs = [
        helper.make_tensor_value_info(ids, TensorProto.INT64, [batch, seq]),
        helper.make_tensor_value_info(mask, TensorProto.INT64, [batch, seq]),
    ]
    if options.token_type_input:
        inputs.append(helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, [batch, seq]))
    return finish(g, name, inputs, [output])
