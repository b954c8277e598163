"""The Latin-script vector part of the engine contract (``VectorField.LATIN``), run against
each kind in conftest.ENGINE_KINDS: a chunk may carry a second vector, a kNN search by that
field reads it alone (chunks without one are not candidates), it is stored with the chunk,
survives a restart, is replaced by a re-ingest, never rides along with hits, and a vector of
the wrong dimension is refused with the batch."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import pytest

from service.engines.base import ChunkRecord, VectorField

if TYPE_CHECKING:
    from conftest import EngineKit

from test_engine_contract import ALL, T, chunk, ids, put, unit

LATIN = VectorField.LATIN


def with_latin(c: ChunkRecord, vector: np.ndarray) -> ChunkRecord:
    return dataclasses.replace(c, latin_vector=vector)


async def test_knn_by_field_reads_that_vector_only(engine_kit: EngineKit) -> None:
    engine = engine_kit.engine
    # Primary and Latin vectors disagree on purpose: each search must follow its own field.
    a = with_latin(chunk("S1", 0, "alpha policy", vector=unit(1.0)), unit(0.0, 1.0))
    b = with_latin(chunk("S1", 1, "beta policy", vector=unit(0.0, 1.0)), unit(1.0))
    c = chunk("S1", 2, "gamma policy", vector=unit(1.0, 0.1))  # no Latin vector (a Han chunk)
    await put(engine, a, b, c)
    primary = await engine.knn(unit(1.0), 3, ALL, T)
    assert ids(primary.hits) == [a.chunk_id, c.chunk_id, b.chunk_id]
    latin = await engine.knn(unit(1.0), 3, ALL, T, field=LATIN)
    assert ids(latin.hits) == [b.chunk_id, a.chunk_id]  # c has no Latin vector: never a candidate
    assert latin.hits[0].distance == pytest.approx(0.0, abs=1e-3)


async def test_latin_vector_is_stored_replaced_and_kept_out_of_hits(engine_kit: EngineKit) -> None:
    engine = engine_kit.engine
    a = with_latin(chunk("S1", 0, "alpha policy", vector=unit(1.0), content_hash="h1"), unit(0.0, 1.0))
    await put(engine, a)
    hits = (await engine.knn(unit(0.0, 1.0), 5, ALL, T, field=LATIN)).hits
    assert hits and all(h.chunk.latin_vector is None and h.chunk.vector is None for h in hits)
    [fetched] = await engine.get_chunks([a.chunk_id])
    assert fetched.latin_vector is not None
    np.testing.assert_allclose(fetched.latin_vector, unit(0.0, 1.0), atol=1e-6)
    # A re-ingest of the changed document without a Latin vector drops the old one.
    await put(engine, dataclasses.replace(a, text="alpha policy changed", content_hash="h2", latin_vector=None))
    assert (await engine.knn(unit(0.0, 1.0), 5, ALL, T, field=LATIN)).hits == []
    [fetched] = await engine.get_chunks([a.chunk_id])
    assert fetched.latin_vector is None and fetched.vector is not None


async def test_latin_vector_survives_a_restart(engine_kit: EngineKit) -> None:
    if engine_kit.reopen is None:
        pytest.skip(f"{engine_kit.kind} cannot be reopened on the same store")
    a = with_latin(chunk("S1", 0, "alpha policy", vector=unit(1.0)), unit(0.0, 0.0, 1.0))
    await put(engine_kit.engine, a)
    engine = await engine_kit.reopen()
    latin = await engine.knn(unit(0.0, 0.0, 1.0), 5, ALL, T, field=LATIN)
    assert ids(latin.hits) == [a.chunk_id]
    assert ids((await engine.knn(unit(1.0), 5, ALL, T)).hits) == [a.chunk_id]


async def test_latin_vector_of_the_wrong_dimension_refuses_the_batch(engine_kit: EngineKit) -> None:
    engine = engine_kit.engine
    good = with_latin(chunk("S1", 0, "alpha policy", vector=unit(1.0)), unit(1.0))
    await put(engine, good)
    bad = with_latin(chunk("S1", 0, "alpha policy changed", vector=unit(1.0), content_hash="h2"),
                     np.ones(3, dtype=np.float32) / np.sqrt(3))
    report = await engine.replace_document("S1", "v1", [bad])
    assert report.written == 0 and report.errors and report.errors[0].chunk_id == bad.chunk_id
    await engine.refresh()
    [kept] = await engine.get_chunks([good.chunk_id])  # nothing already stored is lost
    assert kept.text == "alpha policy"


async def test_chunks_without_the_vector_are_paged_and_backfilled_in_place(engine_kit: EngineKit) -> None:
    # How a store made before the Latin-script leg catches up (service/ingest/backfill.py):
    # page through the chunks without the vector, store each onto the version it was read as.
    engine = engine_kit.engine
    have = with_latin(chunk("S1", 0, "alpha policy", vector=unit(1.0), content_hash="h1"), unit(1.0))
    b = chunk("S1", 1, "beta policy", vector=unit(0.0, 1.0), content_hash="h1")
    c = chunk("S2", 0, "gamma policy", vector=unit(0.0, 0.0, 1.0), content_hash="h2")
    await put(engine, have, b, c)
    seen, after = [], ""
    while page := await engine.chunks_without(LATIN, after, 1):
        assert len(page) == 1
        seen.extend(page)
        after = page[-1][0]
    assert seen == sorted([(b.chunk_id, "h1", b.search_text), (c.chunk_id, "h2", c.search_text)])
    # Stored only onto the chunk version it was computed for, and only where none is yet.
    written = await engine.put_vectors(LATIN, [
        (b.chunk_id, "h1", unit(0.0, 1.0)),
        (c.chunk_id, "stale-hash", unit(0.0, 0.0, 1.0)),  # re-ingested since it was read
        (have.chunk_id, "h1", unit(0.0, 1.0)),  # has one: kept
        ("S9#0@v1", "h9", unit(1.0)),  # deleted since: nothing is created
        (c.chunk_id, "h2", np.ones(3, dtype=np.float32) / np.sqrt(3)),  # the wrong dimension
    ])
    assert written == 1
    await engine.refresh()
    assert ids((await engine.knn(unit(0.0, 1.0), 5, ALL, T, field=LATIN)).hits) == [b.chunk_id, have.chunk_id]
    assert await engine.chunks_without(LATIN, "", 10) == [(c.chunk_id, "h2", c.search_text)]
    assert await engine.get_chunks(["S9#0@v1"]) == []
    [kept] = await engine.get_chunks([have.chunk_id])
    assert kept.latin_vector is not None
    np.testing.assert_allclose(kept.latin_vector, unit(1.0), atol=1e-6)
    if engine_kit.reopen is not None:  # stored, not only in memory
        engine = await engine_kit.reopen()
        assert ids((await engine.knn(unit(0.0, 1.0), 1, ALL, T, field=LATIN)).hits) == [b.chunk_id]
        assert [r[0] for r in await engine.chunks_without(LATIN, "", 10)] == [c.chunk_id]
