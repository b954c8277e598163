"""`make bench`: our server and the baseline (tests/load/baseline.py) in the same run, on the
same corpus, questions and models, under the same load generator (tests/load/loadgen.py).

For each mode (hybrid; hybrid + rerank) it prints nDCG@10 of both on the judged questions,
closed-loop throughput / p50 / p95 / p99 / server CPU ms per query / outcome mix at each
concurrency, our ratios to the baseline, an open-loop run at half and twice our sustainable
rate (shed rate, p99 of admitted requests), the event-loop lag p99 from our /metrics, and
whether the scraped attempt counts equal what the generator saw; it writes results.json and
one PNG per mode (throughput vs p50 and p99 across concurrency, ours and baseline's).

Both servers run as their own processes (CPU seconds are each server's own, read with
psutil); the generator runs here. Corpora: the demo corpus (always, judged by
tests/support/demo_expectations.RANKING_CASES), and with --insuranceqa the InsuranceQA valid
questions on a seeded sample of its answer corpus (the `eval` extra).

    .venv/bin/python -m tests.load.bench --out .cache/bench --concurrency 1,4,16,32 --duration 8
    .venv/bin/python -m tests.load.bench --insuranceqa en --questions 100 --corpus-sample 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import psutil

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc
from service.eval.metrics import ndcg_at_k
from tests.load.loadgen import RunStats, closed_loop, grpc_call, open_loop
from tests.support.scrape import Samples, by_label, scrape
from tests.support.tcp_proxy import free_port

REPO = Path(__file__).resolve().parents[2]
MODES = {"hybrid": False, "hybrid+rerank": True}


class Proc:
    """A server process we started, with its CPU time."""

    def __init__(self, argv: list[str], ready_marker: str, log: Path, timeout_s: float = 600.0) -> None:
        self.log = log
        fh = log.open("w")
        self.popen = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO,
                                      env={**os.environ, "PYTHONPATH": str(REPO)})
        self.ps = psutil.Process(self.popen.pid)
        until = time.monotonic() + timeout_s
        while ready_marker not in log.read_text(errors="replace"):
            if self.popen.poll() is not None or time.monotonic() > until:
                raise RuntimeError(f"{argv[2:4]} did not start; see {log}:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.popen.kill()


def demo_set() -> tuple[list[dict[str, Any]], dict[str, set[str]]]:
    from service.demo.corpus import DEMO_DOCUMENTS
    from tests.support.demo_expectations import RANKING_CASES

    return list(DEMO_DOCUMENTS), {q: {src} for q, src in RANKING_CASES}


def insuranceqa_set(lang: str, questions: int, corpus_sample: int, seed: int) -> tuple[list[dict[str, Any]], dict[str, set[str]]]:
    from service.eval.datasets import load_insuranceqa

    judged = load_insuranceqa("valid", lang).sample(questions, seed).sample_corpus(corpus_sample or None, seed)
    docs = [judged.document(d) for d in judged.corpus]
    qrels = {judged.queries[q]: judged.qrels[q] for q in judged.queries}
    return docs, qrels


async def ingest(target: str, docs: Sequence[dict[str, Any]]) -> corpus_pb2.IngestSummary:
    from service._gen.retrieval.v1 import types_pb2

    coll = {"doc": types_pb2.COLLECTION_DOC, "faq": types_pb2.COLLECTION_FAQ}
    status = {"approved": types_pb2.SOURCE_STATUS_APPROVED, "draft": types_pb2.SOURCE_STATUS_DRAFT,
              "retired": types_pb2.SOURCE_STATUS_RETIRED}

    async def stream() -> AsyncIterator[corpus_pb2.IngestRequest]:
        for d in docs:
            yield corpus_pb2.IngestRequest(document=corpus_pb2.Document(
                source_id=d["source_id"], version=d.get("version", "v1"), title=d.get("title", ""), text=d["text"],
                collection=coll[d.get("collection", "doc")], status=status[d.get("status", "approved")],
                acl=d.get("acl", []), breadcrumb=d.get("breadcrumb", ""), metadata=d.get("metadata", {})))

    async with grpc.aio.insecure_channel(target) as channel:
        summary: corpus_pb2.IngestSummary = await corpus_pb2_grpc.CorpusServiceStub(channel).Ingest(stream(), timeout=3600)
    return summary


def lag_p99_ms(before: Samples, after: Samples) -> float:
    """p99 of the event-loop lag over a run, from the histogram's bucket deltas (the upper
    bound of the bucket holding the 99th percentile)."""
    buckets = sorted((float(dict(labels)["le"]), v - before.get((n, labels), 0.0))
                     for (n, labels), v in after.items() if n == "retrieval_event_loop_lag_seconds_bucket")
    total = buckets[-1][1] if buckets else 0.0
    for le, count in buckets:
        if total and count >= 0.99 * total:
            return le * 1000
    return 0.0


def _delta(before: Samples, after: Samples, name: str, label: str) -> dict[str, float]:
    """Per-label increase of a counter summed over its other labels."""
    out: dict[str, float] = {}
    for (n, labels), v in after.items():
        if n == name:
            key = dict(labels)[label]
            out[key] = out.get(key, 0.0) + v - before.get((n, labels), 0.0)
    return out


def outcome_delta(before: Samples, after: Samples) -> dict[str, int]:
    b, a = by_label(before, "retrieval_attempts_total", "outcome"), by_label(after, "retrieval_attempts_total", "outcome")
    return {k: int(v - b.get(k, 0.0)) for k, v in a.items() if v - b.get(k, 0.0)}


async def quality(target: str, qrels: dict[str, set[str]], rerank: bool) -> tuple[float, RunStats]:
    """nDCG@10 over the judged questions, one at a time (also the concurrency-1 latency)."""
    ranked: dict[str, list[str]] = {}
    async with grpc.aio.insecure_channel(target) as channel:
        call = grpc_call(channel, "retrieve", rerank=rerank, timeout_s=60, ranked=ranked)
        stats = await closed_loop(call, list(qrels), 1, requests=len(qrels), label="quality")
    scores = [ndcg_at_k(ranked.get(q, []), rel, 10) for q, rel in qrels.items()]
    return sum(scores) / len(scores), stats


async def load_runs(name: str, proc: Proc, target: str, queries: list[str], rerank: bool, levels: list[int],
                    duration: float, metrics_url: str = "") -> list[dict[str, Any]]:
    rows = []
    async with grpc.aio.insecure_channel(target) as channel:
        call = grpc_call(channel, "retrieve", rerank=rerank, timeout_s=30)
        await closed_loop(call, queries, 2, requests=4)  # warm the channel and the models
        for c in levels:
            before = await asyncio.to_thread(scrape, metrics_url) if metrics_url else {}
            cpu0 = proc.cpu_s()
            stats = await closed_loop(call, queries, c, duration_s=duration, label=name)
            stats.cpu_s = proc.cpu_s() - cpu0
            row = stats.summary()
            if metrics_url:
                after = await asyncio.to_thread(scrape, metrics_url)
                seen = {k: v for k, v in stats.outcomes.items() if k != "RESOURCE_EXHAUSTED"}
                row["scraped_attempts"] = outcome_delta(before, after)
                row["metrics_consistent"] = row["scraped_attempts"] == seen
                row["event_loop_lag_p99_ms"] = lag_p99_ms(before, after)
            rows.append(row)
            print(f"  {name:<9} c={c:<3} {row['throughput']:7.1f}/s p50 {row['p50_ms']:8.1f} p99 {row['p99_ms']:8.1f} ms"
                  f" cpu {row['cpu_ms_per_query']:7.1f} ms/q {dict(stats.outcomes)}", flush=True)
    return rows


async def overload(proc: Proc, target: str, queries: list[str], rerank: bool, sustainable: float,
                   duration: float, metrics_url: str, timeout_s: float) -> list[dict[str, Any]]:
    rows = []
    async with grpc.aio.insecure_channel(target) as channel:
        call = grpc_call(channel, "retrieve", rerank=rerank, timeout_s=timeout_s)
        for factor in (0.5, 2.0):
            before = await asyncio.to_thread(scrape, metrics_url)
            cpu0 = proc.cpu_s()
            stats = await open_loop(call, queries, max(1.0, factor * sustainable), duration, label=f"{factor}x")
            stats.cpu_s = proc.cpu_s() - cpu0
            after = await asyncio.to_thread(scrape, metrics_url)
            row = stats.summary()
            dropped = {k: int(v) for k, v in _delta(before, after, "retrieval_model_dropped_items_total", "reason").items() if v}
            ran = int(sum(_delta(before, after, "retrieval_model_batch_size_sum", "model").values()))
            row.update(model_items_run=ran, model_items_dropped=dropped)
            row.update(factor=factor, shed_rate=round(stats.outcomes["RESOURCE_EXHAUSTED"] / max(1, stats.requests), 3),
                       admitted_p99_ms=round(stats.admitted_p(99), 1),
                       shed_scraped=int(sum(by_label(after, "retrieval_shed_total", "reason").values())
                                        - sum(by_label(before, "retrieval_shed_total", "reason").values())))
            rows.append(row)
            print(f"  open loop {factor}x ({row['rate']:.1f}/s offered): {row['throughput']:.1f}/s answered, "
                  f"{row['goodput']:.1f}/s admitted, shed "
                  f"{row['shed_rate']:.1%}, admitted p99 {row['admitted_p99_ms']} ms {dict(stats.outcomes)}", flush=True)
    return rows


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def markdown(report: dict[str, Any]) -> str:
    out = [f"# Bench {report['corpus']} ({report['passages']} docs, {report['questions']} questions), "
           f"{report['cores']} cores, {report['started']}", ""]
    for mode, m in report["modes"].items():
        out += [f"## {mode}", "",
                f"nDCG@10: ours {m['ndcg_ours']:.3f}, baseline {m['ndcg_baseline']:.3f}; "
                f"p50 at concurrency 1 (quality pass): ours {m['c1_p50_ours']:.1f} ms, baseline "
                f"{m['c1_p50_baseline']:.1f} ms ({ratio(m['c1_p50_ours'], m['c1_p50_baseline'])})", "",
                "| concurrency | ours req/s | base req/s | ratio | ours p50 | base p50 | ours p95 | ours p99 | base p99 "
                "| ours CPU ms/q | base CPU ms/q | ours outcomes | base outcomes | metrics = generator | loop lag p99 ms |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for o, b in zip(m["ours"], m["baseline"]):
            out.append(f"| {o['concurrency']} | {o['throughput']:.1f} | {b['throughput']:.1f} | "
                       f"{ratio(o['throughput'], b['throughput'])} | {o['p50_ms']:.1f} | {b['p50_ms']:.1f} | "
                       f"{o['p95_ms']:.1f} | {o['p99_ms']:.1f} | {b['p99_ms']:.1f} | {o['cpu_ms_per_query']:.1f} | "
                       f"{b['cpu_ms_per_query']:.1f} | {o['outcomes']} | {b['outcomes']} | "
                       f"{o.get('metrics_consistent')} | {o.get('event_loop_lag_p99_ms', 0):.1f} |")
        if m.get("overload"):
            # The unloaded p99: ours alone at concurrency 1 in this run (when that level ran).
            unloaded = next((o["p99_ms"] for o in m["ours"] if o["concurrency"] == 1), 0.0)
            out += ["", "| open loop | offered/s | answered/s | admitted/s | shed rate | p50 | admitted p99 "
                    "| vs unloaded p99 (c=1) | shed (metric) | model items run | model items dropped unrun "
                    "| server CPU ms/request | outcomes |",
                    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in m["overload"]:
                out.append(f"| {r['factor']}x | {r['rate']:.1f} | {r['throughput']:.1f} | {r['goodput']:.1f} | {r['shed_rate']:.1%} | "
                           f"{r['p50_ms']:.1f} | {r['admitted_p99_ms']:.1f} | {ratio(r['admitted_p99_ms'], unloaded)} | "
                           f"{r['shed_scraped']} | "
                           f"{r.get('model_items_run')} | {r.get('model_items_dropped')} | {r['cpu_ms_per_query']:.1f} | "
                           f"{r['outcomes']} |")
        out.append("")
    return "\n".join(out)


def plot(mode: str, m: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, style, color in (("ours", "-", "tab:blue"), ("baseline", "--", "tab:orange")):
        rows = m[name]
        tput = [r["throughput"] for r in rows]
        for q, marker in (("p50_ms", "o"), ("p99_ms", "^")):
            ax.plot(tput, [r[q] for r in rows], style, color=color, marker=marker, label=f"{name} {q[:3]}")
            for r, x in zip(rows, tput):
                if q == "p99_ms":
                    ax.annotate(f"c={r['concurrency']}", (x, r[q]), fontsize=7)
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{mode}: throughput vs latency across concurrency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.insuranceqa:
        docs, qrels = insuranceqa_set(args.insuranceqa, args.questions, args.corpus_sample, args.seed)
        corpus = f"insuranceqa-valid-{args.insuranceqa}"
    else:
        docs, qrels = demo_set()
        corpus = "demo"
    out = Path(args.out) / time.strftime("%Y%m%dT%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    corpus_file = work / "corpus.jsonl"
    corpus_file.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    port, mport, bport = free_port(), free_port(), free_port()
    ours_argv = [sys.executable, "-m", "tests.load.serve_ours", "--listen", f"127.0.0.1:{port}",
                 "--metrics-listen", f"127.0.0.1:{mport}", "--data-dir", str(work / "data")]
    config = work / "ours.toml"
    # The query embedding cache is off unless asked for: the load repeats a fixed question
    # set, which a cache would answer from memory after the first pass.
    config.write_text((Path(args.config).read_text() if args.config else "")
                      + ("" if args.query_cache else "\nquery_cache_size = 0\n"))
    ours_argv += ["--config", str(config)]
    levels = [int(c) for c in args.concurrency.split(",")]
    queries = list(qrels)
    report: dict[str, Any] = {"corpus": corpus, "passages": len(docs), "questions": len(qrels), "cores": os.cpu_count(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "modes": {},
                              "argv": sys.argv[1:], "query_cache": args.query_cache}
    print(f"corpus {corpus}: {len(docs)} documents, {len(qrels)} questions; out {out}", flush=True)
    ours = Proc(ours_argv, "serving on", work / "ours.log")
    base = None
    try:
        t0 = time.monotonic()
        summary = await ingest(f"127.0.0.1:{port}", docs)
        report["ingest"] = {"documents": summary.documents_indexed, "chunks": summary.chunks_indexed,
                            "seconds": round(time.monotonic() - t0, 1), "errors": len(summary.errors)}
        print(f"ours ingested {report['ingest']}", flush=True)
        base = Proc([sys.executable, "-m", "tests.load.baseline", "--corpus", str(corpus_file),
                     "--listen", f"127.0.0.1:{bport}"], "baseline serving", work / "baseline.log")
        metrics_url = f"http://127.0.0.1:{mport}/metrics"
        for mode in args.modes.split(","):
            rerank = MODES[mode]
            print(f"[{mode}]", flush=True)
            m: dict[str, Any] = {}
            m["ndcg_ours"], q_ours = await quality(f"127.0.0.1:{port}", qrels, rerank)
            m["ndcg_baseline"], q_base = await quality(f"127.0.0.1:{bport}", qrels, rerank)
            m["c1_p50_ours"], m["c1_p50_baseline"] = q_ours.p(50), q_base.p(50)
            print(f"  nDCG@10 ours {m['ndcg_ours']:.3f} baseline {m['ndcg_baseline']:.3f}; c=1 p50 "
                  f"{m['c1_p50_ours']:.1f} vs {m['c1_p50_baseline']:.1f} ms", flush=True)
            m["ours"] = await load_runs("ours", ours, f"127.0.0.1:{port}", queries, rerank, levels, args.duration,
                                        metrics_url)
            m["baseline"] = await load_runs("baseline", base, f"127.0.0.1:{bport}", queries, rerank, levels,
                                            args.duration)
            if args.overload:
                # Admitted requests only: with a running limit a closed loop is partly shed.
                sustainable = max(r["goodput"] for r in m["ours"])
                m["overload"] = await overload(ours, f"127.0.0.1:{port}", queries, rerank, sustainable,
                                               args.duration, metrics_url, args.overload_timeout)
            report["modes"][mode] = m
            plot(mode, m, out / f"{mode.replace('+', '_')}.png")
    finally:
        ours.stop()
        if base is not None:
            base.stop()
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
    text = markdown(report)
    (out / "results.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out}/results.json, results.md and one PNG per mode", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".cache/bench")
    p.add_argument("--modes", default="hybrid,hybrid+rerank")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per load level")
    p.add_argument("--overload", action=argparse.BooleanOptionalAction, default=True,
                   help="open loop at 0.5x and 2x our best closed-loop throughput")
    p.add_argument("--overload-timeout", type=float, default=10.0,
                   help="client deadline (s) in the open-loop runs: expired work must stop using CPU")
    p.add_argument("--insuranceqa", choices=["en", "zh"], default="", help="InsuranceQA valid instead of the demo corpus")
    p.add_argument("--questions", type=int, default=100)
    p.add_argument("--corpus-sample", type=int, default=5000, help="answers kept (0: all 27,413)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="", help="TOML config for our server")
    p.add_argument("--query-cache", action="store_true", help="keep our query embedding cache on (default: off)")
    args = p.parse_args(argv)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
