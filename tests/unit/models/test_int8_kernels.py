"""Serving's int8 sessions give the exact kernels' outputs on every CPU, and pay for the
exact kernels only where the fast ones saturate (``_ort.u8s8_saturates``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.models._ort import make_session, session_options, u8s8_saturates


def test_the_probe_is_a_cached_answer() -> None:
    first = u8s8_saturates()
    assert isinstance(first, bool)
    assert u8s8_saturates() is first
    assert u8s8_saturates.__wrapped__() is first  # type: ignore[attr-defined]  # a fresh probe agrees


def test_serving_sessions_score_as_the_exact_kernels_do(models_dir: Path) -> None:
    """The shipped joint graph on large random states (wide int8 activations, full-range int8
    weights: where fast kernels without VNNI saturate, ~0.4 a logit on an AVX2 EPYC):
    serving's session equals one forced onto the exact kernels, bit for bit, whichever way
    the probe went here."""
    path = models_dir / "e5-small-split-reranker-int8" / "joint.onnx"
    rng = np.random.default_rng(0)
    feeds = {"query_states": 4 * rng.standard_normal((20, 16, 384)).astype(np.float32),
             "query_mask": np.ones((20, 16), np.int64),
             "passage_states": 4 * rng.standard_normal((20, 128, 384)).astype(np.float32),
             "passage_mask": np.ones((20, 128), np.int64)}
    served = make_session(path, 1).run(None, feeds)[0]
    exact = ort.InferenceSession(str(path), sess_options=session_options(1, exact_int8=True),
                                 providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_array_equal(served, exact)
