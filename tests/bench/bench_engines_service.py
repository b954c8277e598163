"""OpenSearch vs the embedded engine through the real service: query latency and ingest
throughput on the same corpus, both measured in the same run (ratios are what to read;
absolute times drift on a shared machine).

    .venv/bin/python tests/bench/bench_engines_service.py [--answers 5000] [--queries 200] \\
        [--opensearch-url http://127.0.0.1:9200] [--out /tmp/bench-engines.json]

Two in-process servers (grpc.aio, servicers, pipeline, e5-small int8 model runtime; one with
the embedded engine, one with ``--opensearch-url``: one shard, a fresh index prefix, dropped
afterwards) share one embedder object. Both ingest the same documents through the Ingest
API: the demo corpus plus the 5,000-answer InsuranceQA sample of ``parity_engines.py``
(train split; one document per answer, chunked by the service).

Ingest: the passage vectors of every chunk the service will embed are computed (or read from
the parity/eval embedding caches) before the clock starts and served by a lookup backend, so
chunks/s measures the service and engine write path, which is what differs between engines;
the model's own passage rate is printed next to it (a cold ingest is bounded by that).

Queries: train questions of the sample plus the demo queries, each sent to both servers
back to back (alternating which goes first), BM25-only, kNN-only and hybrid (BM25 + kNN,
no reranker), after a warm-up. Reported: client-side Retrieve p50/p95 and the engine leg's
wall time as the pipeline reports it (``LegReport.latency_ms``; the kNN leg includes the
query embedding, the same for both engines).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc  # noqa: E402

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc, types_pb2  # noqa: E402
from service.api.server import Server  # noqa: E402
from service.app import App  # noqa: E402
from service.config import Config  # noqa: E402
from service.eval.metrics import percentile  # noqa: E402
from service.demo.corpus import DEMO_DOCUMENTS  # noqa: E402
from service.ingest.chunking import chunk_document, embedded_text  # noqa: E402
from service.models.base import EmbeddingBackend, Encoded, FloatArray, TextKind  # noqa: E402
from tests.bench.parity_engines import DEMO_QUERIES, VectorCache, insuranceqa_sample, load_e5  # noqa: E402

MODES: dict[str, list[int]] = {
    "bm25": [types_pb2.LEG_KIND_BM25],
    "knn": [types_pb2.LEG_KIND_KNN],
    "hybrid": [],  # empty = BM25 and KNN
}
LEG_OF_MODE = {"bm25": "LEG_KIND_BM25", "knn": "LEG_KIND_KNN", "hybrid": ""}


def pct(xs: list[float], p: float) -> float:
    return percentile(xs, p) if xs else float("nan")


class PrecomputedPassages(EmbeddingBackend):
    """Passage vectors from a table computed before the clock starts; queries (and any
    passage missing from the table) go to the real model."""

    def __init__(self, inner: EmbeddingBackend, table: dict[str, FloatArray]) -> None:
        self.inner = inner
        self.info = inner.info
        self.table = table
        self.misses = 0

    def tokenize(self, texts: list[str], kind: TextKind) -> Encoded:
        if kind == "passage" and all(t in self.table for t in texts):
            empty = np.zeros((len(texts), 1), dtype=np.int64)
            return Encoded(empty, empty, extra={"precomputed": list(texts)})
        if kind == "passage":
            self.misses += len(texts)
        return self.inner.tokenize(texts, kind)

    def infer(self, encoded: Encoded) -> FloatArray:
        texts = encoded.extra.get("precomputed")
        if texts is None:
            return self.inner.infer(encoded)
        return np.stack([self.table[t] for t in texts]).astype(np.float32)


def build_documents(n_answers: int, n_questions: int, seed: int) -> tuple[list[dict[str, Any]], list[str]]:
    sample = insuranceqa_sample("en", n_questions, n_answers, seed)
    docs: list[dict[str, Any]] = [dict(d) for d in DEMO_DOCUMENTS]
    docs += [{"source_id": f"iqa-{aid}", "version": "v1", "title": "", "text": text,
              "collection": "doc"} for aid, text in sample.answers.items()]
    return docs, list(sample.queries.values())


def to_pb(d: dict[str, Any]) -> corpus_pb2.Document:
    coll = {"doc": types_pb2.COLLECTION_DOC, "faq": types_pb2.COLLECTION_FAQ}
    status = {"approved": types_pb2.SOURCE_STATUS_APPROVED, "draft": types_pb2.SOURCE_STATUS_DRAFT,
              "retired": types_pb2.SOURCE_STATUS_RETIRED}
    return corpus_pb2.Document(
        source_id=d["source_id"], version=d["version"], title=d["title"], text=d["text"],
        collection=coll[d["collection"]], status=status[d.get("status", "approved")],
        acl=d.get("acl", []), breadcrumb=d.get("breadcrumb", ""), metadata=d.get("metadata", {}))


def chunk_texts(docs: list[dict[str, Any]], cfg: Config) -> list[str]:
    """What ``Ingestor.ingest`` embeds for these documents."""
    out = []
    for d in docs:
        for p in chunk_document(d["text"], d.get("breadcrumb", ""), d["collection"], cfg.chunk_chars, cfg.parent_chars):
            out.append(embedded_text(d["title"], p))
    return out


@dataclasses.dataclass
class Live:
    name: str
    app: App
    server: Server
    channel: grpc.aio.Channel
    retrieval: retrieval_pb2_grpc.RetrievalServiceStub
    corpus: corpus_pb2_grpc.CorpusServiceStub


async def start(name: str, cfg: Config, embedder: EmbeddingBackend) -> Live:
    app = App.build(cfg, embedder=embedder)
    server = Server(app)
    port = await server.start("127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return Live(name, app, server, channel, retrieval_pb2_grpc.RetrievalServiceStub(channel),
                corpus_pb2_grpc.CorpusServiceStub(channel))


async def ingest(live: Live, docs: list[corpus_pb2.Document]) -> dict[str, Any]:
    async def stream() -> AsyncIterator[corpus_pb2.IngestRequest]:
        for d in docs:
            yield corpus_pb2.IngestRequest(document=d)

    t0 = time.perf_counter()
    summary = await live.corpus.Ingest(stream(), timeout=3600)
    acked = time.perf_counter() - t0
    await live.app.engine.refresh()  # OpenSearch: make every acknowledged chunk searchable
    visible = time.perf_counter() - t0
    stats = await live.app.engine.stats()
    return {"documents_indexed": summary.documents_indexed, "chunks_indexed": summary.chunks_indexed,
            "errors": len(summary.errors), "seconds_acked": acked, "seconds_visible": visible,
            "chunks_per_s": summary.chunks_indexed / acked,
            "server_chunks_per_s": summary.chunks_per_second, "engine_chunks": stats.chunk_count}


async def retrieve(live: Live, query: str, legs: list[int]) -> tuple[float, dict[str, float], list[str]]:
    options = retrieval_pb2.RetrievalOptions(legs=legs) if legs else None
    req = retrieval_pb2.RetrieveRequest(query=query, top_k=10, options=options)
    t0 = time.perf_counter()
    result = None
    async for ev in live.retrieval.Retrieve(req, timeout=30):
        if ev.WhichOneof("event") == "result":
            result = ev.result
    ms = (time.perf_counter() - t0) * 1000
    legs_ms: dict[str, float] = {}
    bad: list[str] = []
    if result is not None:
        for leg in result.legs:
            kind = types_pb2.LegKind.Name(leg.kind)
            status = types_pb2.LegStatus.Name(leg.status)
            if kind == "LEG_KIND_RERANK" or status == "LEG_STATUS_SKIPPED":
                continue  # no reranker configured; legs the mode did not ask for
            legs_ms[kind] = leg.latency_ms
            if status != "LEG_STATUS_OK":
                bad.append(f"{kind}={status}")
    else:
        bad.append("no result")
    return ms, legs_ms, bad


async def measure(lives: list[Live], queries: list[str], warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, legs in MODES.items():
        for q in queries[:warmup]:
            for live in lives:
                await retrieve(live, q, legs)
        lat: dict[str, list[float]] = {lv.name: [] for lv in lives}
        leg: dict[str, dict[str, list[float]]] = {lv.name: {} for lv in lives}
        bad: dict[str, int] = {lv.name: 0 for lv in lives}
        for i, q in enumerate(queries):
            order = lives if i % 2 == 0 else lives[::-1]
            for live in order:
                ms, legs_ms, problems = await retrieve(live, q, legs)
                lat[live.name].append(ms)
                for kind, v in legs_ms.items():
                    leg[live.name].setdefault(kind, []).append(v)
                bad[live.name] += int(bool(problems))
        out[mode] = {name: {"p50": pct(xs, 50), "p95": pct(xs, 95), "n": len(xs), "not_ok": bad[name],
                            "legs": {k: {"p50": pct(v, 50), "p95": pct(v, 95)} for k, v in leg[name].items()}}
                     for name, xs in lat.items()}
    return out


async def model_passage_rate(embedder: EmbeddingBackend, texts: list[str]) -> float:
    """Bare passage embedding rate (2 threads, batch 16, length-sorted, like a warm-up)."""
    from concurrent.futures import ThreadPoolExecutor

    todo = sorted(texts, key=len)
    batches = [todo[i : i + 16] for i in range(0, len(todo), 16)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda b: embedder.infer(embedder.tokenize(b, "passage")), batches))
    return len(texts) / (time.perf_counter() - t0)


async def main(args: argparse.Namespace) -> int:
    from tests.support.opensearch import bench_node_or_none

    url = bench_node_or_none(args.opensearch_url)
    if url is None:
        return 2
    started = time.perf_counter()
    base = Config()
    docs, questions = build_documents(args.answers, max(args.queries, 500), args.seed)
    texts = chunk_texts(docs, base)
    model = load_e5(threads=1)
    cache = VectorCache(model)
    vectors = cache.embed(texts, "passage")
    table = {t: v for t, v in zip(texts, vectors, strict=True)}
    print(f"{len(docs)} documents, {len(texts)} chunks; vectors: {cache.hits} cached, {cache.computed} "
          f"computed in {cache.embed_seconds:.0f}s", flush=True)
    embedder = PrecomputedPassages(model, table)
    queries = questions[: args.queries]
    queries += [q for q in DEMO_QUERIES if q not in queries][: max(0, args.demo_queries)]
    prefix = f"bench-svc-{uuid.uuid4().hex[:10]}"
    pb_docs = [to_pb(d) for d in docs]
    results: dict[str, Any] = {"documents": len(docs), "chunks": len(texts), "queries": len(queries)}
    with tempfile.TemporaryDirectory() as tmp:
        cfg_e = dataclasses.replace(base, data_dir=Path(tmp) / "embedded")
        cfg_o = dataclasses.replace(base, data_dir=Path(tmp) / "opensearch", opensearch_url=url,
                                    opensearch_index_prefix=prefix)
        lives = [await start("embedded", cfg_e, embedder), await start("opensearch", cfg_o, embedder)]
        try:
            results["ingest"] = {}
            for live in lives:
                results["ingest"][live.name] = await ingest(live, pb_docs)
                print(f"ingest {live.name}: {results['ingest'][live.name]}", flush=True)
            results["passage_misses"] = embedder.misses
            results["latency"] = await measure(lives, queries, args.warmup)
            results["model_passages_per_s"] = await model_passage_rate(model, texts[: args.model_sample])
        finally:
            for live in lives:
                if live.name == "opensearch":
                    try:
                        await live.app.engine.drop_indices()  # type: ignore[attr-defined]
                    except Exception as exc:  # noqa: BLE001 - report, keep tearing down
                        print(f"could not drop {prefix}: {exc}", file=sys.stderr)
                await live.channel.close()
                await live.server.stop(0.5)
    results["seconds"] = time.perf_counter() - started
    print_report(results)
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "opensearch_url": url, **results}, indent=1))
        print(f"wrote {args.out}")
    return 0


def print_report(r: dict[str, Any]) -> None:
    print(f"\nquery latency through Retrieve, {r['queries']} queries per mode, top_k=10, corpus "
          f"{r['documents']} documents / {r['chunks']} chunks (ms)")
    print(f"  {'mode':<8} {'embedded p50':>12} {'p95':>7} {'opensearch p50':>15} {'p95':>7} "
          f"{'ratio p50':>9} {'p95':>6} | engine leg p50 emb / os   not-OK emb/os")
    for mode, per in r["latency"].items():
        e, o = per["embedded"], per["opensearch"]
        legs = []
        for kind in sorted(set(e["legs"]) | set(o["legs"])):
            le, lo = e["legs"].get(kind, {}), o["legs"].get(kind, {})
            legs.append(f"{kind.removeprefix('LEG_KIND_')} {le.get('p50', float('nan')):.2f} / {lo.get('p50', float('nan')):.2f}")
        print(f"  {mode:<8} {e['p50']:>12.2f} {e['p95']:>7.2f} {o['p50']:>15.2f} {o['p95']:>7.2f} "
              f"{o['p50'] / e['p50']:>8.2f}x {o['p95'] / e['p95']:>5.2f}x | {'; '.join(legs)}   {e['not_ok']}/{o['not_ok']}")
    print("\ningest through Ingest (passage vectors precomputed; service + engine write path)")
    for name, ing in r["ingest"].items():
        print(f"  {name:<10} {ing['documents_indexed']} docs, {ing['chunks_indexed']} chunks in "
              f"{ing['seconds_acked']:.1f}s = {ing['chunks_per_s']:.0f} chunks/s (searchable after "
              f"{ing['seconds_visible']:.1f}s; errors {ing['errors']}; engine holds {ing['engine_chunks']})")
    e, o = r["ingest"]["embedded"], r["ingest"]["opensearch"]
    print(f"  ratio opensearch / embedded chunks/s: {o['chunks_per_s'] / e['chunks_per_s']:.2f}x")
    print(f"  baseline: bare e5 int8 passage embedding {r['model_passages_per_s']:.1f} passages/s "
          f"(a cold ingest runs at most this fast on either engine)")
    print(f"total {r['seconds']:.0f}s")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--opensearch-url", default=os.environ.get("OPENSEARCH_URL") or "http://127.0.0.1:9200")
    p.add_argument("--answers", type=int, default=5000)
    p.add_argument("--queries", type=int, default=200, help="InsuranceQA train questions per mode")
    p.add_argument("--demo-queries", type=int, default=len(DEMO_QUERIES), help="demo queries added")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--model-sample", type=int, default=256, help="passages for the model baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    sys.exit(asyncio.run(main(p.parse_args())))
