"""Writes the split cross-encoder as one ONNX graph (PreTTR-style, MacAvaney et al. 2020).

The lower ``n_lower`` layers are the e5 bi-encoder's own, run separately on the query
(``<s> query: q </s>``) and the passage (``<s> passage: p </s>``); the upper layers run on
the concatenation, so every query token can attend to every passage token and back. Each
upper layer adds a learned per-head bias to the cross-segment attention scores: trained
from -6 (almost no cross attention, i.e. exactly the bi-encoder) to whatever helps. The
head mean-pools each segment, L2-normalises both, and scores ``sum(w * q * p) + b``
(``w`` starts at 20 * ones: the bi-encoder's cosine at its usual temperature), so the
untrained model already ranks like the dense leg and training only has to add to it.

Why split: the lower layers never see the other text, so training caches their output
once (``head="hidden"``) and only the upper layers pay forward + backward; that is what
makes a useful cross-encoder trainable on two CPU cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper

from service.offline.builder.bert_graph import (
    LOGITS_OUTPUT,
    GraphOptions,
    _Graph,
    embed,
    encoder_layer,
    finish,
    mean_l2,
    padding_mask,
)
from service.offline.builder.q4bin import BertConfig, BertWeights, E5Bin, LayerWeights

QUERY_INPUTS = ("query_ids", "query_mask")
PASSAGE_INPUTS = ("passage_ids", "passage_mask")


@dataclass
class SplitHead:
    cross_bias: list[npt.NDArray[np.float32]]  # one [heads] per upper layer
    w: npt.NDArray[np.float32]  # [hidden]
    b: float
    maxsim_w: float | None = None  # the late-interaction term's weight (None: no such term)


GraphPart = Literal["whole", "lower", "joint", "tower"]
# The two-graph layout (cached passage states): ``lower`` maps ids -> the states at the
# split point, ``joint`` maps both sides' states -> the logit. ``whole`` is the one graph.
# ``tower`` maps one side's states -> its pooled vector through the upper layers with the
# cross attention shut (README "Two towers"): ``sum(w * tower(q) * tower(p)) + b`` is the
# joint graph with its cross-attention biases at -inf.
STATES_OUTPUT = "states"
LOWER_INPUTS = ("input_ids", "attention_mask")
JOINT_INPUTS = ("query_states", "query_mask", "passage_states", "passage_mask")
TOWER_INPUTS = ("states", "attention_mask")
TOWER_OUTPUT = "vector"


def build_split_graph(config: BertConfig, lower: BertWeights, upper: list[LayerWeights], head: SplitHead,
                      int8_word_embedding: bool, name: str, part: GraphPart = "whole") -> onnx.ModelProto:
    """``whole``: inputs int64 [batch, query_seq] x2 and [batch, passage_seq] x2, output logits
    [batch, 1]. ``lower``: ids + mask -> states [batch, seq, hidden] (query or passage alike).
    ``joint``: query states + mask, passage states + mask -> logits. ``joint(lower(q), lower(p))``
    is ``whole(q, p)``: the same nodes on the same weights, only cut at the split point.
    ``tower``: states + mask -> the pooled, L2-normalised vector [batch, hidden] of the upper
    layers run on that side alone."""
    if len(head.cross_bias) != len(upper):
        raise ValueError("one cross-attention bias vector per upper layer")
    g = _Graph()
    options = GraphOptions(int8_word_embedding=int8_word_embedding)
    batch, h = "batch", config.hidden

    def lower_layers(ids: str, mask: str) -> str:
        x = embed(g, ids, config, lower, options)
        ext = padding_mask(g, mask)
        for i, lw in enumerate(lower.layers):
            x = encoder_layer(g, x, ext, lw, f"encoder.layer.{i}", config)
        return x

    if part == "lower":
        g.op("Identity", [lower_layers(*LOWER_INPUTS)], name=STATES_OUTPUT)
        inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, [batch, "sequence"]) for n in LOWER_INPUTS]
        return finish(g, name, inputs, [helper.make_tensor_value_info(STATES_OUTPUT, TensorProto.FLOAT, [batch, "sequence", h])])
    if part == "tower":
        if head.maxsim_w is not None:
            raise ValueError("a MaxSim head compares the two sides' tokens: it has no towers")
        x, t_mask = TOWER_INPUTS
        ext = padding_mask(g, t_mask)
        for j, lw in enumerate(upper):
            x = encoder_layer(g, x, ext, lw, f"encoder.layer.{len(lower.layers) + j}", config)
        mean_l2(g, x, t_mask, name=TOWER_OUTPUT)
        inputs = [
            helper.make_tensor_value_info(TOWER_INPUTS[0], TensorProto.FLOAT, [batch, "sequence", h]),
            helper.make_tensor_value_info(TOWER_INPUTS[1], TensorProto.INT64, [batch, "sequence"]),
        ]
        return finish(g, name, inputs, [helper.make_tensor_value_info(TOWER_OUTPUT, TensorProto.FLOAT, [batch, h])])
    if part == "joint":
        q_states, q_mask, p_states, p_mask = JOINT_INPUTS
        _joint(g, config, upper, head, len(lower.layers), (q_states, q_mask), (p_states, p_mask), q_mask)
        inputs = [
            helper.make_tensor_value_info(q_states, TensorProto.FLOAT, [batch, "query_seq", h]),
            helper.make_tensor_value_info(q_mask, TensorProto.INT64, [batch, "query_seq"]),
            helper.make_tensor_value_info(p_states, TensorProto.FLOAT, [batch, "passage_seq", h]),
            helper.make_tensor_value_info(p_mask, TensorProto.INT64, [batch, "passage_seq"]),
        ]
        return finish(g, name, inputs, [helper.make_tensor_value_info(LOGITS_OUTPUT, TensorProto.FLOAT, [batch, 1])])

    states = [lower_layers(ids, mask) for ids, mask in (QUERY_INPUTS, PASSAGE_INPUTS)]
    _joint(g, config, upper, head, len(lower.layers), (states[0], QUERY_INPUTS[1]), (states[1], PASSAGE_INPUTS[1]),
           QUERY_INPUTS[0])
    inputs = [
        helper.make_tensor_value_info(QUERY_INPUTS[0], TensorProto.INT64, [batch, "query_seq"]),
        helper.make_tensor_value_info(QUERY_INPUTS[1], TensorProto.INT64, [batch, "query_seq"]),
        helper.make_tensor_value_info(PASSAGE_INPUTS[0], TensorProto.INT64, [batch, "passage_seq"]),
        helper.make_tensor_value_info(PASSAGE_INPUTS[1], TensorProto.INT64, [batch, "passage_seq"]),
    ]
    output = helper.make_tensor_value_info(LOGITS_OUTPUT, TensorProto.FLOAT, [batch, 1])
    return finish(g, name, inputs, [output])


def _joint(g: _Graph, config: BertConfig, upper: list[LayerWeights], head: SplitHead, n_lower: int,
           query: tuple[str, str], passage: tuple[str, str], query_shape_of: str) -> None:
    """The upper layers over ``concat(query states, passage states)`` and the head.
    ``query_shape_of``: the tensor whose dim 1 is the query length (the whole graph keeps
    reading it off ``query_ids``, so its bytes and hash stay what the card measured)."""
    nh = config.heads
    (q_states, q_mask), (p_states, p_mask) = query, passage
    x = g.op("Concat", [q_states, p_states], axis=1)
    mask = g.op("Concat", [q_mask, p_mask], axis=1)
    ext = padding_mask(g, mask)
    # Segment ids 0 (query) / 1 (passage); cross[b, 1, i, j] = 1 where i and j differ.
    zeros = g.op("Mul", [g.op("Cast", [q_mask], to=TensorProto.FLOAT), g.const("const_0f", 0.0)])
    ones = g.op("Add", [g.op("Mul", [g.op("Cast", [p_mask], to=TensorProto.FLOAT), "const_0f"]), "const_1f"])
    seg = g.op("Concat", [zeros, ones], axis=1)
    rows = g.op("Unsqueeze", [seg, g.const("axes_2", [2], np.int64)])
    cols = g.op("Unsqueeze", [seg, g.const("axes_1", [1], np.int64)])
    cross = g.op("Unsqueeze", [g.op("Abs", [g.op("Sub", [rows, cols])]), "axes_1"])
    for j, lw in enumerate(upper):
        p = f"encoder.layer.{n_lower + j}"
        bias = g.const(p + ".cross_bias", np.asarray(head.cross_bias[j], np.float32).reshape(1, nh, 1, 1))
        layer_mask = g.op("Add", [ext, g.op("Mul", [cross, bias])])
        x = encoder_layer(g, x, layer_mask, lw, p, config)

    q_len = g.op("Gather", [g.op("Shape", [query_shape_of]), g.const("const_one_idx", 1, np.int64)], axis=0)
    q_len = g.op("Unsqueeze", [q_len, g.const("axes_0", [0], np.int64)])
    big = g.const("const_int_max", [2**62], np.int64)
    axis = g.const("axes_seq_1d", [1], np.int64)
    q_part = g.op("Slice", [x, g.const("starts_0", [0], np.int64), q_len, axis])
    p_part = g.op("Slice", [x, q_len, big, axis])
    q_vec = mean_l2(g, q_part, q_mask)
    p_vec = mean_l2(g, p_part, p_mask)
    prod = g.op("Mul", [q_vec, p_vec])
    logits = g.op("MatMul", [prod, g.const("head.weight", np.asarray(head.w, np.float32).reshape(-1, 1))])
    if head.maxsim_w is None:
        g.op("Add", [logits, g.const("head.bias", [float(head.b)])], name=LOGITS_OUTPUT)
        return
    logits = g.op("Add", [logits, g.const("head.bias", [float(head.b)])])
    ms = _maxsim(g, q_part, q_mask, p_part, p_mask)  # [batch]
    ms = g.op("Unsqueeze", [g.op("Mul", [ms, g.const("head.maxsim_weight", float(head.maxsim_w))]), "axes_1"])
    g.op("Add", [logits, ms], name=LOGITS_OUTPUT)


def _maxsim(g: _Graph, q: str, q_mask: str, p: str, p_mask: str) -> str:
    """ColBERT's MaxSim [batch] (``training/split.py`` ``maxsim_score``): per query token the
    best cosine over the passage's tokens, averaged over the query's tokens."""

    def unit(x: str) -> str:
        sq = g.op("ReduceSum", [g.op("Mul", [x, x]), g.const("axes_last_1d", [2], np.int64)], keepdims=1)
        return g.op("Div", [x, g.op("Max", [g.op("Sqrt", [sq]), g.const("min_norm", 1e-12)])])

    sim = g.op("MatMul", [unit(q), g.op("Transpose", [unit(p)], perm=[0, 2, 1])])  # [b, sq, sp]
    pad = g.op("Squeeze", [padding_mask(g, p_mask), g.const("axes_1", [1], np.int64)])  # [b, 1, sp]
    sim = g.op("Add", [sim, pad])
    best = g.op("ReduceMax", [sim], axes=[2], keepdims=0)  # [b, sq] (opset 17: axes is an attribute)
    qm = g.op("Cast", [q_mask], to=TensorProto.FLOAT)
    total = g.op("ReduceSum", [g.op("Mul", [best, qm]), g.const("axes_seq", [1], np.int64)], keepdims=0)
    count = g.op("Max", [g.op("ReduceSum", [qm, "axes_seq"], keepdims=0), g.const("min_count", 1e-9)])
    return g.op("Div", [total, count])


def upper_layers(tensors: dict[str, npt.NDArray[np.float32]], n_upper: int) -> list[LayerWeights]:
    """Trained ``Layer`` tensors ([out, in] linears, torch layout) -> builder layout ([in, out])."""

    def lin(j: int, name: str) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        return np.ascontiguousarray(tensors[f"layers.{j}.{name}.weight"].T), tensors[f"layers.{j}.{name}.bias"]

    out = []
    for j in range(n_upper):
        q, k, v, ao, fi, fo = (lin(j, n) for n in ("q", "k", "v", "ao", "fi", "fo"))
        out.append(LayerWeights(q[0], q[1], k[0], k[1], v[0], v[1], ao[0], ao[1],
                                tensors[f"layers.{j}.aln.weight"], tensors[f"layers.{j}.aln.bias"],
                                fi[0], fi[1], fo[0], fo[1],
                                tensors[f"layers.{j}.oln.weight"], tensors[f"layers.{j}.oln.bias"]))
    return out


def write_split_onnx(src: E5Bin, n_lower: int, tensors: dict[str, npt.NDArray[np.float32]], n_upper: int,
                     precision: str, path: str, name: str, part: GraphPart = "whole", weight_bits: int = 8) -> None:
    """The whole split cross-encoder as ONNX: e5's own embeddings and first ``n_lower``
    layers (from the shipped weights) + the trained upper layers, cross-attention biases
    and head (``tensors``); int8 = dynamic per-channel quantisation of every MatMul, its
    weights at ``weight_bits`` (7: within +-64, which onnxruntime's fast int8 kernels
    multiply exactly on every CPU, ``_ort.int8_weights_cannot_saturate``)."""
    if weight_bits not in (7, 8):
        raise ValueError(f"weight_bits must be 7 or 8, not {weight_bits}")
    w = src.weights
    lower = BertWeights(w.word, w.position, w.token_type, w.emb_ln_w, w.emb_ln_b, w.layers[:n_lower])
    head = SplitHead([tensors["cross_bias"][j] for j in range(n_upper)], tensors["head_w"], float(tensors["head_b"]),
                     float(tensors["maxsim_w"]) if "maxsim_w" in tensors else None)
    graph = build_split_graph(src.config, lower, upper_layers(tensors, n_upper), head, precision == "int8", name, part)
    if precision == "fp32":
        onnx.save(graph, path)
        return
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(graph, path, op_types_to_quantize=["MatMul"], per_channel=True, weight_type=QuantType.QInt8,
                     reduce_range=weight_bits == 7, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
