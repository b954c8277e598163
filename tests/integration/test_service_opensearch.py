"""The real service (gRPC, pipeline, e5 int8 embedder) with the OpenSearch engine against a
real node: the demo corpus goes in through Ingest and must answer exactly what the embedded
engine answers in tests/e2e (same tables: tests/support/demo_expectations.py), with
``AttemptResult.engine == "opensearch"``."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from service._gen.retrieval.v1 import corpus_pb2, retrieval_pb2, types_pb2
from service.config import Config
from service.demo.corpus import DEMO_DOCUMENTS
from service.engines.base import SearchFilter
from service.models.base import EmbeddingBackend
from tests.support import demo_expectations as expect
from tests.support.harness import Live, demo_documents, evidence_of, legs_of, result_of, shutdown
from tests.support.opensearch import drop_prefix, opensearch_url_or_skip, unique_prefix
from tests.support.service_live import start_live, stop_live

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OPENSEARCH = "opensearch"


@pytest.fixture(scope="module")
def os_url() -> str:
    return opensearch_url_or_skip()


@pytest.fixture(scope="module")
def os_prefix(os_url: str) -> Iterator[str]:
    prefix = unique_prefix("svc")
    yield prefix
    drop_prefix(os_url, prefix)


def os_config(url: str, prefix: str, data_dir: Path, **overrides: Any) -> Config:
    return dataclasses.replace(Config(), opensearch_url=url, opensearch_index_prefix=prefix,
                               data_dir=data_dir, **overrides)


@pytest.fixture(scope="module")
async def os_demo(os_url: str, os_prefix: str, tmp_path_factory: pytest.TempPathFactory,
                  e5_embedder: EmbeddingBackend) -> AsyncIterator[Live]:
    """One service on OpenSearch with the demo corpus ingested through gRPC (read-only tests)."""
    live = await start_live(os_config(os_url, os_prefix, tmp_path_factory.mktemp("os-demo")), e5_embedder)
    try:
        summary = await live.ingest(demo_documents())
        assert not summary.errors, summary.errors
        assert summary.documents_indexed == len(DEMO_DOCUMENTS), summary
        yield live
    finally:
        await stop_live(live)


def assert_opensearch(result: retrieval_pb2.AttemptResult) -> None:
    assert result.engine == OPENSEARCH, result.engine


@pytest.mark.parametrize("query,expected_source", expect.RANKING_CASES)
async def test_english_and_chinese_queries_rank_the_expected_source_first(
    os_demo: Live, query: str, expected_source: str
) -> None:
    events = await os_demo.retrieve(query=query, top_k=3)
    result = result_of(events)
    assert_opensearch(result)
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND
    assert legs_of(result)["LEG_KIND_BM25"] == legs_of(result)["LEG_KIND_KNN"] == "LEG_STATUS_OK"
    assert evidence_of(events)[0].source_id == expected_source, [e.evidence_id for e in evidence_of(events)]


@pytest.mark.parametrize("query,version", expect.VERSION_CASES)
async def test_version_sensitive_query_ranks_the_right_version_first(os_demo: Live, query: str, version: str) -> None:
    # Ungated: this is about versions. With rerank on, "what is new in v2.4" sits under the
    # default gate (reranker 0.045 < 0.08; README, "Relevance and quality", known limits).
    events = await os_demo.retrieve(query=query, top_k=3, options=retrieval_pb2.RetrievalOptions(min_quality=1e-9))
    assert_opensearch(result_of(events))
    top = evidence_of(events)[0]
    assert (top.source_id, top.version) == ("release-notes", version)
    assert top.evidence_id.endswith(f"@{version}")


@pytest.mark.parametrize("request_fields,outcome", [(r, o) for _, r, o in expect.OUTCOME_CASES],
                         ids=[case for case, _, _ in expect.OUTCOME_CASES])
async def test_outcomes_produced_by_data_and_policy(os_demo: Live, request_fields: dict[str, Any], outcome: int) -> None:
    events = await os_demo.retrieve(**request_fields)
    result = result_of(events)
    assert_opensearch(result)
    assert result.outcome == outcome, types_pb2.AttemptOutcome.Name(result.outcome)
    assert evidence_of(events) == []
    assert not result.degraded
    if outcome == types_pb2.ATTEMPT_OUTCOME_EMPTY:
        # Every leg finished on the real node and nothing matched.
        assert legs_of(result)["LEG_KIND_BM25"] == legs_of(result)["LEG_KIND_KNN"] == "LEG_STATUS_OK"
        assert result.retrieved_count == 0
    elif outcome == types_pb2.ATTEMPT_OUTCOME_INSUFFICIENT:
        assert result.retrieved_count > 0 and 0 < result.top_quality < 0.99
    elif outcome == types_pb2.ATTEMPT_OUTCOME_INADMISSIBLE:
        assert result.retrieved_count >= 1 and result.admissible_count == 0
    elif outcome == types_pb2.ATTEMPT_OUTCOME_PERMISSION_DENIED:
        assert [e.WhichOneof("event") for e in events] == ["result"]  # nothing was searched
        record = (await os_demo.retrieval.GetAttempt(
            retrieval_pb2.GetAttemptRequest(attempt_id=result.attempt_id))).attempt
        assert record.outcome == outcome and record.gap_id == "g-1"


async def test_a_version_pin_returns_only_that_version(os_demo: Live) -> None:
    # Ungated: this is about versions; a two-word title query sits near the default gate.
    pinned = await os_demo.retrieve(query="release notes", top_k=5, version_pins={"release-notes": "v2.3"},
                                    filters=retrieval_pb2.Filters(source_ids=["release-notes"]),
                                    options=retrieval_pb2.RetrievalOptions(min_quality=1e-9))
    assert_opensearch(result_of(pinned))
    assert {e.version for e in evidence_of(pinned)} == {"v2.3"}


async def test_budget_is_enforced_and_an_exhausted_budget_searches_nothing(os_demo: Live) -> None:
    outcomes = []
    run_id = unique_prefix("run")
    for _ in range(3):
        r = result_of(await os_demo.retrieve(query="invoice", top_k=2, run_id=run_id,
                                             budget=retrieval_pb2.RunBudget(max_searches=2)))
        assert_opensearch(r)
        outcomes.append((r.outcome, r.budget_before, r.budget_after))
    found, denied = types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND, types_pb2.ATTEMPT_OUTCOME_BUDGET_DENIED
    assert outcomes == [(found, 2, 1), (found, 1, 0), (denied, 0, 0)]
    again = result_of(await os_demo.retrieve(query="invoice", top_k=2, run_id=run_id))
    assert again.outcome == denied and not again.legs


async def test_acl_is_applied_inside_the_opensearch_query(os_demo: Live) -> None:
    # An anonymous caller never sees the restricted source...
    events = await os_demo.retrieve(query=expect.ACL_QUERY, top_k=10)
    assert_opensearch(result_of(events))
    assert all(e.source_id != expect.ACL_SOURCE for e in evidence_of(events))
    # ...and it is filtered inside the engine query, not after retrieval: restricted to that
    # source, the node returns nothing at all (EMPTY, zero retrieved), not INADMISSIBLE.
    only = result_of(await os_demo.retrieve(query="orion-pager", top_k=5,
                                            filters=retrieval_pb2.Filters(source_ids=[expect.ACL_SOURCE])))
    assert only.outcome == types_pb2.ATTEMPT_OUTCOME_EMPTY and only.retrieved_count == 0
    # The same engine query with the group, or with no ACL restriction, does find it.
    engine = os_demo.app.engine
    for groups, visible in (((), False), (("other",), False), ((expect.ACL_GROUP,), True), (None, True)):
        flt = SearchFilter(source_ids=(expect.ACL_SOURCE,), acl_groups=groups)
        hits = (await engine.bm25("orion-pager escalation", 5, flt, 5.0)).hits
        assert bool(hits) is visible, (groups, [h.chunk.chunk_id for h in hits])


async def test_api_key_groups_reach_the_opensearch_acl_filter(
    os_demo: Live, os_url: str, os_prefix: str, tmp_path: Path, e5_embedder: EmbeddingBackend
) -> None:
    """A second service (auth on) over the same indices: the caller's groups decide."""
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[principals]]\nname = "support-bot"\napi_key = "s3cret"\ngroups = ["{expect.ACL_GROUP}"]\n\n'
                    '[[principals]]\nname = "public-bot"\napi_key = "pub"\ngroups = []\n')
    live = await start_live(os_config(os_url, os_prefix, tmp_path / "auth", api_keys_file=str(keys)), e5_embedder)
    try:
        q: dict[str, Any] = {"query": "orion-pager escalation", "top_k": 3}
        support = await live.retrieve(metadata=(("x-api-key", "s3cret"),), **q)
        assert_opensearch(result_of(support))
        assert evidence_of(support)[0].source_id == expect.ACL_SOURCE
        public = await live.retrieve(metadata=(("x-api-key", "pub"),), **q)
        assert all(e.source_id != expect.ACL_SOURCE for e in evidence_of(public))
        hidden = corpus_pb2.GetEvidenceRequest(evidence_id=f"{expect.ACL_SOURCE}#0@v1")
        assert (await live.corpus.GetEvidence(hidden, metadata=(("x-api-key", "s3cret"),))).fidelity == \
            corpus_pb2.FIDELITY_EXACT
        assert (await live.corpus.GetEvidence(hidden, metadata=(("x-api-key", "pub"),))).fidelity == \
            corpus_pb2.FIDELITY_DEGRADED
    finally:
        await stop_live(live)


