"""What the Latin-script dense leg costs: ingest throughput and warm single-query latency with
the leg on (bge-small-en beside e5) against off, in the same run (absolute times drift on a
shared machine; ratios do not).

    .venv/bin/python tests/bench/bench_latin_leg.py [--docs 300] [--queries 40]

Corpus: InsuranceQA valid answers, English and Chinese (their questions' judged answers
first), so the English chunks get the second vector and the Chinese ones do not; queries:
their questions, each asked once per mode with a distinct suffix (the query-embedding cache
would otherwise answer). Prints ingest chunks/s, and p50/p95 of hybrid Retrieve (rerank off)
and hybrid + rerank (the shipped reranker, passage states computed) per language. Then the
upgrade: a server with the leg starts on the store ingested without it and catches it up
(service/ingest/backfill.py); prints the Latin-script chunks/s it stored, against ingest.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc  # noqa: E402

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc, types_pb2  # noqa: E402
from service.api.server import Server  # noqa: E402
from service.app import DEFAULT_LATIN_EMBEDDER, App  # noqa: E402
from service.config import Config  # noqa: E402
from service.eval.metrics import percentile  # noqa: E402
from tests.bench.bench_rerank_states import corpus, timed_ingest  # noqa: E402


@dataclasses.dataclass
class Run:
    ingest_s: float = 0.0
    chunks: int = 0
    hybrid: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    reranked: dict[str, list[float]] = dataclasses.field(default_factory=dict)


async def serve(latin: str, docs: list[corpus_pb2.Document], queries: dict[str, list[str]], tag: str,
                data_dir: Path | None = None) -> Run:
    run = Run()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dataclasses.replace(Config(), data_dir=data_dir or Path(tmp), latin_embedding_model=latin,
                                  reranker_model="auto")
        app = App.build(cfg)
        server = Server(app)
        port = await server.start("127.0.0.1:0")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            corpus_stub = corpus_pb2_grpc.CorpusServiceStub(ch)
            retrieval = retrieval_pb2_grpc.RetrievalServiceStub(ch)

            run.ingest_s, run.chunks = await timed_ingest(corpus_stub, docs)

            async def timed(lang: str, rerank: int, suffix: str) -> list[float]:
                out = []
                for i, q in enumerate(queries[lang]):
                    req = retrieval_pb2.RetrieveRequest(query=f"{q} {suffix}{i}", top_k=5, options=retrieval_pb2.RetrievalOptions(
                        rerank=rerank, min_quality=1e-9))
                    t = time.perf_counter()
                    async for _ in retrieval.Retrieve(req):
                        pass
                    out.append((time.perf_counter() - t) * 1000)
                return out

            for lang in queries:
                await timed(lang, types_pb2.RERANK_MODE_ON, f"warm-{tag}")
                run.hybrid[lang] = await timed(lang, types_pb2.RERANK_MODE_OFF, f"h-{tag}")
                run.reranked[lang] = await timed(lang, types_pb2.RERANK_MODE_ON, f"r-{tag}")
        await server.stop(0.5)
    return run


async def catch_up(data_dir: Path, chunks: int) -> tuple[float, int]:
    """Start a server with the leg on a store of ``chunks`` ingested without it; seconds from
    start until the backfill is done, and how many chunks it gave the vector (all but the
    ones still without: the Han ones)."""
    from service.engines.base import VectorField

    cfg = dataclasses.replace(Config(), data_dir=data_dir, latin_embedding_model=DEFAULT_LATIN_EMBEDDER,
                              reranker_model="")
    app = App.build(cfg)
    server = Server(app)
    started = time.perf_counter()
    await server.start("127.0.0.1:0")
    if app.latin_backfill is not None:
        await app.latin_backfill
    seconds = time.perf_counter() - started
    after = len(await app.engine.chunks_without(VectorField.LATIN, "", 1_000_000))
    await server.stop(0.5)
    return seconds, chunks - after


async def main(n_docs: int, n_queries: int) -> None:
    docs: list[corpus_pb2.Document] = []
    queries: dict[str, list[str]] = {}
    for lang in ("en", "zh"):
        d, q = corpus(lang, n_docs, n_queries)
        docs += d
        queries[lang] = q[:n_queries]
    with tempfile.TemporaryDirectory() as kept:
        off = await serve("", docs, queries, "off", Path(kept))
        on = await serve(DEFAULT_LATIN_EMBEDDER, docs, queries, "on")
        backfill_s, backfilled = await catch_up(Path(kept), off.chunks)
    print(f"{len(docs)} documents, {on.chunks} chunks; {n_queries} queries per language and mode")
    print(f"ingest chunks/s: Latin-script leg off {off.chunks / off.ingest_s:.1f}, on {on.chunks / on.ingest_s:.1f}"
          f" ({(on.chunks / on.ingest_s) / (off.chunks / off.ingest_s):.2f}x)")
    for lang in queries:
        for name, a, b in (("hybrid", off.hybrid[lang], on.hybrid[lang]),
                           ("hybrid + rerank", off.reranked[lang], on.reranked[lang])):
            print(f"  {lang} {name:<16} p50 off {percentile(a, 50):7.1f} ms, on {percentile(b, 50):7.1f} ms"
                  f" ({percentile(b, 50) / percentile(a, 50):.2f}x); p95 {percentile(a, 95):7.1f} / {percentile(b, 95):7.1f}")
    print(f"upgrade: the leg's backfill stored {backfilled} Latin-script chunks of {off.chunks} in {backfill_s:.1f} s"
          f" from server start (model load included): {backfilled / backfill_s:.1f} chunks/s, against ingest's"
          f" {on.chunks / on.ingest_s:.1f} with the leg ({(backfilled / backfill_s) / (on.chunks / on.ingest_s):.2f}x)")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=300, help="valid answers per language")
    p.add_argument("--queries", type=int, default=40, help="valid questions per language")
    a = p.parse_args()
    asyncio.run(main(a.docs, a.queries))
