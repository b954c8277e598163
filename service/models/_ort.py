"""onnxruntime session and tokenizer setup shared by the ONNX runners."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from tokenizers import Encoding, Tokenizer

IntArray = npt.NDArray[np.int64]
log = logging.getLogger(__name__)


def session_options(threads: int, exact_int8: bool = False) -> Any:
    """``threads`` intra-op threads, no inter-op pool, and no spin-waiting: the executor
    pool runs several calls at once on few cores, and spinning threads would steal them.
    ``exact_int8``: onnxruntime's exact (u8u8) int8 kernels (``make_session`` asks for them
    only where the fast ones saturate, ``u8s8_saturates``)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if exact_int8:
        opts.add_session_config_entry("session.x64quantprecision", "1")
    return opts


@functools.cache
def u8s8_saturates() -> bool:
    """Whether onnxruntime's fast int8 matmul (uint8 activations x int8 weights) saturates on
    this CPU, found by running it once on the worst case, not by a table of CPU names.

    Without VNNI (AVX2, AVX-512 without VNNI) x86 kernels add each pair of neighbouring
    products in int16 (``vpmaddubsw``): 255 x 127 x 2 = 64,770 clamps to 32,767, so the int8
    models score differently there than where the sum is exact (VNNI, or another
    architecture); a demo answer fell under the rerank gate on an AVX2 EPYC. Cached: one
    tiny session per process. If the probe cannot run, assume the worst (exact kernels)."""
    k, n = 64, 16
    weight = helper.make_tensor("w", onnx.TensorProto.INT8, [k, n], [127] * (k * n))
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "u8s8_probe",
        [helper.make_tensor_value_info("a", onnx.TensorProto.UINT8, [8, k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.INT32, [8, n])], initializer=[weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    try:
        session = ort.InferenceSession(model.SerializeToString(), sess_options=session_options(1),
                                       providers=["CPUExecutionProvider"])
        y = session.run(None, {"a": np.full((8, k), 255, dtype=np.uint8)})[0]
        saturates = bool((np.asarray(y, dtype=np.int64) != 255 * 127 * k).any())
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types
        log.warning("int8 kernel probe failed (%s): using the exact int8 kernels", exc)
        return True
    log.info("int8 matmul: %s", "fast kernels saturate here, running the exact ones" if saturates
             else "fast kernels are exact here")
    return saturates


def make_session(model: Path | bytes, threads: int) -> Any:
    """Serving's session: ``session_options``, plus exact int8 kernels where the fast ones
    saturate and the graph's weights could make them (``needs_exact_kernels``), from a model
    file or a serialised model (one rewritten in memory, e.g.
    ``OnnxEmbedder.tap_hidden_states``). ``InferenceSession.run`` is thread-safe, so one
    session serves every pool thread."""
    # Exact kernels only where needed: onnxruntime applies their entry on every x86 CPU with
    # AVX2, VNNI or not (it rewrites the int8 weights to uint8 for its u8u8 kernels), and on
    # a VNNI Xeon that made every int8 model ~1.9x slower for bit-identical outputs
    # (tests/bench/bench_int8_kernels.py).
    opts = session_options(threads, exact_int8=needs_exact_kernels(model))
    # The first try keeps onnxruntime's own log quiet: a refusal below is expected on such
    # CPUs and handled; the retry logs at the normal level, so a real fault still speaks.
    severity = opts.log_severity_level
    opts.log_severity_level = 4
    source = model if isinstance(model, bytes) else str(model)
    name = "model" if isinstance(model, bytes) else model.name
    try:
        return ort.InferenceSession(source, sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own Fail type
        opts.log_severity_level = severity
        # Its weight rewrite for those kernels refuses an int8 weight that two nodes share
        # (the split reranker's one-graph model.onnx: its query and passage paths run the
        # same lower layers): give each use its own copy, in memory; the file is unchanged.
        log.info("%s: %s; loading with unshared int8 weights", name, str(exc).splitlines()[0][:160])
        return ort.InferenceSession(_unshared_int8_weights(model), sess_options=opts,
                                    providers=["CPUExecutionProvider"])


# Where the fast kernels add pairs of uint8 x int8 products in int16, weights within
# [-64, 64] keep every pair sum within it: 255 x 64 x 2 = 32,640 <= 32,767.
SAFE_INT8_WEIGHT = 64


def needs_exact_kernels(model: Path | bytes) -> bool:
    """Serving's choice for one graph: the exact kernels where the fast ones saturate here,
    unless the graph's weights cannot make them."""
    return u8s8_saturates() and not int8_weights_cannot_saturate(model)


def int8_weights_cannot_saturate(source: Path | bytes) -> bool:
    """Whether every int8 matmul weight in the graph lies within +-``SAFE_INT8_WEIGHT``
    (quantised to 7 bits, ``quantize_dynamic(reduce_range=True)``): then onnxruntime's fast
    kernels are exact even where they saturate on full-range weights, and the graph needs no
    exact kernels. Asked only where the probe found saturation. False for a graph without
    int8 matmul weights (nothing to gain)."""
    model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(str(source))
    graph = model.graph
    weights = {name for node in graph.node if node.op_type == "MatMulInteger" for name in node.input[1:2]}
    found = False
    for tensor in graph.initializer:
        if tensor.name in weights and tensor.data_type == onnx.TensorProto.INT8:
            values = numpy_helper.to_array(tensor)
            if values.size and int(np.abs(values.astype(np.int16)).max()) > SAFE_INT8_WEIGHT:
                return False
            found = True
    return found


def _unshared_int8_weights(source: Path | bytes) -> bytes:
    """The model with a copy of each int8 matmul weight per ``MatMulInteger`` that reads it.
    Only those: the rewrite converts matmul weights, and the int8 word embedding the two
    paths' ``Gather`` nodes share (96 MB) stays one tensor."""
    model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(str(source))
    graph = model.graph
    int8 = {t.name: t for t in graph.initializer if t.data_type == onnx.TensorProto.INT8}
    seen: dict[str, int] = {}
    for node in (n for n in graph.node if n.op_type == "MatMulInteger"):
        for k, name in enumerate(node.input):
            if name not in int8:
                continue
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                copy = onnx.TensorProto()
                copy.CopyFrom(int8[name])
                copy.name = f"{name}__use{seen[name]}"
                graph.initializer.append(copy)
                node.input[k] = copy.name
    return model.SerializeToString()


def batch_invariant(model_path: Path) -> bool:
    """False when the graph quantizes activations per tensor at run time
    (``DynamicQuantizeLinear``, what onnxruntime's ``quantize_dynamic`` writes): the scale is
    taken over the whole batch, padding included, so an item's output shifts with whatever
    shares its batch (a rerank logit by ~0.1, a query embedding to cosine ~0.997)."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    return not any(node.op_type == "DynamicQuantizeLinear" for node in graph.node)


def load_tokenizer(path: Path) -> tuple[Tokenizer, int]:
    """The tokenizer with truncation and padding switched off (the runners do both, so the
    file's settings never leak in), and its pad id."""
    tok = Tokenizer.from_file(str(path))
    padding = tok.padding
    pad_id = int(padding["pad_id"]) if padding is not None else tok.token_to_id("<pad>")
    if pad_id is None:
        raise ValueError(f"{path}: no pad id (neither padding settings nor a <pad> token)")
    tok.no_padding()
    tok.no_truncation()
    return tok, pad_id


def pad_batch(encodings: list[Encoding], pad_id: int) -> tuple[IntArray, IntArray, IntArray]:
    """ids, attention mask and token type ids as int64 [n, longest] arrays."""
    width = max((len(e.ids) for e in encodings), default=0)
    ids = np.full((len(encodings), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(encodings), width), dtype=np.int64)
    types = np.zeros((len(encodings), width), dtype=np.int64)
    for i, e in enumerate(encodings):
        n = len(e.ids)
        ids[i, :n] = e.ids
        mask[i, :n] = e.attention_mask
        types[i, :n] = e.type_ids
    return ids, mask, types

