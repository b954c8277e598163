"""Cached passage states on a real OpenSearch node: the service stores them at ingest (its
default there) and reranks over them, a changed document's re-ingest replaces them, chunks
ingested without them get them from their first rerank (write-back), and an index created
before them (its ``dynamic: strict`` mapping lacks ``rerank_states``) gets the two fields
added in place when the engine starts, as does one created before the Latin-script leg's
``latin_vector``."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest
from opensearchpy import AsyncOpenSearch

from service._gen.retrieval.v1 import corpus_pb2, types_pb2
from service.app import DEFAULT_RERANKER
from service.config import Config
from service.engines.base import ChunkRecord, VectorField, make_chunk_id
from service.engines.opensearch import mapping
from service.engines.opensearch.engine import OpenSearchEngine
from service.models.base import EmbeddingBackend
from service.models.onnx_cross_encoder import OnnxCrossEncoder
from service.models.passage_states import rerank_passage_text
from service.offline.builder import default_models_dir
from tests.support.harness import (demo_documents, evidence_of, fill_caught_up, launch, passages_computed, result_of,
                                   shutdown)
from tests.support.opensearch import drop_prefix, opensearch_url_or_skip, unique_prefix
from tests.unit.engines.test_engine_contract import ALL, T, chunk, ids, unit

pytestmark = pytest.mark.integration


def _node_and_reranker(request: pytest.FixtureRequest) -> tuple[str, str, OnnxCrossEncoder]:
    """The node's URL, a fresh index prefix (dropped after the test) and the shipped split
    reranker; skips without them (fails under CI=true without the node)."""
    url = opensearch_url_or_skip()
    model_dir = default_models_dir() / DEFAULT_RERANKER
    if not (model_dir / "lower.onnx").is_file():
        pytest.skip(f"{model_dir} has no two-graph layout: run `make models`")
    prefix = unique_prefix("states")
    request.addfinalizer(lambda: drop_prefix(url, prefix))
    return url, prefix, OnnxCrossEncoder(model_dir)


async def test_service_stores_states_and_reingest_replaces_them(request: pytest.FixtureRequest, tmp_path: Path,
                                                               e5_embedder: EmbeddingBackend) -> None:
    url, prefix, reranker = _node_and_reranker(request)
    assert reranker.states_key is not None
    # No rerank_states here: with OpenSearch its default ("auto") stores them at ingest.
    cfg = dataclasses.replace(Config(), opensearch_url=url, opensearch_index_prefix=prefix,
                              data_dir=tmp_path / "data", reranker_model="")
    assert cfg.states_at_ingest
    live = await launch(cfg, e5_embedder, reranker)
    try:
        engine = live.app.engine
        first = (await engine.get_chunks([make_chunk_id("kb-password-reset", 0, "v1")]))[0]
        ref = (first.chunk_id, first.content_hash)
        assert ref[0] in await engine.passage_states([ref], reranker.states_key)
        events = await live.retrieve(query="reset password", top_k=3)
        rerank = next(leg for leg in result_of(events).legs if leg.kind == types_pb2.LEG_KIND_RERANK)
        assert rerank.status == types_pb2.LEG_STATUS_OK and evidence_of(events)
        changed = corpus_pb2.Document(source_id="kb-password-reset", version="v1", title="Resetting your password",
                                      text="Open Settings, choose Security, then Reset password.",
                                      collection=types_pb2.COLLECTION_DOC)
        summary = await live.ingest([changed])
        assert summary.documents_indexed == 1 and not summary.errors
        await engine.refresh()
        now = (await engine.get_chunks([first.chunk_id]))[0]
        assert now.content_hash != first.content_hash
        assert await engine.passage_states([ref], reranker.states_key) == {}  # the old content's states are gone
        assert now.chunk_id in await engine.passage_states([(now.chunk_id, now.content_hash)], reranker.states_key)
    finally:
        await shutdown(live)


async def test_chunks_ingested_without_states_get_them_from_their_first_rerank(
        request: pytest.FixtureRequest, tmp_path: Path, e5_embedder: EmbeddingBackend) -> None:
    """An index filled before states were stored at ingest (or under another reranker),
    with the fill off: write-back fills each head chunk once, so reranks do not compute
    those chunks forever."""
    url, prefix, reranker = _node_and_reranker(request)
    assert reranker.states_key is not None
    before = dataclasses.replace(Config(), opensearch_url=url, opensearch_index_prefix=prefix,
                                 data_dir=tmp_path / "before", reranker_model="", rerank_states="false")
    assert not before.states_write_back  # nothing stored at ingest, nothing written back
    old = await launch(before, e5_embedder, reranker)
    try:
        chunks = await old.app.engine.get_chunks([make_chunk_id("kb-password-reset", 0, "v1")])
        refs = [(c.chunk_id, c.content_hash) for c in chunks]
        assert refs and await old.app.engine.passage_states(refs, reranker.states_key) == {}
    finally:
        await shutdown(old)
    cfg = dataclasses.replace(before, data_dir=tmp_path / "now", rerank_states="auto", rerank_states_fill=False)
    assert cfg.states_at_ingest and cfg.states_write_back
    live = await launch(cfg, e5_embedder, reranker, demo=False)
    try:
        events = await live.retrieve(query="reset password", top_k=3)
        rerank = next(leg for leg in result_of(events).legs if leg.kind == types_pb2.LEG_KIND_RERANK)
        assert rerank.status == types_pb2.LEG_STATUS_OK and evidence_of(events)
        await live.app.runner.rerank.states_write_back.drain()
        assert live.app.runner.rerank.states_write_back.written > 0
        stored = await live.app.engine.passage_states(refs, reranker.states_key)
        assert refs[0][0] in stored
        again = await live.retrieve(query="reset password", top_k=3)
        assert [e.evidence_id for e in evidence_of(again)] == [e.evidence_id for e in evidence_of(events)]
    finally:
        await shutdown(live)


async def test_a_chunk_past_the_passage_cap_gets_its_vector_at_its_first_rerank(
        request: pytest.FixtureRequest, tmp_path: Path, e5_embedder: EmbeddingBackend) -> None:
    """The default on OpenSearch stores what the embedding pass gives at ingest and leaves a
    chunk past the passage cap (its rerank row is shorter than what the embedder read) to
    the fill, or with the fill off to its first rerank; write-back then stores it on the
    node, and the next rerank reads it."""
    from tests.e2e.test_rerank_states import LONG_ZH, PLAIN

    url, prefix, reranker = _node_and_reranker(request)
    assert reranker.states_key is not None
    cfg = dataclasses.replace(Config(), opensearch_url=url, opensearch_index_prefix=prefix,
                              data_dir=tmp_path / "data", reranker_model="", rerank_states_fill=False)
    assert cfg.states_at_ingest and cfg.states_write_back and not cfg.rerank_states_second_pass
    live = await launch(cfg, e5_embedder, reranker, demo=False)
    try:
        docs = [corpus_pb2.Document(source_id=source_id, version="v1", text=text, collection=types_pb2.COLLECTION_DOC)
                for source_id, text in (("long-zh", LONG_ZH), ("short-zh", PLAIN[1]))]
        summary = await live.ingest(docs)
        assert summary.documents_indexed == 2 and not summary.errors
        await live.app.engine.refresh()
        ids = [make_chunk_id(d.source_id, 0, d.version) for d in docs]
        chunks = {c.chunk_id: c for c in await live.app.engine.get_chunks(ids)}
        long_ref, short_ref = [(chunks[i].chunk_id, chunks[i].content_hash) for i in ids]
        assert list(await live.app.engine.passage_states([long_ref, short_ref], reranker.states_key)) == [short_ref[0]]
        events = await live.retrieve(query="长期护理保险的等待期", top_k=3)
        rerank = next(leg for leg in result_of(events).legs if leg.kind == types_pb2.LEG_KIND_RERANK)
        assert rerank.status == types_pb2.LEG_STATUS_OK and "long-zh" in {e.source_id for e in evidence_of(events)}
        await live.app.runner.rerank.states_write_back.drain()
        await live.app.engine.refresh()
        stored = await live.app.engine.passage_states([long_ref], reranker.states_key)
        assert stored == {long_ref[0]: reranker.passage_states([rerank_passage_text("", "", LONG_ZH)])[0]}, \
            "the vector a second pass at ingest would have stored"
    finally:
        await shutdown(live)


async def test_the_fill_gives_states_to_chunks_stored_without_and_past_the_cap(
        request: pytest.FixtureRequest, tmp_path: Path, e5_embedder: EmbeddingBackend,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default on OpenSearch with the fill (``ingest/states_fill.py``): chunks stored
    before states were on (found by the start's scan) and a chunk past the passage cap
    (handed over by ingest) get their states once ingest is quiet, the very bytes a rerank
    would compute, so the first rerank computes none."""
    from tests.e2e.test_rerank_states import LONG_ZH
    from tests.support.scrape import parse

    url, prefix, reranker = _node_and_reranker(request)
    assert reranker.states_key is not None
    before = dataclasses.replace(Config(), opensearch_url=url, opensearch_index_prefix=prefix,
                                 data_dir=tmp_path / "before", reranker_model="", rerank_states="false")
    old = await launch(before, e5_embedder, reranker)  # the demo corpus, stored without states
    await shutdown(old)
    cfg = dataclasses.replace(before, data_dir=tmp_path / "now", rerank_states="auto", rerank_states_fill_idle_s=0.2)
    assert cfg.states_at_ingest and cfg.rerank_states_fill and not cfg.rerank_states_second_pass
    live = await launch(cfg, e5_embedder, reranker, demo=False)
    try:
        engine, fill = live.app.engine, live.app.ingestor.states_fill
        assert fill is not None
        summary = await live.ingest([corpus_pb2.Document(source_id="long-zh", version="v1", text=LONG_ZH,
                                                         collection=types_pb2.COLLECTION_DOC)])
        assert summary.documents_indexed == 1 and not summary.errors
        await fill_caught_up(fill, 120)
        await engine.refresh()
        assert await engine.chunks_without_states(reranker.states_key, "", 1000) == ([], None)
        long_id = make_chunk_id("long-zh", 0, "v1")
        demo_id = make_chunk_id("kb-password-reset", 0, "v1")
        chunks = {c.chunk_id: c for c in await engine.get_chunks([long_id, demo_id])}
        got = await engine.passage_states([(c.chunk_id, c.content_hash) for c in chunks.values()], reranker.states_key)
        assert got == {i: reranker.passage_states([chunks[i].search_text])[0] for i in (long_id, demo_id)}
        scraped = parse(live.app.metrics.exposition().decode())
        assert scraped[("retrieval_passage_states_fill_total", (("result", "written"),))] == fill.progress.written > 1

        left = passages_computed(monkeypatch, live.app)
        events = await live.retrieve(query="长期护理保险的等待期", top_k=3)
        assert "long-zh" in {e.source_id for e in evidence_of(events)}
        assert left == [0], "every passage of the first rerank was stored"
    finally:
        await shutdown(live)


