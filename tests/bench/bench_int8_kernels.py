"""What the exact int8 kernels cost: each shipped int8 graph timed with serving's options plus
``session.x64quantprecision`` (onnxruntime's exact u8u8 kernels) against the same options
without it (the fast u8s8 kernels), in one run, alternating, on the same inputs; plus how far
the fast kernels' outputs stray, and which of the two serving picks here
(``_ort.u8s8_saturates``: the exact ones only where the fast ones saturate).

    RETRIEVAL_MODELS_DIR=... .venv/bin/python tests/bench/bench_int8_kernels.py [--repeats 15]

Without VNNI (AVX2, AVX-512 without VNNI) the fast kernels stray and the exact ones cost
~1.2x (AMD EPYC, 2026-12-04). With VNNI both are exact (difference 0), yet onnxruntime still
applies the entry, and it cost 1.85-1.92x (Xeon with AVX-512 VNNI, 2026-12-05): why serving
probes instead of always setting it. Prints the CPU's flags first.
Shapes are serving's: an embedding batch of 32 passages at 128 tokens, a rerank of 20 pairs
(query 16 tokens, passage 128), through the one graph and through lower + joint.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

from service.models._ort import _unshared_int8_weights, session_options, u8s8_saturates  # noqa: E402
from service.offline.builder import default_models_dir  # noqa: E402


def bench_session(path: Path, threads: int, exact: bool = False) -> Any:
    """Serving's options, with or without the exact-kernel entry."""
    opts = session_options(threads, exact_int8=exact)
    opts.log_severity_level = 4  # the exact kernels' expected refusal of shared weights, as serving
    try:
        return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - same fallback as serving, for a like-for-like graph
        return ort.InferenceSession(_unshared_int8_weights(path), sess_options=opts, providers=["CPUExecutionProvider"])


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    have = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    # What CPUID tells this process (numpy asks it as onnxruntime does): less than the kernel
    # lists under tests/support/avx2_cpu.py.
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as seen
    except ImportError:
        seen = {}
    said = [f for f in ("AVX2", "AVX512F", "AVX512VNNI") if seen.get(f)]
    return f"{model}: {' '.join(have) or 'no avx2'} (CPUID here: {' '.join(said) or '?'})"


def inputs(rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    def ids(b: int, s: int) -> np.ndarray:
        a = rng.integers(5, 30000, size=(b, s), dtype=np.int64)
        a[:, 0], a[:, -1] = 0, 2
        return a

    ones = lambda b, s: np.ones((b, s), dtype=np.int64)  # noqa: E731
    return {
        "embed": {"input_ids": ids(32, 128), "attention_mask": ones(32, 128)},
        "one_graph": {"query_ids": ids(20, 16), "query_mask": ones(20, 16),
                      "passage_ids": ids(20, 128), "passage_mask": ones(20, 128)},
        "lower": {"input_ids": ids(21, 128), "attention_mask": ones(21, 128)},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    models = default_models_dir()
    emb = models / "multilingual-e5-small-int8" / "model.onnx"
    rr = models / "e5-small-split-reranker-int8"
    feeds = inputs(np.random.default_rng(0))
    print(cpu_flags())
    print("serving runs the", "exact kernels (the fast ones saturate here)" if u8s8_saturates()
          else "fast kernels (exact here)")
    print(f"{'graph':<28} {'exact p50 ms':>12} {'fast p50 ms':>12} {'exact/fast':>10} {'max |exact-fast|':>17}")
    lower_exact = bench_session(rr / "lower.onnx", a.threads, exact=True)
    lower_fast = bench_session(rr / "lower.onnx", a.threads)
    # The joint graph's inputs: the lower layers' states for a 16-token query and 20 passages.
    states = lower_exact.run(None, feeds["lower"])[0].astype(np.float32)
    feeds["joint"] = {"query_states": np.repeat(states[:1, :16], 20, axis=0), "query_mask": np.ones((20, 16), dtype=np.int64),
                      "passage_states": states[1:], "passage_mask": np.ones((20, 128), dtype=np.int64)}
    rows = [("embedder (32 x 128)", emb, "embed"), ("split one graph (20 pairs)", rr / "model.onnx", "one_graph"),
            ("split lower (21 x 128)", rr / "lower.onnx", "lower"), ("split joint (20 pairs)", rr / "joint.onnx", "joint")]
    for label, path, feed_name in rows:
        exact = lower_exact if path.name == "lower.onnx" else bench_session(path, a.threads, exact=True)
        fast = lower_fast if path.name == "lower.onnx" else bench_session(path, a.threads)
        feed = feeds[feed_name]
        t_exact: list[float] = []
        t_fast: list[float] = []
        exact.run(None, feed)
        fast.run(None, feed)
        for _ in range(a.repeats):
            for sess, times in ((exact, t_exact), (fast, t_fast)):
                t0 = time.perf_counter()
                sess.run(None, feed)
                times.append((time.perf_counter() - t0) * 1000)
        diff = float(np.abs(exact.run(None, feed)[0].astype(np.float64) - fast.run(None, feed)[0]).max())
        pe, pf = statistics.median(t_exact), statistics.median(t_fast)
        print(f"{label:<28} {pe:>12.1f} {pf:>12.1f} {pe / pf:>10.2f} {diff:>17.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
