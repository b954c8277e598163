"""BM25 and kNN parity between the embedded engine and a real OpenSearch node (CI-sized).

The same chunks go into both engines through the ``Engine`` interface, the same queries go
to both, and their top-10 lists are compared (see ``tests/bench/parity_engines.py`` for the
full-size run: the 5,000-answer InsuranceQA samples in English and Chinese, the
deleted-document experiment, and how every disagreement was classified).

- demo corpus (chunked as the service's ingest chunks it), 65 queries, three filters;
- InsuranceQA train split (``insuranceqa-data``, the ``eval`` extra): 200 sampled questions,
  their judged positives plus random answers = 1,000 answers (English), one chunk each.

Without a node these tests skip loudly (fail under ``CI=true``); the same holds for the
InsuranceQA data. Embeddings (e5-small int8) are cached under
``~/.cache/retrieval-service/parity`` by model sha and text sha: reruns are fast, a cold
cache only costs time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from service.engines.base import SearchFilter
from service.models.base import EmbeddingBackend
from tests.bench.parity_engines import (
    DataMissing,
    VectorCache,
    answer_chunks,
    demo_chunks,
    demo_queries,
    insuranceqa_sample,
    run_corpus,
    with_vectors,
)
from tests.support.opensearch import opensearch_url_or_skip

pytestmark = [pytest.mark.integration, pytest.mark.slow]

K = 10
# Targets from issue 3 (BM25 overlap@10 >= 0.95), which the measurements clear with room.
# Measured 2026-11-30, OpenSearch 3.6.0 + k-NN (lucene HNSW m=16, ef_construction=128,
# k=100 candidates), 2 shared cores:
#   demo (23 chunks, 65 queries x 3 filters): BM25 overlap@10 1.000, top-1 1.000, max relative
#     score difference 5.6e-8; kNN HNSW-vs-embedded overlap@10 1.000, top-1 1.000.
#   this test's sample (1,000 answers, 200 questions, en), three loads: BM25 overlap@10 1.000,
#     top-1 1.000, 0 score differences > 1e-4 (max 5.8e-8), 1-3 queries with two bit-identical
#     scores in another order (Lucene breaks ties by doc id, and merges reorder doc ids);
#     kNN HNSW-vs-embedded overlap@10 1.000, top-1 1.000, OpenSearch exact (script_score) vs
#     embedded exact 1.000, max relative score difference 1.9e-7.
#   bench (tests/bench/parity_engines.py, 5,000 answers, 500 questions): BM25 overlap@10 0.9998
#     en / 0.9994 zh, top-1 1.000 / 1.000; kNN HNSW-vs-embedded 0.9988 / 0.9976 = the HNSW
#     recall measured against OpenSearch's own exact search (0.999 / 0.998).
BM25_MIN_OVERLAP = 0.95
BM25_MIN_TOP1 = 0.95
# HNSW recall measured 1.000 at 1k answers, 0.998-0.999 at 5k; the margin covers graph-build
# randomness, never a vector or distance mismatch (that is the exact-vs-exact check).
KNN_MIN_OVERLAP = 0.97
KNN_MIN_EXACT_OVERLAP = 0.999
N_ANSWERS = 1000
N_QUESTIONS = 200


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="module")
def url() -> str:
    return opensearch_url_or_skip()


@pytest.fixture(scope="module")
def cache(e5_embedder: EmbeddingBackend) -> VectorCache:
    return VectorCache(e5_embedder)


def _check(result: dict[str, Any], filters: list[str]) -> None:
    for f in filters:
        b, kn = result["bm25"][f], result["knn"][f]
        where = f"{result['corpus']}/{f}"
        assert b["opensearch_incomplete"] == 0, where
        assert b["overlap_at_k"] >= BM25_MIN_OVERLAP, (where, b["overlap_at_k"], b["examples"])
        assert b["top1_agreement"] >= BM25_MIN_TOP1, (where, b["top1_agreement"], b["examples"])
        # Same analyzer, same statistics, same float32 formula: no score may drift.
        assert b["score_diffs_gt_1e-4"] == 0, (where, b["max_rel_score_diff"], b["examples"])
        assert set(b["disagreements"]) <= {"tie_order", "tie_top", "tie_cutoff"}, (where, b["examples"])
        assert kn["os_exact_vs_embedded_overlap"] >= KNN_MIN_EXACT_OVERLAP, (where, kn["examples"])
        assert kn["hnsw_vs_embedded_overlap"] >= KNN_MIN_OVERLAP, (where, kn["examples"])
        # HNSW-vs-embedded can only lose what HNSW loses against OpenSearch's own exact search.
        assert kn["hnsw_vs_embedded_overlap"] >= kn["hnsw_recall_vs_os_exact"] - 0.005, where
        assert kn["score_diffs_gt_1e-4"] == 0, (where, kn["max_rel_score_diff"])
    a = result["analyzer"]
    assert a["queries_terms_differ"] == 0, a["query_examples"]
    assert a["docs_terms_differ"] == 0, a["doc_examples"]
    os_stats, emb_stats = a["opensearch_field_stats"], a["embedded_field_stats"]
    assert (os_stats["doc_count"], os_stats["sum_ttf"]) == (emb_stats["doc_count"], emb_stats["sum_ttf"])


async def test_demo_corpus_parity(url: str, cache: VectorCache, tmp_path: Path) -> None:
    chunks = demo_chunks()
    records = with_vectors(chunks, cache.embed([t for _, t in chunks], "passage"))
    queries = demo_queries()
    filters = {"no_acl": SearchFilter(acl_groups=None), "public": SearchFilter(),
               "collection_doc": SearchFilter(collections=("doc",), acl_groups=None)}
    result = await run_corpus("demo", url, records, queries, cache.embed(queries, "query"),
                              filters, K, tmp_path)
    _check(result, list(filters))


async def test_insuranceqa_sample_parity(url: str, cache: VectorCache, tmp_path: Path) -> None:
    try:
        sample = insuranceqa_sample("en", N_QUESTIONS, N_ANSWERS, seed=0)
    except DataMissing as exc:
        message = f"INSURANCEQA DATA NEEDED for the engine parity test: {exc}"
        if _in_ci():
            pytest.fail(f"{message} (CI=true: this test must run, not skip)", pytrace=False)
        pytest.skip(message)
    assert len(sample.answers) == N_ANSWERS and len(sample.queries) == N_QUESTIONS
    chunks = answer_chunks(sample.answers)
    records = with_vectors(chunks, cache.embed([t for _, t in chunks], "passage"))
    queries = list(sample.queries.values())
    # 4 writes in flight keep the OpenSearch load near 10s on 2 cores; tied hits can sit in a
    # different doc-id order there (so can merges), which the tie classes allow.
    result = await run_corpus("iqa-en", url, records, queries, cache.embed(queries, "query"),
                              {"public": SearchFilter()}, K, tmp_path, os_concurrency=4)
    _check(result, ["public"])
