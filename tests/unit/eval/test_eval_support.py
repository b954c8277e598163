"""Judged-data loading, the embedding cache and offline fusion (no real models, no data package)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.engines.base import ChunkRecord, Hit
from service.eval.datasets import Judged, clean_text, load_jsonl_judgements
from service.eval.embedding_cache import CachedEmbedder
from service.eval.fusion_tune import rrf_fuse
from service.models.dummy import HashEmbedder
from service.pipeline.fusion import rrf


def _write(path: Path, rows: list[dict]) -> Path:  # type: ignore[type-arg]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def test_jsonl_judgements_with_corpus(tmp_path: Path) -> None:
    corpus = _write(tmp_path / "corpus.jsonl", [
        {"source_id": "d1", "version": "v2", "title": "Refunds", "text": "Refunds take 5 days."},
        {"source_id": "d2", "text": "Invoices are monthly."},
    ])
    judg = _write(tmp_path / "j.jsonl", [
        {"id": "a", "query": "how long do refunds take", "positives": ["d1"], "negatives": ["d2"]},
        {"query": "invoice schedule", "positives": ["d2"]},
    ])
    j = load_jsonl_judgements(judg, corpus)
    assert j.queries == {"a": "how long do refunds take", "q2": "invoice schedule"}
    assert j.qrels == {"a": {"d1"}, "q2": {"d2"}}
    assert j.negatives == {"a": ["d2"], "q2": []}
    assert j.corpus["d1"] == "Refunds\nRefunds take 5 days."
    assert j.document("d1")["version"] == "v2"  # the user's document is ingested as written
    assert j.document("d2") == {"version": "v1", "collection": "doc", "source_id": "d2", "text": "Invoices are monthly."}


def test_jsonl_judgements_errors(tmp_path: Path) -> None:
    corpus = _write(tmp_path / "corpus.jsonl", [{"source_id": "d1", "text": "x"}])
    with pytest.raises(ValueError, match="positives not in the corpus"):
        load_jsonl_judgements(_write(tmp_path / "a.jsonl", [{"query": "q", "positives": ["nope"]}]), corpus)
    with pytest.raises(ValueError, match="non-empty list"):
        load_jsonl_judgements(_write(tmp_path / "b.jsonl", [{"query": "q", "positives": []}]))
    with pytest.raises(ValueError, match="b2.jsonl:1"):
        (tmp_path / "b2.jsonl").write_text("{not json\n")
        load_jsonl_judgements(tmp_path / "b2.jsonl")


def _judged() -> Judged:
    corpus = {f"d{i}": f"text {i}" for i in range(100)}
    queries = {f"q{i}": f"query {i}" for i in range(10)}
    qrels = {f"q{i}": {f"d{i}"} for i in range(10)}
    negatives = {f"q{i}": [f"d{50 + i}"] for i in range(10)}
    return Judged("t", corpus, queries, qrels, negatives)


def test_sample_is_seeded_and_corpus_keeps_positives() -> None:
    j = _judged()
    s1, s2 = j.sample(4, seed=3), j.sample(4, seed=3)
    assert s1.queries == s2.queries and len(s1.queries) == 4
    assert len(s1.corpus) == 100  # query sampling keeps the corpus whole
    c = s1.sample_corpus(20, seed=1, keep_negatives=True)
    assert len(c.corpus) == 20
    for q in s1.queries:
        assert s1.qrels[q] <= set(c.corpus)
        assert set(s1.negatives[q]) <= set(c.corpus)
    assert j.sample(None).queries == j.queries


def test_without_holds_queries_out_and_keeps_the_corpus() -> None:
    j = _judged()
    gate = j.sample(4, seed=0)
    rest = j.without(gate.queries)
    assert not set(rest.queries) & set(gate.queries) and len(rest.queries) == len(j.queries) - 4
    assert rest.corpus == j.corpus and all(rest.qrels[q] == j.qrels[q] for q in rest.queries)
    assert not set(rest.sample(3, seed=0).queries) & set(gate.queries)


def test_clean_text_collapses_blanks() -> None:
    assert clean_text("  Does  Medicare  Pick  Up?  ", "en") == "Does Medicare Pick Up?"
    assert clean_text("\u00a0汽车跟随着。", "zh") == "汽车跟随着。"


def test_cached_embedder_reuses_vectors(tmp_path: Path) -> None:
    inner = HashEmbedder()
    calls: list[int] = []
    real_infer = inner.infer

    def counting_infer(enc):  # type: ignore[no-untyped-def]
        calls.append(enc.batch_size)
        return real_infer(enc)

    inner.infer = counting_infer  # type: ignore[method-assign]
    cache = CachedEmbedder(inner, tmp_path)
    texts = ["refund policy", "reset password", "refund policy"]
    direct = real_infer(inner.tokenize(texts, "passage"))
    first = cache.infer(cache.tokenize(texts, "passage"))
    np.testing.assert_allclose(first, direct, rtol=1e-6)
    assert cache.misses == 3 and cache.hits == 0
    cache.flush()
    # A new instance (a later run) loads the shard and computes nothing.
    calls.clear()
    again = CachedEmbedder(inner, tmp_path)
    second = again.infer(again.tokenize(["reset password", "refund policy"], "passage"))
    np.testing.assert_allclose(second, direct[[1, 0]], rtol=1e-6)
    assert calls == [] and again.hits == 2
    # Mixed batch: only the new text reaches the model; queries are never cached.
    again.infer(again.tokenize(["reset password", "new text"], "passage"))
    assert calls == [1]
    again.infer(again.tokenize(["reset password"], "query"))
    assert calls == [1, 1]
    assert again.warm(["refund policy", "x", "y"]) == 2
    again.compact()
    assert len(list(again.dir.glob("shard-*.npz"))) == 1
    assert len(CachedEmbedder(inner, tmp_path)) == 5  # refund, reset, new text, x, y


def test_the_cache_keeps_the_wrapped_models_batch_invariance(tmp_path: Path) -> None:
    # An int8 model with per-batch activation scales must keep its requests apart in an
    # evaluation too, or its query vectors would depend on the concurrent questions.
    inner = HashEmbedder()
    inner.batch_invariant = False
    assert CachedEmbedder(inner, tmp_path).batch_invariant is False
    assert CachedEmbedder(HashEmbedder(), tmp_path).batch_invariant is True


def test_offline_rrf_matches_the_pipeline() -> None:
    def hits(ids: list[str]) -> list[Hit]:
        return [Hit(ChunkRecord(chunk_id=i, source_id=i, version="v1", chunk_index=0, collection="doc",
                                status="approved", title="", breadcrumb="", text=i, parent_text=i,
                                search_text=i), score=1.0) for i in ids]

    bm25, knn = ["a", "b", "c", "d"], ["c", "e", "a", "f"]
    for k, wb, wk in ((60, 1.0, 1.0), (5, 0.3, 1.0), (1, 2.0, 1.0)):
        expected = [c.chunk.source_id for c in rrf(hits(bm25), hits(knn), k=k, bm25_weight=wb, knn_weight=wk)]
        assert rrf_fuse(bm25, knn, k=k, bm25_weight=wb, knn_weight=wk) == expected


def test_cache_keys_ending_in_nul_survive_a_round_trip(tmp_path: Path) -> None:
    from service.eval.embedding_cache import text_key

    text = next(f"t{i}" for i in range(100_000) if text_key(f"t{i}").endswith(b"\0"))
    cache = CachedEmbedder(HashEmbedder(), tmp_path)
    cache.warm([text, "other"])
    again = CachedEmbedder(HashEmbedder(), tmp_path)
    assert again.contains(text) and again.contains("other")


def test_offline_rrf_counts_a_repeated_source_once() -> None:
    # "a" is listed twice by kNN (two chunks): it keeps its best rank, it does not add up.
    fused = rrf_fuse(["b"], ["a", "c", "a"], k=1, bm25_weight=0.0, knn_weight=1.0)
    assert fused == ["a", "c", "b"]
    assert rrf_fuse(["x", "y"], ["y", "x", "y"], k=60, bm25_weight=1.0, knn_weight=1.0)[0] in {"x", "y"}


def test_eval_subcommand_is_registered(capsys: pytest.CaptureFixture[str]) -> None:
    from service.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["eval", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--split", "--lang", "--sample", "--corpus-sample", "--engine", "--opensearch-url",
                 "--modes", "--models", "--reranker", "--out", "--seed", "--judgements"):
        assert flag in out


def test_naming_the_rerank_mode_without_a_reranker_is_refused_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # It would otherwise ingest the whole corpus and then report the mode skipped.
    from service.cli import main

    assert main(["eval", "--modes", "hybrid,hybrid+rerank", "--out", str(tmp_path / "out")]) == 2
    assert "--modes hybrid+rerank needs --reranker" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_markdown_table_reports_skips() -> None:
    from service.eval.runner import markdown_table

    table = markdown_table([
        {"model": "int8", "mode": "bm25", "status": "ok", "reason": "", "degraded": 0, "leg_failures": {},
         "outcomes": {"ATTEMPT_OUTCOME_EVIDENCE_FOUND": 2},
         "metrics": {"recall@10": 0.5, "recall@100": 1.0, "mrr@100": 0.25, "ndcg@10": 0.3},
         "latency_ms": {"p50": 1.0, "p95": 2.0}},
        {"model": "int8", "mode": "hybrid+rerank", "status": "skipped", "reason": "no reranker given"},
    ])
    assert "| (any) | bm25 | 0.5000 | 1.0000 | 0.2500 | 0.3000 | 1.0 | 2.0 |  |" in table
    assert "skipped: no reranker given" in table


def test_calibration_questions_never_include_a_measured_question(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.eval import cli, datasets

    pool = Judged(name="valid-en", corpus={f"d{i}": f"answer {i}" for i in range(20)},
                  queries={f"q{i}": f"question {i}" for i in range(20)},
                  qrels={f"q{i}": {f"d{i}"} for i in range(20)}, negatives={})
    monkeypatch.setattr(datasets, "load_insuranceqa", lambda split, lang: pool)
    measured = pool.sample(12, seed=0)
    picked = cli.calibration_questions("valid", "en", 8, 0, exclude=measured.queries)
    assert len(picked.queries) == 8 and not set(picked.queries) & set(measured.queries)
    assert picked.qrels == {q: pool.qrels[q] for q in picked.queries}
    assert picked.corpus is pool.corpus  # the splits share one answer pool
    # Nothing excluded: the seeded sample the train-split fits were made from, unchanged.
    assert cli.calibration_questions("train", "en", 8, 0).queries == pool.sample(8, 0).queries
