"""The passage-states part of the engine contract (``Engine.passage_states``), run against
each kind in conftest.ENGINE_KINDS: states are stored with their chunk, survive a restart,
are replaced by a re-ingest and dropped with the document, are only handed out for the key
and content hash they were written for, and never ride along with search hits."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import pytest

from service.engines.base import ChunkRecord, Engine

if TYPE_CHECKING:
    from conftest import EngineKit

from test_engine_contract import ALL, T, chunk, put, unit

KEY = "reranker-a:lower-0123:f1"


def with_states(c: ChunkRecord, blob: bytes, key: str = KEY) -> ChunkRecord:
    return dataclasses.replace(c, rerank_states=blob, rerank_states_key=key)


def ref(c: ChunkRecord) -> tuple[str, str]:
    return (c.chunk_id, c.content_hash)


async def test_states_are_stored_with_the_chunk(engine_kit: EngineKit) -> None:
    engine = engine_kit.engine
    a = with_states(chunk("S1", 0, "alpha policy"), b"\x00\x01states-a\xff" * 100)
    b = with_states(chunk("S1", 1, "beta policy"), b"states-b")
    c = chunk("S1", 2, "gamma policy")  # ingested without states
    await put(engine, a, b, c)
    got = await engine.passage_states([ref(a), ref(b), ref(c), ("missing#0@v1", "h")], KEY)
    assert got == {a.chunk_id: a.rerank_states, b.chunk_id: b.rerank_states}
    assert await engine.passage_states([], KEY) == {}


async def test_states_never_ride_along_with_hits(engine_kit: EngineKit) -> None:
    engine = engine_kit.engine
    a = with_states(chunk("S1", 0, "alpha policy", vector=unit(1.0)), b"big" * 1000)
    await put(engine, a)
    hits = (await engine.bm25("alpha", 5, ALL, T)).hits + (await engine.knn(unit(1.0), 5, ALL, T)).hits
    assert hits and all(h.chunk.rerank_states is None and not h.chunk.rerank_states_key for h in hits)
    [fetched] = await engine.get_chunks([a.chunk_id])
    assert fetched.rerank_states is None


async def test_stale_key_or_content_gets_nothing(engine_kit: EngineKit) -> None:
    engine = engine_kit.engine
    a = with_states(chunk("S1", 0, "alpha policy"), b"states-a")
    await put(engine, a)
    assert await engine.passage_states([ref(a)], "reranker-b:lower-9999:f1") == {}  # another model
    assert await engine.passage_states([(a.chunk_id, "another-content-hash")], KEY) == {}


async def test_reingest_replaces_and_delete_drops_states(engine_kit: EngineKit) -> None:
    engine = engine_kit.engine
    old = with_states(chunk("S1", 0, "alpha policy", content_hash="h1"), b"old states")
    gone = with_states(chunk("S1", 1, "beta policy", content_hash="h1"), b"old states 1")
    await put(engine, old, gone)
    new = with_states(chunk("S1", 0, "alpha policy changed", content_hash="h2"), b"new states")
    await put(engine, new)  # the changed document has one chunk now
    assert await engine.passage_states([ref(new), (gone.chunk_id, "h1")], KEY) == {new.chunk_id: b"new states"}
    assert await engine.passage_states([ref(old)], KEY) == {}  # old content hash: stale
    # Re-ingested without states (say the reranker was off): the old ones must not linger.
    await put(engine, dataclasses.replace(new, rerank_states=None, rerank_states_key=""))
    assert await engine.passage_states([ref(new)], KEY) == {}
    await put(engine, new)
    await engine.delete_document("S1")
    await engine.refresh()
    assert await engine.passage_states([ref(new)], KEY) == {}


async def test_states_survive_a_restart(engine_kit: EngineKit) -> None:
    if engine_kit.reopen is None:
        pytest.skip(f"{engine_kit.kind} cannot be reopened on the same store")
    a = with_states(chunk("S1", 0, "alpha policy"), bytes(range(256)) * 40)
    await put(engine_kit.engine, a)
    engine: Engine = await engine_kit.reopen()
    assert await engine.passage_states([ref(a)], KEY) == {a.chunk_id: a.rerank_states}


async def test_write_back_lands_only_on_the_chunk_version_it_was_computed_for(engine_kit: EngineKit) -> None:
    engine = engine_kit.engine
    a = chunk("S1", 0, "alpha policy", content_hash="h1")  # ingested without states
    b = chunk("S1", 1, "beta policy", content_hash="h1")
    await put(engine, a, b)
    written = await engine.put_passage_states(
        [(a.chunk_id, "h1", b"computed a"), (b.chunk_id, "stale-hash", b"computed b"),
         ("missing#0@v1", "h1", b"nowhere")], KEY)
    assert written == 1
    assert await engine.passage_states([ref(a), ref(b)], KEY) == {a.chunk_id: b"computed a"}
    assert await engine.passage_states([ref(a)], "reranker-b:lower-9999:f1") == {}
    assert await engine.put_passage_states([], KEY) == 0
    # The write-back never creates a chunk, and a re-ingest of changed content drops it.
    assert [c.chunk_id for c in await engine.get_chunks([a.chunk_id, "missing#0@v1"])] == [a.chunk_id]
    changed = chunk("S1", 0, "alpha policy changed", content_hash="h2")
    await put(engine, changed)
    assert await engine.passage_states([ref(changed)], KEY) == {}
    # The chunk itself is unchanged by the write-back: still found, still without states in hits.
    await put(engine, a, b)
    await engine.put_passage_states([(a.chunk_id, "h1", b"again")], KEY)
    await engine.refresh()
    hits = (await engine.bm25("alpha", 5, ALL, T)).hits
    assert [h.chunk.chunk_id for h in hits] == [a.chunk_id] and hits[0].chunk.rerank_states is None
    assert await engine.passage_states([ref(a)], KEY) == {a.chunk_id: b"again"}
    if engine_kit.reopen is not None:
        reopened: Engine = await engine_kit.reopen()
        assert await reopened.passage_states([ref(a)], KEY) == {a.chunk_id: b"again"}


async def test_chunks_without_states_are_paged_by_chunk_id(engine_kit: EngineKit) -> None:
    """What the fill of passage states reads (``ingest/states_fill.py``): every chunk whose
    states are missing, for another key, or stale, by chunk id, a page at a time, with the id
    to read on from and None after the last page."""
    engine = engine_kit.engine
    has = with_states(chunk("S1", 0, "alpha policy"), b"states")
    bare = chunk("S1", 1, "beta policy")
    other = with_states(chunk("S2", 0, "gamma policy"), b"other states", key="reranker-b:lower-9999:f1")
    written_back = chunk("S3", 0, "delta policy")
    await put(engine, has, bare, other, written_back)
    await engine.put_passage_states([(written_back.chunk_id, written_back.content_hash, b"computed")], KEY)
    await engine.refresh()
    want = sorted((c.chunk_id, c.content_hash, c.search_text) for c in (bare, other))
    rows, after, pages = [], "", 0
    while after is not None:
        page, next_from = await engine.chunks_without_states(KEY, after, 3)
        assert next_from is None or next_from > after
        rows += page
        after, pages = next_from, pages + 1
    assert rows == want and pages == 2  # four chunks, three a page: the short second page is the last
    whole, end = await engine.chunks_without_states(KEY, "", 10)
    assert whole == want and end is None
    # A re-ingest of changed content leaves the new version without states.
    changed = dataclasses.replace(has, text="alpha policy changed", content_hash="h2", rerank_states=None,
                                  rerank_states_key="")
    await put(engine, changed)
    assert (changed.chunk_id, "h2", changed.search_text) in (await engine.chunks_without_states(KEY, "", 10))[0]
