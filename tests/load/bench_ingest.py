"""Queries while a bulk ingest runs: query p50/p95 idle vs during the ingest, and the
ingest's own docs/s and chunks/s, on our server (a process of its own, passage embeddings
computed for real: the embedding cache points at an empty directory), against the
embedding model's own passage throughput on the same chunk texts, measured in this
process before the server starts (the same calls ingest makes: each document's chunks in
one call, on as many threads as the model pool has; and calls of 16 chunks in a row).

    .venv/bin/python -m tests.load.bench_ingest --docs 1500 --duration 20 [--config ours.toml]
    .venv/bin/python -m tests.load.bench_ingest --docs 0 --lang zh    # every InsuranceQA answer

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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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
        ids = sorted(judged.corpus)[:n] if n > 0 else sorted(judged.corpus)
        return [{"source_id": f"iqa-{i}", "version": "v1", "title": "", "text": judged.corpus[i]} for i in ids]
    except Exception:  # the eval extra is absent: demo texts under new ids
        from service.demo.corpus import DEMO_DOCUMENTS

        return [{**d, "source_id": f"{d['source_id']}-copy{i}"} for i in range(n // len(DEMO_DOCUMENTS) + 1)
                for d in DEMO_DOCUMENTS][:n]


def chunk_batches(docs: Sequence[dict[str, Any]], cfg: Any) -> list[list[str]]:
    """Each document's embedded chunk texts, exactly as the ingestor forms them."""
    from service.ingest.chunking import chunk_document, embedded_text

    batches = []
    for d in docs:
        pieces = chunk_document(d["text"], d.get("breadcrumb", ""), d.get("collection", ""),
                                cfg.chunk_chars, cfg.parent_chars)
        texts = [embedded_text(d["title"], p) for p in pieces]
        batches += [texts[i:i + cfg.embed_batch] for i in range(0, len(texts), cfg.embed_batch)]
    return batches


def bare_passage_rate(batches: list[list[str]], cfg: Any) -> float:
    """Chunks/s of the embedding model alone: tokenize + infer, ``model_workers`` threads."""
    from service.app import _model_dir
    from service.models.onnx_embedder import load_embedder

    embedder = load_embedder(_model_dir(cfg, cfg.embedding_model), threads=cfg.model_threads)
    embedder.infer(embedder.tokenize(["warm up"], "passage"))

    def one(texts: list[str]) -> int:
        embedder.infer(embedder.tokenize(texts, "passage"))
        return len(texts)

    with ThreadPoolExecutor(max_workers=cfg.model_workers) as pool:
        t0 = time.perf_counter()
        chunks = sum(pool.map(one, batches))
        return chunks / (time.perf_counter() - t0)


async def run(args: argparse.Namespace) -> None:
    from service.config import load_config

    cfg = load_config(Path(args.config) if args.config else None)
    docs = documents(args.docs, args.lang)
    batches = chunk_batches(docs, cfg)
    sample = batches[:: max(1, len(batches) // args.bare_sample)] if args.bare_sample else batches
    flat = [t for b in sample for t in b]
    bare_doc = bare_passage_rate(sample, cfg)
    bare_16 = bare_passage_rate([flat[i:i + 16] for i in range(0, len(flat), 16)], cfg)
    bare = max(bare_doc, bare_16)
    print(f"bare model on {len(flat)} of {sum(map(len, batches))} chunk texts: {bare_doc:.1f} chunks/s "
          f"per-document calls, {bare_16:.1f} in calls of 16", flush=True)
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
            t0 = time.monotonic()
            # The ingest as consecutive Ingest calls of --part documents, each timed, so the
            # ingest's rate while queries ran and after they stopped can be told apart.
            parts: list[tuple[float, float, int, int]] = []

            async def ingest_all() -> None:
                for i in range(0, len(docs), args.part):
                    started = time.monotonic()
                    s = await ingest(target, docs[i:i + args.part])
                    parts.append((started, time.monotonic(), s.documents_indexed, s.chunks_indexed))

            job = asyncio.ensure_future(ingest_all())
            await asyncio.sleep(1.0)  # let the ingest reach steady state
            q0 = time.monotonic()
            busy = await closed_loop(call, queries, args.concurrency, duration_s=args.duration)
            q1 = time.monotonic()
            during_ingest = not job.done()
            await job
            elapsed = time.monotonic() - t0
    finally:
        proc.stop()
    n_docs, n_chunks = sum(p[2] for p in parts), sum(p[3] for p in parts)
    print(f"config: {args.config or 'defaults'}; {os.cpu_count()} cores; queries at concurrency {args.concurrency}")
    print("| | query p50 ms | query p95 ms | query/s |")
    print("|---|---|---|---|")
    print(f"| idle | {idle.p(50):.1f} | {idle.p(95):.1f} | {idle.throughput:.1f} |")
    print(f"| during ingest | {busy.p(50):.1f} | {busy.p(95):.1f} | {busy.throughput:.1f} |")
    print(f"p95 during / idle: {busy.p(95) / idle.p(95):.2f}x (ingest still running at the end: {during_ingest})")
    print(f"ingest: {n_docs} docs, {n_chunks} chunks in {elapsed:.1f}s = {n_docs / elapsed:.1f} docs/s, "
          f"{n_chunks / elapsed:.1f} chunks/s = {n_chunks / elapsed / bare:.2f}x the bare model's best "
          f"({bare:.1f} chunks/s)")
    # Each call's chunks are taken as written evenly over its span, so a call that straddles
    # the query window counts for the share of its span inside it.
    def share(p: tuple[float, float, int, int], lo: float, hi: float) -> float:
        span = p[1] - p[0]
        return max(0.0, min(p[1], hi) - max(p[0], lo)) / span if span > 0 else 0.0

    for label, lo, hi in (("while queries ran", q0, q1), ("after the queries, alone", q1, float("inf"))):
        weights = [(share(p, lo, hi), p) for p in parts]
        span = sum(w * (p[1] - p[0]) for w, p in weights)
        if span > 0:
            d, c = sum(w * p[2] for w, p in weights), sum(w * p[3] for w, p in weights)
            print(f"  {label}: {span:.1f}s, {d / span:.1f} docs/s, {c / span:.1f} chunks/s = "
                  f"{c / span / bare:.2f}x the bare model")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=1500)
    p.add_argument("--lang", default="en")
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--config", default="")
    p.add_argument("--part", type=int, default=100, help="documents per Ingest call")
    p.add_argument("--bare-sample", type=int, default=1500,
                   help="document batches the bare model is timed on (0 = all)")
    asyncio.run(run(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
