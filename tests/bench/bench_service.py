"""Service benchmark: warm single-query latency and ingest throughput through real gRPC
on the embedded engine, with baselines measured in the same run (absolute times drift on
a shared machine; ratios do not).

    .venv/bin/python tests/bench/bench_service.py [--queries 200] [--docs 300]

Prints p50/p95 of hybrid Retrieve (BM25 + kNN, e5-small int8; rerank off), of hybrid + rerank
(the shipped reranker over the top 20, computing its passage states), of BM25-only Retrieve
(baseline: the transport + pipeline without the model), and of the bare query embedding
(baseline: model only); ingest chunks/s against bare passage embedding passages/s.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc  # noqa: E402

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc, types_pb2  # noqa: E402
from service.api.server import Server  # noqa: E402
from service.app import App  # noqa: E402
from service.config import Config  # noqa: E402
from service.eval.metrics import percentile  # noqa: E402
from service.demo.corpus import DEMO_DOCUMENTS  # noqa: E402

QUERIES = ["how do I reset my password", "如何开具发票", "what is new in v2.4", "refund policy",
           "退款需要多长时间", "cancel subscription", "两步验证", "how long are deleted files kept"]
WORDS = ("account billing invoice password reset storage sync offline folder upload share team "
         "admin security login device refund plan seat tax payment audit log retention").split()


def pct(xs: list[float], p: float) -> float:
    return percentile(xs, p)


def synthetic_docs(n: int, seed: int = 7) -> list[corpus_pb2.Document]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        sections = []
        for s in range(3):
            body = " ".join(rng.choice(WORDS) for _ in range(90)) + "."
            sections.append(f"# Section {s}\n{body}")
        docs.append(corpus_pb2.Document(source_id=f"bench-{i}", version="v1", title=f"Bench doc {i}",
                                        text="\n\n".join(sections), collection=types_pb2.COLLECTION_DOC))
    return docs


async def main(n_queries: int, n_docs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dataclasses.replace(Config(), data_dir=Path(tmp))
        app = App.build(cfg)
        server = Server(app)
        port = await server.start("127.0.0.1:0")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            corpus = corpus_pb2_grpc.CorpusServiceStub(ch)
            retrieval = retrieval_pb2_grpc.RetrievalServiceStub(ch)

            async def stream(docs: list[corpus_pb2.Document]):  # type: ignore[no-untyped-def]
                for d in docs:
                    yield corpus_pb2.IngestRequest(document=d)

            demo = [corpus_pb2.Document(
                source_id=d["source_id"], version=d["version"], title=d["title"], text=d["text"],
                collection=types_pb2.COLLECTION_FAQ if d["collection"] == "faq" else types_pb2.COLLECTION_DOC,
                status={"draft": types_pb2.SOURCE_STATUS_DRAFT, "retired": types_pb2.SOURCE_STATUS_RETIRED}.get(
                    d.get("status", ""), types_pb2.SOURCE_STATUS_APPROVED),
                acl=d.get("acl", []), breadcrumb=d.get("breadcrumb", "")) for d in DEMO_DOCUMENTS]
            await corpus.Ingest(stream(demo))

            round_no = 0

            def query(i: int) -> str:
                # Every query text distinct: the query-embedding cache would otherwise answer
                # all but the first few, and this measures the model too.
                return f"{QUERIES[i % len(QUERIES)]} {round_no}-{i}"

            async def timed(options: retrieval_pb2.RetrievalOptions) -> list[float]:
                nonlocal round_no
                round_no += 1
                out = []
                for i in range(n_queries):
                    req = retrieval_pb2.RetrieveRequest(query=query(i), top_k=5, options=options)
                    t0 = time.perf_counter()
                    async for _ in retrieval.Retrieve(req):
                        pass
                    out.append((time.perf_counter() - t0) * 1000)
                return out

            off, on = types_pb2.RERANK_MODE_OFF, types_pb2.RERANK_MODE_ON
            await timed(retrieval_pb2.RetrievalOptions(rerank=on, min_quality=1e-9))  # warm up
            hybrid = await timed(retrieval_pb2.RetrievalOptions(rerank=off))
            reranked = await timed(retrieval_pb2.RetrievalOptions(rerank=on, min_quality=1e-9))
            bm25 = await timed(retrieval_pb2.RetrievalOptions(legs=[types_pb2.LEG_KIND_BM25], rerank=off))
            embed = []
            round_no += 1
            for i in range(n_queries):
                t0 = time.perf_counter()
                await app.runtime.embed_query(query(i), time.monotonic() + 10)
                embed.append((time.perf_counter() - t0) * 1000)

            docs = synthetic_docs(n_docs)
            t0 = time.perf_counter()
            summary = await corpus.Ingest(stream(docs))
            ingest_s = time.perf_counter() - t0
            chunks_per_s = summary.chunks_indexed / ingest_s
            sample = [f"{d.title}\n{d.text[:500]}" for d in docs[:64]]
            t0 = time.perf_counter()
            await app.runtime.embed_passages(sample, time.monotonic() + 600)
            passages_per_s = len(sample) / (time.perf_counter() - t0)
        await server.stop(0.5)

    print(f"warm single queries, n={n_queries} each (ms)          p50      p95")
    for name, xs in (("Retrieve hybrid (BM25 + kNN, e5 int8)", hybrid),
                     ("Retrieve hybrid + rerank (top 20)", reranked),
                     ("Retrieve BM25 only  [baseline]", bm25), ("embed_query only    [baseline]", embed)):
        print(f"  {name:<44} {pct(xs, 50):7.2f}  {pct(xs, 95):7.2f}")
    print(f"  ratio hybrid / BM25-only p50: {pct(hybrid, 50) / pct(bm25, 50):.2f}x;"
          f" hybrid - embed p50: {pct(hybrid, 50) - pct(embed, 50):.2f} ms of transport + engine + pipeline")
    print(f"ingest: {summary.documents_indexed} docs, {summary.chunks_indexed} chunks in {ingest_s:.1f} s ="
          f" {chunks_per_s:.1f} chunks/s (server-reported {summary.chunks_per_second:.1f})")
    print(f"  baseline bare passage embedding: {passages_per_s:.1f} passages/s;"
          f" ingest / embedding ratio {chunks_per_s / passages_per_s:.2f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--docs", type=int, default=300)
    a = p.parse_args()
    asyncio.run(main(a.queries, a.docs))