async def test_get_evidence_returns_the_exact_version(os_demo: Live) -> None:
    for version in expect.RELEASE_NOTES_VERSIONS:
        res = await os_demo.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id=f"release-notes#0@{version}"))
        assert res.fidelity == corpus_pb2.FIDELITY_EXACT
        assert version in res.evidence.excerpt and res.evidence.version == version
        assert list(res.available_versions) == expect.RELEASE_NOTES_VERSIONS
    gone = await os_demo.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id="release-notes#0@v1.0"))
    assert gone.fidelity == corpus_pb2.FIDELITY_DEGRADED and not gone.HasField("evidence")
    assert list(gone.available_versions) == expect.RELEASE_NOTES_VERSIONS


async def test_reingest_is_idempotent_and_new_content_replaces_only_that_version(
    os_url: str, tmp_path: Path, e5_embedder: EmbeddingBackend
) -> None:
    prefix = unique_prefix("reingest")
    live = await start_live(os_config(os_url, prefix, tmp_path / "data"), e5_embedder)
    try:
        first = await live.ingest(demo_documents())
        assert first.documents_indexed == len(DEMO_DOCUMENTS) and not first.errors
        chunks_before = (await live.app.engine.stats()).chunk_count
        again = await live.ingest(demo_documents())
        assert again.documents_unchanged == len(DEMO_DOCUMENTS) and again.documents_indexed == 0
        assert (await live.app.engine.stats()).chunk_count == chunks_before  # no duplicates
        changed = corpus_pb2.Document(source_id="release-notes", version="v2.4", title="Release notes v2.4",
                                      text="Version v2.4 adds passkeys.", collection=types_pb2.COLLECTION_DOC)
        assert (await live.ingest([changed])).documents_indexed == 1
        v23 = await live.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id="release-notes#0@v2.3"))
        assert v23.fidelity == corpus_pb2.FIDELITY_EXACT and "offline sync" in v23.evidence.excerpt
        v24 = await live.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id="release-notes#0@v2.4"))
        assert "passkeys" in v24.evidence.excerpt
        stale = await live.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id="release-notes#1@v2.4"))
        assert stale.fidelity == corpus_pb2.FIDELITY_DEGRADED
        top = evidence_of(await live.retrieve(query="passkeys", top_k=3,  # one keyword: ungated (about versions)
                                              options=retrieval_pb2.RetrievalOptions(min_quality=1e-9)))[0]
        assert top.evidence_id == "release-notes#0@v2.4"
    finally:
        await stop_live(live)
        drop_prefix(os_url, prefix)