async def _old_index(url: str, prefix: str, without: tuple[str, ...], chunks: Sequence[ChunkRecord] = ()) -> None:
    """An index made the way an older version made it: this mapping minus ``without``
    (``dynamic: strict`` then refuses those fields), holding ``chunks``."""
    old = copy.deepcopy(mapping.index_template(prefix, 8, 1, 0))
    for name in without:
        del old["template"]["mappings"]["properties"][name]
    client = AsyncOpenSearch(hosts=[url])
    try:
        await client.indices.put_index_template(name=mapping.template_name(prefix), body=old)
        await client.indices.create(index=mapping.index_name(prefix, mapping.MAPPING_VERSION),
                                    body=mapping.create_index_body(prefix))
        for c in chunks:
            await client.index(index=mapping.alias_name(prefix), id=c.chunk_id, refresh=True,
                               body=mapping.chunk_to_doc(c))
    finally:
        await client.close()


async def test_old_index_gets_the_states_fields(request: pytest.FixtureRequest) -> None:
    url = opensearch_url_or_skip()
    prefix = unique_prefix("states")
    request.addfinalizer(lambda: drop_prefix(url, prefix))
    await _old_index(url, prefix, without=tuple(mapping.STATES_PROPERTIES))
    engine = OpenSearchEngine(url, index_prefix=prefix, dimension=8)
    await engine.start()
    try:
        c = dataclasses.replace(chunk("S1", 0, "alpha policy"), rerank_states=b"\x00states\xff", rerank_states_key="k")
        report = await engine.replace_document("S1", "v1", [c])
        assert report.written == 1 and not report.errors, report
        assert await engine.passage_states([(c.chunk_id, c.content_hash)], "k") == {c.chunk_id: b"\x00states\xff"}
    finally:
        await engine.close()


