"""Queries while a bulk ingest runs: query p50/p95 idle vs during the ingest, and the
ingest's own docs/s and chunks/s, on our server (a process of its own, passage embeddings
computed for real: the embedding cache points at an empty directory).

    .venv/bin/python -m tests.load.bench_ingest --docs 1500 --duration 20 [--config ours.toml]

Documents are InsuranceQA answers (the `eval` extra) in --lang, else the demo corpus
repeated under new ids.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from tests.load.bench import Proc, ingest
from tests.load.loadgen import closed_loop, grpc_call
from tests.support.demo_expectations import RANKING_CASES
from tests.support.tcp_proxy import free_port


def documents(n: int, lang: str) -> list[dict[str, Any]]:
    try:
        from service.eval.datasets import load_insuranceqa

        judged = load_insuranceqa("valid", lang)
        ids = sorted(judged.corpus)[:n]
        return [{"source_id": f"iqa-{i}", "version": "v1", "title": "", "text": judged.corpus[i]} for i in ids]
    except Exception:  # the eval extra is absent: demo texts under new ids
        from service.demo.corpus import DEMO_DOCUMENTS

        return [{**d, "source_id": f"{d['source_id']}-copy{i}"} for i in range(n // len(DEMO_DOCUMENTS) + 1)
                for d in DEMO_DOCUMENTS][:n]


async def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    port = free_port()
    argv = [sys.executable, "-m", "tests.load.serve_ours", "--listen", f"127.0.0.1:{port}", "--data-dir",
            str(work / "data"), "--reranker-model", ""]
    if args.config:
        argv += ["--config", args.config]
    os.environ["RETRIEVAL_EMBEDDINGS_CACHE"] = str(work / "no-cache")
    proc = Proc(argv, "serving on", work / "ours.log")
    target = f"127.0.0.1:{port}"
    try:
        from service.demo.corpus import DEMO_DOCUMENTS

        await ingest(target, DEMO_DOCUMENTS)
        queries = [q for q, _ in RANKING_CASES]
        async with grpc.aio.insecure_channel(target) as channel:
            call = grpc_call(channel, "retrieve", rerank=False)
            await closed_loop(call, queries, 1, requests=8)
            idle = await closed_loop(call, queries, args.concurrency, duration_s=args.duration)
            docs = documents(args.docs, args.lang)
            t0 = time.monotonic()
            job = asyncio.ensure_future(ingest(target, docs))
            await asyncio.sleep(1.0)  # let the ingest reach steady state
            busy = await closed_loop(call, queries, args.concurrency, duration_s=args.duration)
            during_ingest = not job.done()
            summary = await job
            elapsed = time.monotonic() - t0
    finally:
        proc.stop()
    print(f"config: {args.config or 'defaults'}; {os.cpu_count()} cores; queries at concurrency {args.concurrency}")
    print("| | query p50 ms | query p95 ms | query/s |")
    print("|---|---|---|---|")
    print(f"| idle | {idle.p(50):.1f} | {idle.p(95):.1f} | {idle.throughput:.1f} |")
    print(f"| during ingest | {busy.p(50):.1f} | {busy.p(95):.1f} | {busy.throughput:.1f} |")
    print(f"p95 during / idle: {busy.p(95) / idle.p(95):.2f}x (ingest still running at the end: {during_ingest})")
    print(f"ingest: {summary.documents_indexed} docs, {summary.chunks_indexed} chunks in {elapsed:.1f}s = "
          f"{summary.documents_indexed / elapsed:.1f} docs/s, {summary.chunks_indexed / elapsed:.1f} chunks/s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=1500)
    p.add_argument("--lang", default="en")
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--config", default="")
    asyncio.run(run(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