async def test_the_latin_script_leg_on_opensearch(os_url: str, tmp_path: Path, e5_embedder: EmbeddingBackend) -> None:
    """The Latin-script leg through the service on a real node: English chunks carry the
    second vector, an English query's KNN_LATIN answers from it and fuses, a Chinese query
    skips it (the hashing stand-in plays the second embedder, as in tests/e2e/test_latin_leg.py)."""
    from service.models.dummy import HashEmbedder
    from service.script import has_han
    from tests.support.harness import launch

    prefix = unique_prefix("latin")
    live = await launch(os_config(os_url, prefix, tmp_path), e5_embedder, latin_embedder=HashEmbedder())
    try:
        events = await live.retrieve(query="How do I reset my password?", top_k=5)
        result = result_of(events)
        assert_opensearch(result)
        legs = legs_of(result)
        assert legs["LEG_KIND_BM25"] == legs["LEG_KIND_KNN"] == legs["LEG_KIND_KNN_LATIN"] == "LEG_STATUS_OK"
        assert any(e.HasField("latin_dense_score") for e in evidence_of(events))
        assert all(not has_han(e.excerpt) for e in evidence_of(events) if e.HasField("latin_dense_score"))
        zh = result_of(await live.retrieve(query="如何开具发票", top_k=5))
        assert legs_of(zh)["LEG_KIND_KNN_LATIN"] == "LEG_STATUS_SKIPPED"
    finally:
        await shutdown(live)
        drop_prefix(os_url, prefix)


