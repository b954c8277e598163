"""Roofline of the model stages: how close the embedder and the reranker run to what this
machine's GEMMs can do, in one run (ratios; absolute rates drift on a shared machine).

    .venv/bin/python tests/bench/roofline.py [--threads 2] [--seconds 3]

1. Attainable: onnxruntime's own GEMM kernels on BERT-small shapes (hidden 384, FFN 1536,
   rows = batch x tokens), fp32 ``MatMul`` and the int8 path the quantized graphs use
   (``DynamicQuantizeLinear`` + ``MatMulInteger`` as ``quantize_dynamic`` emits,
   with a per-tensor activation scale), GFLOP/s at ``--threads``.
2. FLOPs per item, counted from the padded shapes each inference really runs:
   per encoder layer 2*n*(4*h*h + 2*h*f) for the projections and FFN plus 4*n*n*h for the
   attention products (n tokens, h 384, f 1536); the split reranker runs its 10 lower layers
   on the query and on the passage separately and its 2 joint layers on both.
3. Achieved: the shipped int8 models over real inputs (demo-corpus questions and
   InsuranceQA-like passages of ~120 tokens), as the service runs them: one request's items
   per inference call (batch-invariant int8, see README "Answers do not depend on load"),
   and, for comparison, what 32 concurrent requests' items would give as one batch.

Prints a table: achieved GFLOP/s, the attainable GEMM rate of the same precision, and
their ratio, per stage and shape. Model work only (tokenization excluded, measured apart).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from service.models.onnx_cross_encoder import load_cross_encoder  # noqa: E402
from service.models.onnx_embedder import load_embedder  # noqa: E402
from service.offline.builder import default_models_dir  # noqa: E402

H, F, LAYERS, LOWER, JOINT = 384, 1536, 12, 10, 2
QUERIES = ["how do I reset my password", "can I get a PDF invoice for my subscription", "what changed in v2.4",
           "如何开具发票", "the app crashes when I upload a large file", "who approves refunds above the limit"]
PASSAGE = ("Life insurance pays a death benefit to the beneficiaries named in the policy when the insured "
           "person dies while the policy is in force. Term policies cover a fixed period and build no cash "
           "value; whole life policies last for life and accumulate cash value that the owner can borrow "
           "against. Premiums depend on age, health, the amount of coverage and the length of the term, and "
           "an underwriter may ask for a medical exam before the policy is issued.")


def layer_flops(n: int) -> float:
    return 2.0 * n * (4 * H * H + 2 * H * F) + 4.0 * n * n * H


def _timed(fn, seconds: float) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    runs, start = 0, time.perf_counter()
    while True:
        fn()
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and runs >= 3:
            return elapsed / runs


def gemm_rate(rows: int, k: int, n: int, int8: bool, threads: int, seconds: float) -> float:
    """GFLOP/s of one [rows, k] x [k, n] product in onnxruntime (fp32, or int8 as quantized graphs run it)."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [rows, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT if not int8 else TensorProto.INT32, None)
    w = np.random.default_rng(0).normal(size=(k, n)).astype(np.float32)
    if int8:
        wq = np.clip(np.round(w / (np.abs(w).max(axis=0) / 127)), -127, 127).astype(np.int8)
        nodes = [helper.make_node("DynamicQuantizeLinear", ["a"], ["aq", "as", "az"]),
                 helper.make_node("MatMulInteger", ["aq", "w", "az", "wz"], ["y"])]
        inits = [helper.make_tensor("w", TensorProto.INT8, [k, n], wq.tobytes(), raw=True),
                 helper.make_tensor("wz", TensorProto.INT8, [n], np.zeros(n, np.int8).tobytes(), raw=True)]
    else:
        nodes = [helper.make_node("MatMul", ["a", "w"], ["y"])]
        inits = [helper.make_tensor("w", TensorProto.FLOAT, [k, n], w.tobytes(), raw=True)]
    model = helper.make_model(helper.make_graph(nodes, "gemm", [a], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).normal(size=(rows, k)).astype(np.float32)
    t = _timed(lambda: sess.run(None, {"a": x}), seconds)
    return 2.0 * rows * k * n / t / 1e9


def attainable(rows: int, int8: bool, threads: int, seconds: float) -> float:
    """The FLOP-weighted GEMM rate of one encoder layer's products at this row count."""
    shapes = [(H, H)] * 4 + [(H, F), (F, H)]
    flops = [2.0 * rows * k * n for k, n in shapes]
    times = [f / (gemm_rate(rows, k, n, int8, threads, seconds / 3) * 1e9) for f, (k, n) in zip(flops, shapes)]
    return sum(flops) / sum(times) / 1e9


def op_profile(model_path: Path, feeds: dict[str, np.ndarray], threads: int, runs: int = 20) -> list[tuple[str, float]]:
    """Share of kernel time per op type (onnxruntime's profiler): where the time off the GEMMs goes."""
    import collections
    import json

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.enable_profiling = True
    opts.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort")
    sess = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
    for _ in range(runs):
        sess.run(None, feeds)
    events = json.loads(Path(sess.end_profiling()).read_text())
    spent: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            spent[e["args"]["op_name"]] += e["dur"]
    total = sum(spent.values()) or 1
    return [(op, us / total) for op, us in spent.most_common(6)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, default=32, help="requests whose items one batch would merge")
    a = p.parse_args(argv)
    models = default_models_dir()
    emb = load_embedder(models / "multilingual-e5-small-int8", threads=a.threads)
    ce = load_cross_encoder(models / "e5-small-split-reranker-int8", threads=a.threads)
    rows = []

    def add(stage: str, shape: str, flops_per_call: float, seconds_per_call: float, items: int, tokens: int) -> None:
        rate = flops_per_call / seconds_per_call / 1e9
        peak = attainable(max(1, tokens), True, a.threads, a.seconds)
        rows.append((stage, shape, items / seconds_per_call, rate, peak, rate / peak))

    # Embedding: a query alone (what one Retrieve embeds), 32 queries as one batch, passages.
    for label, texts, kind in (("query, 1 per call", QUERIES[:1], "query"),
                               (f"queries, {a.concurrency} per call", (QUERIES * 8)[: a.concurrency], "query"),
                               ("passages, 8 per call", [PASSAGE] * 8, "passage")):
        enc = emb.tokenize(list(texts), kind)  # type: ignore[arg-type]
        b, n = enc.input_ids.shape
        t = _timed(lambda: emb.infer(enc), a.seconds)
        add("embed", f"{label} (padded {n} tokens)", b * LAYERS * layer_flops(n), t, b, b * n)
    # Rerank: 20 pairs of one request (the service's rerank head), and that x concurrency.
    for label, copies in (("20 pairs of one request", 1), (f"20 pairs x {min(a.concurrency, 4)} requests", min(a.concurrency, 4))):
        pairs = [(QUERIES[i % len(QUERIES)], PASSAGE) for i in range(20 * copies)]
        enc = ce.tokenize(pairs)
        nq = int(enc.extra["query_ids"].shape[1]) if "query_ids" in enc.extra else 0
        b, npass = enc.input_ids.shape
        flops = b * (LOWER * (layer_flops(nq) + layer_flops(npass)) + JOINT * layer_flops(nq + npass))
        t = _timed(lambda: ce.infer(enc), a.seconds)
        add("rerank", f"{label} (query {nq}, passage {npass} tokens)", flops, t, b, b * (nq + npass))
    fp32 = attainable(4096, False, a.threads, a.seconds)
    int8 = attainable(4096, True, a.threads, a.seconds)
    print(f"\nGEMM, one encoder layer's products, 4096 rows, {a.threads} threads: fp32 {fp32:.1f} GFLOP/s, "
          f"int8 {int8:.1f} GOP/s ({int8 / fp32:.2f}x fp32)\n")
    print("| stage | shape | items/s | achieved GFLOP/s | attainable int8 GEMM at these rows | achieved / attainable |")
    print("|---|---|---|---|---|---|")
    for stage, shape, items, rate, peak, ratio in rows:
        print(f"| {stage} | {shape} | {items:.0f} | {rate:.1f} | {peak:.1f} | {ratio:.0%} |")
    enc = emb.tokenize([PASSAGE] * 8, "passage")
    shares = op_profile(models / "multilingual-e5-small-int8" / "model.onnx",
                        {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}, a.threads)
    print("\nembedder, passages 8 per call, kernel time by op: "
          + ", ".join(f"{op} {share:.0%}" for op, share in shares))
    return 0


if __name__ == "__main__":
    sys.exit(main())
