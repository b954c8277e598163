"""``manifest.json`` next to every built model: what the runners need to load it and what
an attempt records about it (model id, ONNX hash)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(model_dir: Path, kind: str) -> dict[str, Any]:
    """Load and sanity-check a model dir's manifest; fails early on a half-built dir."""
    path = model_dir / MANIFEST
    manifest: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("kind") != kind:
        raise ValueError(f"{path}: kind {manifest.get('kind')!r}, expected {kind!r}")
    for name in (MODEL_FILE, TOKENIZER_FILE):
        if not (model_dir / name).is_file():
            raise FileNotFoundError(f"{model_dir / name} is missing")
    return manifest


def write_manifest(model_dir: Path, manifest: dict[str, Any]) -> None:
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def publish_model_dir(work: Path, final: Path) -> None:
    """Swap a fully written model dir into place: readers see the old dir or the new one,
    never a half-written one. ``work`` came from mkdtemp (private); the cache may be shared."""
    if final.exists():
        shutil.rmtree(final)
    work.chmod(0o755)
    work.rename(final)
