"""Two builds of a split reranker, the same reranks, interleaved in one run: what a candidate
(another delta, an extra head term) costs against the served one, as a ratio (absolute times
drift on a shared machine; ratios taken in one run do not).

    .venv/bin/python tests/bench/bench_reranker_pair.py BASE_DIR CANDIDATE_DIR [--lang en] [--queries 40]

Per valid InsuranceQA question (the eval extra): the reranks of ``rerank_drift.py`` (3 judged
answers + 17 random ones, seed 0) as one call each, with the passages' compact states stored (what serving reads; both
builds must share their lower layers and projection, as a candidate of ``split_export --ship``
does). Each rerank runs on both builds, the order alternating per question, after one warm-up
pass. Prints p50 / p90 of a rerank per build, the ratio of the p50s, and the largest logit
difference (0 when the builds differ only in bytes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from service.models.onnx_cross_encoder import OnnxCrossEncoder  # noqa: E402
from tests.bench.rerank_drift import valid_reranks  # noqa: E402


def main(base: Path, candidate: Path, lang: str, n_questions: int, threads: int) -> None:
    models = {"base": OnnxCrossEncoder(base, threads=threads, compact_states=True),
              "candidate": OnnxCrossEncoder(candidate, threads=threads, compact_states=True)}
    keys = {name: model.states_key for name, model in models.items()}
    if keys["base"] is None or keys["base"] != keys["candidate"]:  # one set of stored states must serve both
        raise SystemExit(f"the builds do not share their stored states (states keys {keys}): not a pair this bench compares")
    reranks = [(pairs, models["base"].passage_states([p for _, p in pairs])) for pairs in valid_reranks(lang, n_questions)]
    times: dict[str, list[float]] = {name: [] for name in models}
    worst = 0.0
    for name, model in models.items():  # warm-up: session arenas, first-call allocations
        model.infer(model.tokenize_with_states(*reranks[0]))
    for i, (pairs, states) in enumerate(reranks):
        order = list(models) if i % 2 == 0 else list(reversed(models))
        logits = {}
        for name in order:
            model = models[name]
            t0 = time.perf_counter()
            logits[name] = model.infer(model.tokenize_with_states(pairs, states))
            times[name].append(time.perf_counter() - t0)
        worst = max(worst, float(np.abs(logits["base"] - logits["candidate"]).max()))
    p50 = {name: statistics.median(t) * 1000 for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:9s} {models[name].info.sha256[:12]}  p50 {p50[name]:6.1f} ms  "
              f"p90 {np.percentile(t, 90) * 1000:6.1f} ms  ({len(t)} reranks of 20 pairs, {lang})")
    print(f"candidate / base p50: {p50['candidate'] / p50['base']:.3f}; largest logit difference {worst:.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("candidate", type=Path)
    ap.add_argument("--lang", default="en", choices=["en", "zh"])
    ap.add_argument("--queries", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    main(a.base, a.candidate, a.lang, a.queries, a.threads)
