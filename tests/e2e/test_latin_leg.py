"""The Latin-script dense leg through real gRPC (README "The Latin-script dense leg"): with a
second embedder served, chunks without Han characters get its vector at ingest, queries
without Han characters run KNN_LATIN beside BM25 and KNN and fuse all three, Chinese queries
report it SKIPPED with the reason, and a request may name it alone. The second embedder here
is the hashing stand-in (a space of its own, unlike e5's), so where the leg's hits come from
is visible."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from service._gen.retrieval.v1 import retrieval_pb2, types_pb2
from service.config import Config
from service.engines.base import SearchFilter, VectorField
from service.engines.embedded.engine import EmbeddedEngine
from service.ingest import backfill
from service.models.base import EmbeddingBackend
from service.models.dummy import HashEmbedder
from service.script import has_han
from tests.support.harness import Live, StartServer, evidence_of, launch, legs_of, result_of, shutdown

pytestmark = pytest.mark.slow

ENGLISH = "How do I reset my password?"
CHINESE = "如何开具发票"


@pytest.fixture
async def latin(start_server: StartServer) -> Live:
    return await start_server(latin_embedder=HashEmbedder())


async def test_ingest_gives_a_latin_vector_to_chunks_without_han_only(latin: Live) -> None:
    engine = latin.app.engine
    hits = (await engine.bm25("password 发票 invoice", 200, SearchFilter(acl_groups=None), 5.0)).hits
    chunks = await engine.get_chunks([h.chunk.chunk_id for h in hits])
    han = [c for c in chunks if has_han(c.search_text)]
    latin_only = [c for c in chunks if c not in han]
    assert han and latin_only
    assert all(c.latin_vector is None and c.vector is not None for c in han)
    assert all(c.latin_vector is not None and c.vector is not None for c in latin_only)
    # The leg's own kNN reads that field: every hit is a chunk without Han characters.
    query = HashEmbedder().infer(HashEmbedder().tokenize([ENGLISH], "query"))[0]
    by_latin = (await engine.knn(query, 10, SearchFilter(acl_groups=None), 5.0, VectorField.LATIN)).hits
    assert by_latin and not any(has_han(h.chunk.search_text) for h in by_latin)


async def test_english_query_runs_and_fuses_three_legs(latin: Live) -> None:
    events = await latin.retrieve(query=ENGLISH, top_k=5)
    result = result_of(events)
    assert legs_of(result) == {"LEG_KIND_BM25": "LEG_STATUS_OK", "LEG_KIND_KNN": "LEG_STATUS_OK",
                               "LEG_KIND_KNN_LATIN": "LEG_STATUS_OK", "LEG_KIND_RERANK": "LEG_STATUS_SKIPPED"}
    [knn_latin] = [leg for leg in result.legs if leg.kind == types_pb2.LEG_KIND_KNN_LATIN]
    assert knn_latin.hit_count > 0 and knn_latin.timing.inference_ms > 0
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND
    assert any(e.HasField("latin_dense_score") for e in evidence_of(events))


async def test_chinese_query_skips_the_latin_leg_with_the_reason(latin: Live) -> None:
    result = result_of(await latin.retrieve(query=CHINESE, top_k=5))
    [knn_latin] = [leg for leg in result.legs if leg.kind == types_pb2.LEG_KIND_KNN_LATIN]
    assert knn_latin.status == types_pb2.LEG_STATUS_SKIPPED and "Han" in knn_latin.detail
    assert legs_of(result)["LEG_KIND_KNN"] == "LEG_STATUS_OK"


async def test_the_latin_leg_can_be_requested_alone(latin: Live) -> None:
    options = retrieval_pb2.RetrievalOptions(legs=[types_pb2.LEG_KIND_KNN_LATIN])
    events = await latin.retrieve(query=ENGLISH, top_k=5, options=options)
    result = result_of(events)
    assert legs_of(result)["LEG_KIND_KNN_LATIN"] == "LEG_STATUS_OK"
    assert legs_of(result)["LEG_KIND_BM25"] == "LEG_STATUS_SKIPPED" and legs_of(result)["LEG_KIND_KNN"] == "LEG_STATUS_SKIPPED"
    items = evidence_of(events)
    assert items and all(e.HasField("latin_dense_score") and not e.HasField("dense_score") for e in items)


async def test_a_server_without_the_leg_skips_it_when_asked(start_server: StartServer) -> None:
    live = await start_server()
    options = retrieval_pb2.RetrievalOptions(legs=[types_pb2.LEG_KIND_BM25, types_pb2.LEG_KIND_KNN_LATIN])
    result = result_of(await live.retrieve(query=ENGLISH, top_k=5, options=options))
    legs = legs_of(result)
    assert legs["LEG_KIND_BM25"] == "LEG_STATUS_OK" and legs["LEG_KIND_KNN_LATIN"] == "LEG_STATUS_SKIPPED"
    plain = result_of(await live.retrieve(query=ENGLISH, top_k=5))
    assert "LEG_KIND_KNN_LATIN" not in legs_of(plain)  # not served: not reported unless asked


async def test_a_store_from_before_the_leg_catches_up_and_until_then_two_legs_serve(
        tmp_path: Path, e5_embedder: EmbeddingBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    # A store ingested without the leg (an upgrade to the default that serves it) has no
    # Latin-script vectors. The leg must not search it half-filled: until the backfill is done
    # it is SKIPPED with the progress as its reason, and the two legs fuse exactly as before.
    cfg = dataclasses.replace(Config(), data_dir=tmp_path / "data", reranker_model="", latin_embedding_model="")
    old = await launch(cfg, e5_embedder)
    before = await old.retrieve(query=ENGLISH, top_k=5)
    await shutdown(old)

    monkeypatch.setattr(backfill, "PAGE", 4)  # paged as a large store is
    gate = asyncio.Event()
    real_put = EmbeddedEngine.put_vectors

    async def held_put(self: EmbeddedEngine, field: VectorField, vectors: Any) -> int:
        if started.is_set():  # the first page is stored at start; later ones wait for the test
            await gate.wait()
        return await real_put(self, field, vectors)

    started = asyncio.Event()
    monkeypatch.setattr(EmbeddedEngine, "put_vectors", held_put)
    live = await launch(cfg, e5_embedder, demo=False, latin_embedder=HashEmbedder())
    try:
        started.set()
        assert live.app.latin_backfill is not None and not live.app.latin_backfill.done()
        during = await live.retrieve(query=ENGLISH, top_k=5)
        result = result_of(during)
        [leg] = [leg for leg in result.legs if leg.kind == types_pb2.LEG_KIND_KNN_LATIN]
        assert leg.status == types_pb2.LEG_STATUS_SKIPPED and "catching up" in leg.detail, leg.detail
        assert [(e.evidence_id, e.fused_score) for e in evidence_of(during)] == [
            (e.evidence_id, e.fused_score) for e in evidence_of(before)]
        assert result.top_quality == result_of(before).top_quality
        assert result.relevance_level == result_of(before).relevance_level

        gate.set()
        progress = await asyncio.wait_for(live.app.latin_backfill, 60)
        assert progress.done and progress.stored > 4
        left = await live.app.engine.chunks_without(VectorField.LATIN, "", 1000)
        assert left and all(has_han(text) for _, _, text in left)  # only Han chunks go without
        after = result_of(await live.retrieve(query=ENGLISH, top_k=5))
        assert legs_of(after)["LEG_KIND_KNN_LATIN"] == "LEG_STATUS_OK"
    finally:
        await shutdown(live)
    # Caught up: the next start finds nothing to do and serves the leg from the first query.
    again = await launch(cfg, e5_embedder, demo=False, latin_embedder=HashEmbedder())
    try:
        assert again.app.latin_backfill is None and again.app.runner.latin_pending == ""
        assert legs_of(result_of(await again.retrieve(query=ENGLISH, top_k=5)))["LEG_KIND_KNN_LATIN"] == "LEG_STATUS_OK"
    finally:
        await shutdown(again)
