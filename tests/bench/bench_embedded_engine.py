"""Embedded engine latency on a synthetic corpus (default 27k chunks), with baselines measured
in the same run so the printed ratios mean something on any machine.

    .venv/bin/python tests/bench/bench_embedded_engine.py [--docs 27000] [--queries 200]

Reports: ingest and restart (reload + re-analysis) time; BM25 query latency through the
engine against a naive pure-Python dict-of-postings BM25 over the same terms; exact kNN
(dim 384) against BM25; and filtered variants of both.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from service.engines.base import ChunkRecord, SearchFilter, make_chunk_id  # noqa: E402
from service.engines.embedded import EmbeddedEngine  # noqa: E402
from service.engines.embedded.analyzer import analyze  # noqa: E402
from service.engines.embedded.bm25 import byte4_to_int, int_to_byte4  # noqa: E402

DIM = 384
EN = ("policy claim premium deductible coverage insured benefit exclusion rider annuity term "
      "life health auto home liability accident payout beneficiary underwriting renewal "
      "lapse surrender waiting period hospital dental vision").split()  # fmt: skip
ZH = "保险 理赔 保费 免赔额 保障 被保险人 受益人 责任 免除 续保 等待期 住院 意外 身故 年金 条款".split()


def synthetic_text(rng: random.Random, n_words: int) -> str:
    words = []
    for _ in range(n_words):
        if rng.random() < 0.35:
            words.append(rng.choice(ZH))
        else:
            words.append(rng.choice(EN) if rng.random() < 0.8 else f"w{rng.randint(0, 20000)}")
    return " ".join(words)


def make_chunks(n: int, rng: random.Random) -> list[ChunkRecord]:
    vectors = np.random.default_rng(1).standard_normal((n, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    chunks = []
    for i in range(n):
        source, index = f"S{i // 10}", i % 10
        text = synthetic_text(rng, rng.randint(60, 160))
        chunks.append(ChunkRecord(
            chunk_id=make_chunk_id(source, index, "v1"), source_id=source, version="v1",
            chunk_index=index, collection="faq" if i % 5 == 0 else "doc", status="approved",
            title="", breadcrumb="", text=text, parent_text="", search_text=text,
            acl=("hr",) if i % 7 == 0 else (), content_hash=f"h{i // 10}", vector=vectors[i],
        ))  # fmt: skip
    return chunks


class NaiveBm25:
    """The baseline: dict-of-dict postings, pure Python float64 scoring, full sort (same
    lossy lengths as Lucene, so rankings agree up to float32 ties)."""

    def __init__(self, docs: list[list[str]]) -> None:
        self.postings: dict[str, dict[int, int]] = defaultdict(dict)
        self.lengths = [byte4_to_int(int_to_byte4(len(d))) for d in docs]
        for doc_id, terms in enumerate(docs):
            for term, tf in Counter(terms).items():
                self.postings[term][doc_id] = tf
        self.n = sum(1 for d in docs if d)
        self.avgdl = sum(map(len, docs)) / self.n

    def search(self, terms: list[str], k: int) -> list[tuple[int, float]]:
        scores: dict[int, float] = defaultdict(float)
        for term, count in Counter(terms).items():
            posting = self.postings.get(term, {})
            idf = math.log(1 + (self.n - len(posting) + 0.5) / (len(posting) + 0.5))
            for doc_id, tf in posting.items():
                norm = 1.2 * (0.25 + 0.75 * self.lengths[doc_id] / self.avgdl)
                scores[doc_id] += count * idf * tf / (tf + norm)
        return sorted(scores.items(), key=lambda x: (-x[1], x[0]))[:k]


def timed(fn, repeat: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for i in range(repeat):
        start = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - start) * 1000)
    return out


def summary(ms: list[float]) -> str:
    ms = sorted(ms)
    return f"p50 {statistics.median(ms):7.2f} ms  p95 {ms[int(0.95 * (len(ms) - 1))]:7.2f} ms"


async def main(n_docs: int, n_queries: int) -> None:
    rng = random.Random(42)
    chunks = make_chunks(n_docs, rng)
    queries = [synthetic_text(rng, rng.randint(2, 5)) for _ in range(n_queries)]
    qvecs = np.random.default_rng(2).standard_normal((n_queries, DIM)).astype(np.float32)
    qvecs /= np.linalg.norm(qvecs, axis=1, keepdims=True)
    everyone = SearchFilter(acl_groups=None)
    filtered = SearchFilter(collections=("doc",), acl_groups=())

    with tempfile.TemporaryDirectory() as tmp:
        engine = EmbeddedEngine(Path(tmp))
        await engine.start()
        start = time.perf_counter()
        for i in range(0, n_docs, 10):
            group = chunks[i : i + 10]
            await engine.replace_document(group[0].source_id, "v1", group)
        ingest_s = time.perf_counter() - start
        await engine.close()
        engine = EmbeddedEngine(Path(tmp))
        start = time.perf_counter()
        await engine.start()
        restart_s = time.perf_counter() - start

        async def run(coro_fn, repeat: int) -> list[float]:  # type: ignore[no-untyped-def]
            out = []
            for i in range(repeat):
                start = time.perf_counter()
                await coro_fn(i)
                out.append((time.perf_counter() - start) * 1000)
            return out

        bm25 = await run(lambda i: engine.bm25(queries[i], 10, everyone, 10.0), n_queries)
        bm25_f = await run(lambda i: engine.bm25(queries[i], 10, filtered, 10.0), n_queries)
        knn = await run(lambda i: engine.knn(qvecs[i], 10, everyone, 10.0), n_queries)
        knn_f = await run(lambda i: engine.knn(qvecs[i], 10, filtered, 10.0), n_queries)
        samples = [(await engine.bm25(q, 10, everyone, 10.0)).hits for q in queries[:20]]
        await engine.close()

    analysed = [analyze(c.search_text) for c in chunks]
    naive = NaiveBm25(analysed)
    naive_ms = timed(lambda i: naive.search(analyze(queries[i]), 10), n_queries)
    overlap = statistics.mean(
        len({h.chunk.chunk_id for h in hits}
            & {chunks[d].chunk_id for d, _ in naive.search(analyze(q), 10)}) / 10
        for q, hits in zip(queries, samples, strict=False)
    )  # fmt: skip

    print(f"corpus: {n_docs} chunks, avg {sum(map(len, analysed)) / n_docs:.0f} terms, dim {DIM}")
    print(
        f"ingest via replace_document: {ingest_s:6.1f} s   restart (load + analyse): {restart_s:5.1f} s"
    )
    print(f"BM25 engine          {summary(bm25)}")
    print(f"BM25 engine filtered {summary(bm25_f)}")
    print(f"BM25 naive baseline  {summary(naive_ms)}   (top-10 overlap with engine: {overlap:.0%})")
    print(f"kNN exact            {summary(knn)}")
    print(f"kNN exact filtered   {summary(knn_f)}")
    print(
        f"ratio naive/engine BM25 p50: {statistics.median(naive_ms) / statistics.median(bm25):5.1f}x"
    )
    print(f"ratio kNN/BM25 p50:          {statistics.median(knn) / statistics.median(bm25):5.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--docs", type=int, default=27_000)
    parser.add_argument("--queries", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.docs, args.queries))
