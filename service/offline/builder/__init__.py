"""Turns weights shipped in registry packages into servable model dirs
(``model.onnx`` + ``tokenizer.json`` + ``manifest.json``). Build step only: serving never
imports this package, and nothing here downloads anything."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from service.offline.builder.bge import build_shipped as build_shipped_bge
from service.offline.builder.e5 import _stderr, build_e5
from service.offline.builder.reranker import build_reranker, install_calibration

MODELS_DIR_ENV = "RETRIEVAL_MODELS_DIR"


def default_models_dir() -> Path:
    """``$RETRIEVAL_MODELS_DIR`` or ``~/.cache/retrieval-service/models`` (shared by the
    builder CLI, the service configuration default and the test fixtures)."""
    env = os.environ.get(MODELS_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "retrieval-service" / "models"


def build_all(out_dir: Path | None = None, force: bool = False, bge: bool = True) -> list[Path]:
    """Build every model: e5-small fp32 + int8 (the wheel's, the default embedder) and the
    InsuranceQA-adapted e5 int8 (opt-in to serve: the wheel's model with the committed
    upper-layer delta), each with its shipped hybrid quality calibration, then every shipped
    reranker from its committed delta (the default one, and the one paired with the adapted
    e5); building the adapted pair always makes switching to it a configuration change; with ``bge`` (the
    default), also the carded bge embedders from their Maven jars: bge-small-en is the
    Latin-script dense leg's embedder, which ``latin_embedding_model = "auto"`` serves once it
    is built (a machine with neither the jar in ~/.m2 nor mvn skips it with a note, and the
    service then runs without that leg, saying so). Returns the model dirs.

    An exclusive lock on ``out_dir/.build.lock`` lets parallel test sessions or CI jobs
    share one cache dir: the second waits, then finds the models current and skips."""
    out = out_dir if out_dir is not None else default_models_dir()
    out.mkdir(parents=True, exist_ok=True)
    with (out / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        dirs = build_e5(out, force=force, adapted=("int8",))
        for d in dirs:
            install_calibration(d, d.name)
        return (dirs + build_reranker(out, force=force, log=_stderr)
                + (build_shipped_bge(out, force=force) if bge else []))


__all__ = ["MODELS_DIR_ENV", "build_all", "default_models_dir"]