async def test_old_index_gets_the_latin_vector_field(request: pytest.FixtureRequest) -> None:
    """An index made before the Latin-script leg (no ``latin_vector``, and before the states
    too) gets both added in place; its chunks keep answering the primary kNN, and a chunk
    written afterwards with a Latin-script vector answers that field's kNN."""
    url = opensearch_url_or_skip()
    prefix = unique_prefix("latin")
    request.addfinalizer(lambda: drop_prefix(url, prefix))
    await _old_index(url, prefix, without=(*mapping.STATES_PROPERTIES, VectorField.LATIN.value),
                     chunks=[chunk("S0", 0, "old policy", vector=unit(1.0))])
    engine = OpenSearchEngine(url, index_prefix=prefix, dimension=8, latin_dimension=8)
    await engine.start()
    try:
        c = dataclasses.replace(chunk("S1", 0, "alpha policy", vector=unit(0.0, 1.0)), latin_vector=unit(1.0))
        report = await engine.replace_document("S1", "v1", [c])
        assert report.written == 1 and not report.errors, report
        await engine.refresh()
        latin = await engine.knn(unit(1.0), 5, ALL, T, field=VectorField.LATIN)
        assert ids(latin.hits) == [c.chunk_id]  # the old chunk has no Latin-script vector
        assert ids((await engine.knn(unit(1.0), 5, ALL, T)).hits) == ["S0#0@v1", c.chunk_id]
    finally:
        await engine.close()