async def test_an_index_from_before_the_latin_leg_catches_up_on_opensearch(
        os_url: str, tmp_path: Path, e5_embedder: EmbeddingBackend) -> None:
    """An index ingested without the Latin-script leg, served with it: the backfill
    (service/ingest/backfill.py) pages through the chunks without the vector on the real
    node and stores it onto each Latin-script chunk, and then the leg answers."""
    from service.engines.base import VectorField
    from service.models.dummy import HashEmbedder
    from service.script import has_han
    from tests.support.harness import launch

    prefix = unique_prefix("latinfill")
    try:
        old = await launch(os_config(os_url, prefix, tmp_path / "a", latin_embedding_model=""), e5_embedder)
        without = await old.app.engine.chunks_without(VectorField.LATIN, "", 1000)
        assert any(not has_han(text) for _, _, text in without)  # English chunks without the vector
        await shutdown(old)
        live = await launch(os_config(os_url, prefix, tmp_path / "b"), e5_embedder, demo=False,
                            latin_embedder=HashEmbedder())
        try:
            if live.app.latin_backfill is not None:  # the demo is one page: usually done at start
                assert (await live.app.latin_backfill).done
            left = await live.app.engine.chunks_without(VectorField.LATIN, "", 1000)
            assert left and all(has_han(text) for _, _, text in left)
            result = result_of(await live.retrieve(query="How do I reset my password?", top_k=5))
            assert_opensearch(result)
            assert legs_of(result)["LEG_KIND_KNN_LATIN"] == "LEG_STATUS_OK"
            [leg] = [leg for leg in result.legs if leg.kind == types_pb2.LEG_KIND_KNN_LATIN]
            assert leg.hit_count > 0
        finally:
            await shutdown(live)
    finally:
        drop_prefix(os_url, prefix)
