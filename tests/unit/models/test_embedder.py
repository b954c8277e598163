"""OnnxEmbedder behaviour that does not need the reference engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.models.onnx_embedder import DEFAULT_MAX_LENGTH, load_embedder

pytestmark = pytest.mark.slow


def test_info_comes_from_manifest(e5_int8_dir: Path) -> None:
    import json

    manifest = json.loads((e5_int8_dir / "manifest.json").read_text())
    model = load_embedder(e5_int8_dir)
    assert model.info.model_id == "multilingual-e5-small-int8"
    assert model.info.sha256 == manifest["onnx_sha256"]
    assert model.info.max_length == DEFAULT_MAX_LENGTH == 256
    assert model.dimension == 384


@pytest.mark.parametrize(("variant", "min_cos"), [("fp32", 0.99999), ("int8", 0.98)])
def test_unit_vectors_and_batch_invariance(models_dir: Path, variant: str, min_cos: float) -> None:
    """fp32 gives a text the same vector in any batch. int8 does not quite: dynamic
    quantisation takes one activation scale per tensor, i.e. per batch (cosine ~0.995)."""
    model = load_embedder(models_dir / f"multilingual-e5-small-{variant}")
    texts = ["short", "a much longer passage about insurance claims and the documents they require", "中文句子"]
    batch = model.infer(model.tokenize(texts, "passage"))
    assert batch.dtype == np.float32 and batch.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    for i, text in enumerate(texts):
        alone = model.infer(model.tokenize([text], "passage"))[0]
        assert float(alone @ batch[i]) > min_cos


def test_prefix_and_truncation(e5_int8_dir: Path) -> None:
    model = load_embedder(e5_int8_dir, max_length=32)
    q = model.tokenize(["same text"], "query")
    p = model.tokenize(["same text"], "passage")
    assert q.input_ids.tolist() != p.input_ids.tolist()
    long = model.tokenize(["word " * 500], "passage")
    assert long.input_ids.shape == (1, 32)
    assert long.input_ids[0, 0] == 0 and long.input_ids[0, -1] == 2


def test_empty_batch(e5_int8_dir: Path) -> None:
    model = load_embedder(e5_int8_dir)
    assert model.infer(model.tokenize([], "query")).shape == (0, 384)
