"""The tower-leg measurement (service/offline/training/tower_leg.py) runs the served tower
graph over cached states in length-sorted, padded batches: each vector must be the one the
row gives alone, cut at the passage cap, in the input order."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from service.models.manifest import TOKENIZER_FILE
from service.offline.builder.tiny_cross_encoder import build_tiny_split_cross_encoder
from service.offline.training.data import Ragged
from service.offline.training.tower_leg import onnx_tower_vectors

HIDDEN = 64  # the tiny model's


def test_batched_tower_vectors_are_each_rows_own(tmp_path: Path, e5_fp32_dir: Path) -> None:
    import onnxruntime as ort

    model_dir = build_tiny_split_cross_encoder(tmp_path / "m", e5_fp32_dir / TOKENIZER_FILE, lower=1, upper=2)
    session = ort.InferenceSession(str(model_dir / "tower.onnx"))
    rng = np.random.default_rng(0)
    lengths = [7, 2, 9, 4, 4, 12, 1]
    flat = rng.standard_normal((sum(lengths), HIDDEN)).astype(np.float16)
    rag = Ragged(flat, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    cap = 6
    got = onnx_tower_vectors(session, rag, cap, batch=3)
    for i in range(len(rag)):
        row = np.asarray(rag[i][:cap], np.float32)[None]
        alone = session.run(None, {"states": row, "attention_mask": np.ones(row.shape[:2], np.int64)})[0][0]
        np.testing.assert_allclose(got[i], alone, atol=1e-5, err_msg=f"row {i}")
    assert not np.allclose(got[5], onnx_tower_vectors(session, rag, 12, batch=3)[5], atol=1e-3)  # the cap cuts row 5
