"""The OpenSearch template, documents and query bodies, checked without a server."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from service.engines.base import ChunkRecord, SearchFilter, VectorField
from service.engines.opensearch import mapping
from service.engines.opensearch.engine import client_margin


def record(**overrides: object) -> ChunkRecord:
    fields: dict[str, object] = dict(
        chunk_id="E1#0@v3", source_id="E1", version="v3", chunk_index=0, collection="faq",
        status="approved", title="T", breadcrumb="A > B", text="body", parent_text="parent",
        search_text="T A B body", acl=("hr", "legal"), metadata={"lang": "zh", "region": "cn"},
        content_hash="abc", vector=np.array([0.6, 0.8, 0.0], dtype=np.float32),
    )  # fmt: skip
    fields.update(overrides)
    return ChunkRecord(**fields)  # type: ignore[arg-type]


def test_template_matches_every_generation_and_states_the_index_design() -> None:
    t = mapping.index_template("rt", dimension=384, shards=2, replicas=1)
    assert t["index_patterns"] == ["rt-chunks-v*"]
    assert mapping.index_name("rt", 7).startswith("rt-chunks-v")
    settings = t["template"]["settings"]["index"]
    assert (settings["number_of_shards"], settings["number_of_replicas"]) == (2, 1)
    assert settings["knn"] is True
    assert settings["similarity"]["bm25_default"] == {"type": "BM25", "k1": 1.2, "b": 0.75}
    props = t["template"]["mappings"]["properties"]
    assert props["search_text"] == {
        "type": "text", "analyzer": "cjk", "similarity": "bm25_default"}  # fmt: skip
    vec = props["vector"]
    assert vec["type"] == "knn_vector" and vec["dimension"] == 384
    assert vec["method"]["engine"] == "lucene"  # the Maven k-NN zip has no native engines
    assert (vec["method"]["name"], vec["method"]["space_type"]) == ("hnsw", "l2")
    for name in ("chunk_id", "source_id", "version", "status", "collection", "acl",
                 "content_hash", "doc_key"):  # fmt: skip
        assert props[name] == {"type": "keyword"}, name
    for name in ("title", "breadcrumb", "text", "parent_text"):
        assert props[name] == {"type": "text", "index": False}, name
    assert t["template"]["mappings"]["dynamic"] == "strict"
    (dyn,) = t["template"]["mappings"]["dynamic_templates"]
    assert dyn["metadata_keywords"]["path_match"] == "metadata.*"
    assert dyn["metadata_keywords"]["mapping"] == {"type": "keyword"}


def test_index_is_created_with_its_alias_in_one_request() -> None:
    assert mapping.create_index_body("rt") == {"aliases": {"rt-chunks": {"is_write_index": True}}}
    assert mapping.index_generation("rt", "rt-chunks-v12") == 12
    assert mapping.index_generation("rt", "other-chunks-v1") is None
    assert mapping.index_generation("rt", "rt-chunks-vx") is None


def test_mapped_dimension_reads_a_get_mapping_answer() -> None:
    answer = {"rt-chunks-v1": {"mappings": mapping.chunk_mapping(16)}}
    assert mapping.mapped_dimension(answer) == 16
    assert mapping.mapped_dimension({"x": {"mappings": {"properties": {}}}}) is None
    # The Latin-script leg's field: its own dimension (the primary's when no such model is set).
    assert mapping.mapped_dimension(answer, VectorField.LATIN) == 16
    both = {"rt-chunks-v1": {"mappings": mapping.chunk_mapping(16, latin_dimension=384)}}
    assert (mapping.mapped_dimension(both), mapping.mapped_dimension(both, VectorField.LATIN)) == (16, 384)


def test_knn_body_searches_the_field_it_is_given() -> None:
    vector = np.array([0, 1, 0], dtype=np.float32)
    body = mapping.knn_body(vector, 5, SearchFilter(collections=("doc",)), 1.5, VectorField.LATIN)
    assert list(body["query"]["knn"]) == ["latin_vector"]
    assert body["query"]["knn"]["latin_vector"]["vector"] == [0.0, 1.0, 0.0]
    assert "latin_vector" in body["_source"]["excludes"]


def test_document_round_trip() -> None:
    chunk = record()
    doc = mapping.chunk_to_doc(chunk)
    assert doc["doc_key"] == "E1@v3" and doc["acl"] == ["hr", "legal"]
    assert doc["vector"] == pytest.approx([0.6, 0.8, 0.0]) and "latin_vector" not in doc
    back = mapping.doc_to_chunk(doc)
    assert back.latin_vector is None
    latin = mapping.doc_to_chunk(mapping.chunk_to_doc(dataclasses.replace(chunk, latin_vector=np.array([0, 0, 1], np.float32))))
    assert latin.latin_vector is not None and latin.latin_vector.tolist() == [0.0, 0.0, 1.0]
    assert back.vector is not None and np.array_equal(back.vector, chunk.vector)
    assert back == record(vector=back.vector)  # every other field survives as is


def test_public_chunk_has_no_acl_and_vectorless_chunk_has_no_vector() -> None:
    doc = mapping.chunk_to_doc(record(acl=(), vector=None, metadata={}))
    assert doc["acl"] == [] and "vector" not in doc
    back = mapping.doc_to_chunk(doc)
    assert back.acl == () and back.vector is None and back.metadata == {}


def test_dotted_metadata_keys_survive_object_expansion() -> None:
    back = mapping.doc_to_chunk({**mapping.chunk_to_doc(record()), "metadata": {"a": {"b": "x"}}})
    assert back.metadata == {"a.b": "x"}


def test_vector_problems() -> None:
    assert mapping.vector_problem(None, 3) is None
    assert mapping.vector_problem(np.zeros(3, dtype=np.float32), 3) is None
    assert "shape" in (mapping.vector_problem(np.zeros(4, dtype=np.float32), 3) or "")
    assert "non-finite" in (
        mapping.vector_problem(np.array([1, np.nan, 0], dtype=np.float32), 3) or ""
    )


def test_filters_go_inside_the_query() -> None:
    flt = SearchFilter(
        collections=("faq",), source_ids=("E1", "E2"), metadata={"lang": "zh"}, acl_groups=("hr",)
    )
    body = mapping.bm25_body("保险理赔", 7, flt, 0.25)
    assert body["size"] == 7 and body["timeout"] == "250ms"
    assert body["track_total_hits"] is False and body["_source"] == {"excludes": ["vector", "latin_vector", "rerank_states", "rerank_states_key"]}
    query = body["query"]["bool"]
    assert query["must"] == [{"match": {"search_text": {"query": "保险理赔"}}}]
    assert query["filter"] == [
        {"terms": {"collection": ["faq"]}},
        {"terms": {"source_id": ["E1", "E2"]}},
        {"term": {"metadata.lang": "zh"}},
        {"bool": {"should": [{"bool": {"must_not": [{"exists": {"field": "acl"}}]}},
                             {"terms": {"acl": ["hr"]}}],
                  "minimum_should_match": 1}},
    ]  # fmt: skip


def test_acl_forms() -> None:
    assert mapping.filter_clauses(SearchFilter(acl_groups=None)) == []  # trusted: no ACL
    (public_only,) = mapping.filter_clauses(SearchFilter())  # acl_groups=(): public only
    assert public_only == {
        "bool": {"should": [{"bool": {"must_not": [{"exists": {"field": "acl"}}]}}],
                 "minimum_should_match": 1}}  # fmt: skip
    unfiltered = mapping.bm25_body("q", 3, SearchFilter(acl_groups=None), 1.0)
    assert "filter" not in unfiltered["query"]["bool"]


def test_knn_body_filters_inside_the_knn_clause() -> None:
    vector = np.array([1, 0, 0], dtype=np.float32)
    body = mapping.knn_body(vector, 5, SearchFilter(collections=("doc",)), 1.5)
    assert body["size"] == 5 and body["timeout"] == "1500ms"
    knn = body["query"]["knn"]["vector"]
    assert knn["vector"] == [1.0, 0.0, 0.0]
    assert knn["k"] == mapping.num_candidates(5) >= 5
    assert knn["filter"]["bool"]["filter"][0] == {"terms": {"collection": ["doc"]}}
    assert "filter" not in mapping.knn_body(vector, 5, SearchFilter(acl_groups=None), 1)[
        "query"]["knn"]["vector"]  # fmt: skip
    assert mapping.num_candidates(1) == 100 and mapping.num_candidates(10**6) == 10_000


def test_every_search_carries_a_timeout_under_the_budget() -> None:
    assert mapping.timeout_param(0.0000001) == "1ms"
    for budget in (0.01, 0.1, 0.5, 1.0, 3.0, 30.0):
        server = mapping.server_timeout_s(budget)
        assert 0 < server < budget
        assert budget - server <= 0.3 + 1e-9  # never wastes more than 300ms of a budget
        assert 0.05 <= client_margin(budget) <= 0.5


def test_l2_score_converts_back_to_distance() -> None:
    for d in (0.0, 0.3, 1.0, math.sqrt(2), 2.0):
        score = 1 / (1 + d * d)
        assert mapping.l2_distance(score) == pytest.approx(d, abs=1e-9)
    assert mapping.l2_distance(0.0) == math.inf


def test_write_side_queries() -> None:
    stale = mapping.stale_chunks_query("E1", "v3", ["E1#0@v3"])["query"]["bool"]
    assert stale["filter"] == [{"term": {"source_id": "E1"}}, {"term": {"version": "v3"}}]
    assert stale["must_not"] == [{"ids": {"values": ["E1#0@v3"]}}]
    assert "must_not" not in mapping.stale_chunks_query("E1", "v3", [])["query"]["bool"]
    assert mapping.doc_filter("E1", None) == {"bool": {"filter": [{"term": {"source_id": "E1"}}]}}
    agg = mapping.document_hash_body("E1", "v3")
    assert agg["size"] == 0 and agg["aggs"]["hashes"]["terms"]["size"] == 2
