"""Serving's int8 sessions give the exact kernels' outputs on every CPU, and pay for the
exact kernels only where the fast ones saturate (``_ort.u8s8_saturates``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from service.models._ort import int8_weights_cannot_saturate, make_session, session_options, u8s8_saturates
from tests.support import avx2_cpu


def _feeds(graph: str) -> dict[str, np.ndarray]:
    """Inputs with wide int8 activations: large random states for the joint graph and the
    tower, random ids for the lower layers (21 x 128, a rerank's passages and its query)."""
    rng = np.random.default_rng(0)
    if graph == "tower.onnx":
        return {"states": 4 * rng.standard_normal((20, 128, 384)).astype(np.float32),
                "attention_mask": np.ones((20, 128), np.int64)}
    if graph == "joint.onnx":
        return {"query_states": 4 * rng.standard_normal((20, 16, 384)).astype(np.float32),
                "query_mask": np.ones((20, 16), np.int64),
                "passage_states": 4 * rng.standard_normal((20, 128, 384)).astype(np.float32),
                "passage_mask": np.ones((20, 128), np.int64)}
    ids = rng.integers(5, 30000, size=(21, 128), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 0, 2
    return {"input_ids": ids, "attention_mask": np.ones((21, 128), np.int64)}


def test_the_probe_is_a_cached_answer() -> None:
    first = u8s8_saturates()
    assert isinstance(first, bool)
    assert u8s8_saturates() is first
    assert u8s8_saturates.__wrapped__() is first  # type: ignore[attr-defined]  # a fresh probe agrees


@pytest.mark.parametrize("graph", ["lower.onnx", "joint.onnx", "tower.onnx"])
def test_serving_sessions_score_as_the_exact_kernels_do(models_dir: Path, graph: str) -> None:
    """The shipped split reranker's graphs on wide int8 activations (the lower layers' 8-bit
    weights are where fast kernels without VNNI saturate: a state component strays by ~1 on
    an AVX2 EPYC; the joint layers' are 7-bit): serving's session equals one forced onto the
    exact kernels, bit for bit, whichever way the probe went here."""
    path = models_dir / "e5-small-split-reranker-int8" / graph
    feeds = _feeds(graph)
    served = make_session(path, 1).run(None, feeds)[0]
    exact = ort.InferenceSession(str(path), sess_options=session_options(1, exact_int8=True),
                                 providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_array_equal(served, exact)


def _worst_case_matmul(weight: int) -> bytes:
    """uint8 activations x an int8 weight matrix of ``weight`` everywhere: with activations
    255 every pair of products sums to 510 x ``weight``."""
    k, n = 64, 16
    w = helper.make_tensor("w", onnx.TensorProto.INT8, [k, n], [weight] * (k * n))
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "worst_case",
        [helper.make_tensor_value_info("a", onnx.TensorProto.UINT8, [8, k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.INT32, [8, n])], initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()


def test_seven_bit_weights_cannot_saturate_and_full_range_ones_can(models_dir: Path) -> None:
    assert int8_weights_cannot_saturate(_worst_case_matmul(64))
    assert int8_weights_cannot_saturate(_worst_case_matmul(-64))
    assert not int8_weights_cannot_saturate(_worst_case_matmul(65))
    assert not int8_weights_cannot_saturate(_worst_case_matmul(-127))
    shipped = models_dir / "e5-small-split-reranker-int8"
    assert not int8_weights_cannot_saturate(shipped / "lower.onnx")  # 8-bit: must equal the embedder's
    assert int8_weights_cannot_saturate(shipped / "joint.onnx")  # 7-bit (the card's joint_weight_bits)
    assert int8_weights_cannot_saturate(shipped / "tower.onnx")  # the same layers, the same width
    no_matmul = helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "none",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])]))
    assert not int8_weights_cannot_saturate(no_matmul.SerializeToString())


# Run under tests/support/avx2_cpu.py: CPUID says AVX2 without VNNI, so onnxruntime picks the
# kernels whose pair sums saturate. Prints one line per check for the test to read.
_AS_AVX2 = """
import sys
import numpy as np
import onnxruntime as ort
sys.path.insert(0, {root!r})
from pathlib import Path
from service.models._ort import make_session, needs_exact_kernels, session_options, u8s8_saturates
from tests.unit.models.test_int8_kernels import _feeds, _worst_case_matmul
print("saturates", u8s8_saturates())
for weight in (127, 64):
    fast = ort.InferenceSession(_worst_case_matmul(weight), sess_options=session_options(1),
                                providers=["CPUExecutionProvider"])
    y = fast.run(None, {{"a": np.full((8, 64), 255, np.uint8)}})[0]
    print("fast exact at", weight, bool((y == 255 * 64 * weight).all()), "needs exact kernels",
          needs_exact_kernels(_worst_case_matmul(weight)))
for graph in ("lower.onnx", "joint.onnx", "tower.onnx"):
    path = Path({reranker!r}) / graph
    feeds = _feeds(graph)
    served = make_session(path, 1).run(None, feeds)[0]
    exact = ort.InferenceSession(str(path), sess_options=session_options(1, exact_int8=True),
                                 providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    fast = ort.InferenceSession(str(path), sess_options=session_options(1),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    print(graph, "needs exact kernels", needs_exact_kernels(path), "served == exact", bool((served == exact).all()),
          "fast strays", float(np.abs(fast - exact).max()))
"""


def test_as_an_avx2_cpu_serving_runs_exact_kernels_unless_weights_fit_seven_bits(models_dir: Path) -> None:
    """The probe's other branch, on this machine: under the AVX2 shim the fast kernels
    saturate on full-range weights (so the probe says so, and the shipped lower layers' fast
    states stray), serving's session still gives the exact kernels' outputs bit for bit, and
    7-bit weights (a worst-case matmul, the shipped joint layers and tower) are exact on the
    fast kernels, so serving keeps them there."""
    reason = avx2_cpu.unavailable()
    if reason:
        pytest.skip(f"cannot run as an AVX2 CPU here: {reason}")
    root = str(Path(__file__).resolve().parents[3])
    code = _AS_AVX2.format(root=root, reranker=str(models_dir / "e5-small-split-reranker-int8"))
    done = subprocess.run([sys.executable, "-c", code], env=avx2_cpu.environ(), cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "saturates True" in lines
    assert "fast exact at 127 False needs exact kernels True" in lines
    assert "fast exact at 64 True needs exact kernels False" in lines
    lower = next(line for line in lines if line.startswith("lower.onnx"))
    assert lower.startswith("lower.onnx needs exact kernels True served == exact True")
    assert float(lower.rsplit(" ", 1)[1]) > 0.01  # the shim took effect on a real graph
    assert "joint.onnx needs exact kernels False served == exact True fast strays 0.0" in lines
    assert "tower.onnx needs exact kernels False served == exact True fast strays 0.0" in lines
