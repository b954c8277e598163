"""Overload: how each admission setting holds admitted latency at twice its own sustainable rate.

Every setting serves the same data dir (ingested once), one server at a time, alternating
over ``--rounds`` so drift on a shared machine hits them alike. Per setting and round:

1. unloaded: a closed loop at concurrency 1 (p50 / p99: the reference);
2. sustainable: the best goodput (admitted requests/s) of closed loops at ``--levels``;
3. overload: an open loop at ``--factor`` x that rate: shed rate, goodput, admitted p50 /
   p99 (the whole run, and after its first second, once the admission has seen the
   overload), admitted p99 / the unloaded p99, the server's CPU per request, and the load
   generator's own CPU (it shares the cores with the server).

Settings: ``default`` (today's count-only admission, ``max_inflight_attempts`` 64),
``inflight8`` (a count of 8), and ``runN`` (``max_running_attempts = N``: the
latency-bounded admission queue, service/api/attempt_queue.py) for each N in ``--running``.

    .venv/bin/python -m tests.load.bench_overload --insuranceqa en --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from tests.load.bench import Proc, demo_set, ingest, insuranceqa_set
from tests.load.loadgen import closed_loop, grpc_call, open_loop
from tests.support.tcp_proxy import free_port


def settings(running: list[int], target_ms: float, interval_ms: float) -> dict[str, str]:
    out = {"default": "", "inflight8": "max_inflight_attempts = 8\n"}
    for n in running:
        out[f"run{n}"] = (f"max_running_attempts = {n}\nadmission_target_ms = {target_ms}\n"
                          f"admission_interval_ms = {interval_ms}\n")
    return out


def start(data: Path, work: Path, name: str, config: str) -> tuple[Proc, str]:
    port = free_port()
    path = work / f"{name}.toml"
    # The load repeats a fixed question set: a query cache would answer it from memory.
    path.write_text(config + "query_cache_size = 0\n")
    proc = Proc([sys.executable, "-m", "tests.load.serve_ours", "--listen", f"127.0.0.1:{port}",
                 "--data-dir", str(data), "--config", str(path)], "serving on", work / f"{name}.log")
    return proc, f"127.0.0.1:{port}"


def _cpu_self() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def measure(proc: Proc, target: str, queries: list[str], args: argparse.Namespace) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(target) as channel:
        call = grpc_call(channel, "retrieve", rerank=args.rerank, timeout_s=args.timeout)
        await closed_loop(call, queries, 1, duration_s=2.0)  # warm
        unloaded = await closed_loop(call, queries, 1, duration_s=args.duration)
        goodputs = {}
        for c in args.levels:
            goodputs[c] = (await closed_loop(call, queries, c, duration_s=args.duration)).goodput
        sustainable = max(goodputs.values())
        rate = args.factor * sustainable
        cpu0, me0 = proc.cpu_s(), _cpu_self()
        over = await open_loop(call, queries, rate, args.duration)
        cpu, me = proc.cpu_s() - cpu0, _cpu_self() - me0
    ref = unloaded.p(99)
    p99, steady_p99 = over.admitted_p(99), over.admitted_p(99, since_s=1.0)
    return {
        "unloaded_p50_ms": round(unloaded.p(50), 1), "unloaded_p99_ms": round(ref, 1),
        "goodput_by_level": {c: round(g, 1) for c, g in goodputs.items()}, "sustainable": round(sustainable, 1),
        "offered": round(rate, 1), "shed_rate": round(over.outcomes["RESOURCE_EXHAUSTED"] / max(1, over.requests), 3),
        "goodput": round(over.goodput, 1),
        "admitted_p50_ms": round(over.admitted_p(50), 1),
        "admitted_p99_ms": round(p99, 1),
        "steady_p99_ms": round(steady_p99, 1),
        "p99_vs_unloaded": round(p99 / ref, 2) if ref else 0.0,
        "steady_p99_vs_unloaded": round(steady_p99 / ref, 2) if ref else 0.0,
        "server_cpu_ms_per_request": round(1000 * cpu / max(1, over.requests), 2),
        "generator_cpu_share": round(me / over.elapsed_s, 2) if over.elapsed_s else 0.0,
        "outcomes": dict(sorted(over.outcomes.items())),
    }


def markdown(report: dict[str, Any]) -> str:
    out = [f"# Overload at {report['factor']}x each setting's sustainable rate ({report['corpus']}, "
           f"{report['passages']} docs, {report['mode']}, {report['rounds']} rounds, {report['started']})", "",
           "| setting | unloaded p99 | sustainable/s | offered/s | goodput/s | shed | admitted p50 | admitted p99 "
           "| p99 / unloaded | after 1 s: p99 / unloaded | server CPU ms/req | generator CPU |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in report["settings"].items():
        for i, r in enumerate(runs):
            out.append(f"| {name} #{i + 1} | {r['unloaded_p99_ms']} | {r['sustainable']} | {r['offered']} | {r['goodput']} | "
                       f"{r['shed_rate']:.1%} | {r['admitted_p50_ms']} | {r['admitted_p99_ms']} | "
                       f"{r['p99_vs_unloaded']:.2f}x | {r['steady_p99_vs_unloaded']:.2f}x | "
                       f"{r['server_cpu_ms_per_request']} | {r['generator_cpu_share']:.0%} |")
    out += ["", "Medians over the rounds:", "", "| setting | goodput/s | shed | p99 / unloaded | after 1 s |",
            "|---|---|---|---|---|"]
    for name, runs in report["settings"].items():
        def med(key: str) -> float:
            return statistics.median(r[key] for r in runs)
        out.append(f"| {name} | {med('goodput'):.1f} | {med('shed_rate'):.1%} | {med('p99_vs_unloaded'):.2f}x | "
                   f"{med('steady_p99_vs_unloaded'):.2f}x |")
    return "\n".join(out)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.insuranceqa:
        docs, qrels = insuranceqa_set(args.insuranceqa, args.questions, args.corpus_sample, 0)
        corpus = f"insuranceqa-valid-{args.insuranceqa}"
    else:
        docs, qrels = demo_set()
        corpus = "demo"
    queries = list(qrels)
    out = Path(args.out) / time.strftime("%Y%m%dT%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    data = work / "data"
    proc, target = start(data, work, "ingest", "")
    try:
        await ingest(target, docs)
    finally:
        proc.stop()
    chosen = settings(args.running, args.target_ms, args.interval_ms)
    names = [n for n in chosen if n in args.settings] if args.settings else list(chosen)
    report: dict[str, Any] = {"corpus": corpus, "passages": len(docs), "mode": "hybrid+rerank" if args.rerank else "hybrid",
                              "factor": args.factor, "rounds": args.rounds, "argv": sys.argv[1:],
                              "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "configs": {n: chosen[n] for n in names}, "settings": {n: [] for n in names}}
    print(f"{corpus}: {len(docs)} docs, {len(queries)} questions; out {out}", flush=True)
    for rnd in range(args.rounds):
        for name in names:
            proc, target = start(data, work, name, chosen[name])
            try:
                r = await measure(proc, target, queries, args)
            finally:
                proc.stop()
            report["settings"][name].append(r)
            print(f"  round {rnd + 1} {name:<9} unloaded p99 {r['unloaded_p99_ms']} ms, sustainable {r['sustainable']}/s; "
                  f"at {r['offered']}/s: goodput {r['goodput']}/s, shed {r['shed_rate']:.1%}, admitted p99 "
                  f"{r['admitted_p99_ms']} ms ({r['p99_vs_unloaded']}x; after 1 s {r['steady_p99_vs_unloaded']}x)",
                  flush=True)
    (out / "results.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    text = markdown(report)
    (out / "results.md").write_text(text, encoding="utf-8")
    print(text)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".cache/bench-overload")
    p.add_argument("--insuranceqa", choices=["en", "zh"], default="", help="InsuranceQA valid instead of the demo corpus")
    p.add_argument("--questions", type=int, default=50)
    p.add_argument("--corpus-sample", type=int, default=5000)
    p.add_argument("--rerank", action="store_true", help="hybrid + rerank (default: hybrid)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=6.0, help="seconds per closed or open loop")
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 32],
                   help="closed-loop concurrencies whose best goodput is the sustainable rate")
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--timeout", type=float, default=2.0, help="the callers' deadline (s)")
    p.add_argument("--running", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--target-ms", type=float, default=5.0)
    p.add_argument("--interval-ms", type=float, default=50.0)
    p.add_argument("--settings", type=lambda s: s.split(","), default=None, help="only these (e.g. default,run2)")
    args = p.parse_args(argv)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
