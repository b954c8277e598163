"""Embedded-only behaviour the shared contract leaves open: batch validation, concurrent
reads during writes, compaction, and that work stays off the event loop."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np

from service.engines.base import ChunkRecord, SearchFilter, make_chunk_id
from service.engines.embedded import EmbeddedEngine

ALL = SearchFilter(acl_groups=None)


def chunk(source_id: str, index: int, text: str, version: str = "v1", dim: int = 4) -> ChunkRecord:
    vector = np.zeros(dim, dtype=np.float32)
    vector[index % dim] = 1.0
    return ChunkRecord(
        chunk_id=make_chunk_id(source_id, index, version), source_id=source_id, version=version,
        chunk_index=index, collection="doc", status="approved", title="", breadcrumb="",
        text=text, parent_text="", search_text=text, content_hash=f"h-{version}", vector=vector,
    )  # fmt: skip


async def test_an_invalid_chunk_refuses_the_whole_batch(tmp_path: Path) -> None:
    engine = EmbeddedEngine(tmp_path)
    await engine.start()
    try:
        assert (await engine.replace_document("E1", "v1", [chunk("E1", 0, "kept")])).written == 1
        bad = [chunk("E1", 0, "new"), chunk("E1", 1, "wrong dim", dim=3), chunk("E9", 2, "other")]
        report = await engine.replace_document("E1", "v1", bad)
        assert report.written == 0
        assert [e.chunk_id for e in report.errors] == ["E1#1@v1", "E9#2@v1"]
        assert [c.text for c in await engine.get_chunks(["E1#0@v1"])] == ["kept"]
        dup = await engine.replace_document("E1", "v1", [chunk("E1", 0, "a"), chunk("E1", 0, "b")])
        assert [e.message for e in dup.errors] == ["duplicate chunk_id in batch"]
        assert (await engine.replace_document("E1", "v1", [])).written == 0
        assert await engine.document_hash("E1", "v1") is None
    finally:
        await engine.close()


async def test_searches_see_whole_documents_while_writes_run(tmp_path: Path) -> None:
    engine = EmbeddedEngine(tmp_path, workers=4)
    await engine.start()
    try:

        async def writer() -> None:
            for round_ in range(30):
                chunks = [chunk("E1", i, f"policy round{round_}") for i in range(5)]
                await engine.replace_document("E1", "v1", chunks)

        async def reader() -> list[int]:
            seen = []
            for _ in range(60):
                seen.append(len((await engine.bm25("policy", 10, ALL, 5.0)).hits))
            return seen

        _, *counts = await asyncio.gather(writer(), reader(), reader())
        assert {n for c in counts for n in c} <= {0, 5}  # never a half-replaced document
    finally:
        await engine.close()


async def test_compaction_keeps_results_and_order(tmp_path: Path) -> None:
    engine = EmbeddedEngine(tmp_path)
    await engine.start()
    try:
        for i in range(40):
            await engine.replace_document(f"S{i}", "v1", [chunk(f"S{i}", 0, "same text")])
        for _ in range(60):  # 60 * 20 dead slots (> 1024) forces a compaction
            for i in range(0, 40, 2):
                await engine.replace_document(f"S{i}", "v1", [chunk(f"S{i}", 0, "same text")])
        hits = (await engine.bm25("same", 40, ALL, 5.0)).hits
        order = [h.chunk.source_id for h in hits]
        # equal scores: odd sources (never rewritten) first, then evens in rewrite order
        assert order == [f"S{i}" for i in range(1, 40, 2)] + [f"S{i}" for i in range(0, 40, 2)]
        knn = await engine.knn(np.array([1, 0, 0, 0], dtype=np.float32), 3, ALL, 5.0)
        assert [h.distance for h in knn.hits] == [0.0, 0.0, 0.0]
        assert (await engine.stats()).chunk_count == 40
    finally:
        await engine.close()


async def test_work_runs_on_the_engine_pool(tmp_path: Path) -> None:
    engine = EmbeddedEngine(tmp_path)
    await engine.start()
    try:
        names: list[str] = []
        original = engine._index.bm25.search

        def spy(*args: object, **kwargs: object) -> object:
            names.append(threading.current_thread().name)
            return original(*args, **kwargs)  # type: ignore[arg-type]

        engine._index.bm25.search = spy  # type: ignore[method-assign]
        await engine.bm25("x", 1, ALL, 5.0)
        assert names and names[0].startswith("embedded")
    finally:
        await engine.close()


async def test_a_search_does_not_queue_behind_a_write(tmp_path: Path) -> None:
    """One search thread (the default) and a write stuck in its commit: the search still
    answers, because writes have a thread of their own, at background priority."""
    from service.threads import thread_nice

    engine = EmbeddedEngine(tmp_path, workers=1, writer_nice=3)
    await engine.start()
    try:
        await engine.replace_document("E1", "v1", [chunk("E1", 0, "policy renewal")])
        assert engine._store is not None
        store = engine._store
        entered, release = threading.Event(), threading.Event()
        writer_nice: list[int] = []
        original = store.replace_document

        def stuck(*args, **kwargs):  # type: ignore[no-untyped-def]
            writer_nice.append(thread_nice(threading.get_native_id()))
            entered.set()
            release.wait(10)
            return original(*args, **kwargs)

        store.replace_document = stuck  # type: ignore[method-assign]
        write = asyncio.ensure_future(engine.replace_document("E2", "v1", [chunk("E2", 0, "policy claim")]))
        assert await asyncio.to_thread(entered.wait, 10)
        hits = (await engine.bm25("policy", 10, ALL, 5.0)).hits
        assert [h.chunk.chunk_id for h in hits] == ["E1#0@v1"] and not write.done()
        release.set()
        assert (await write).written == 1
        assert writer_nice == [min(19, thread_nice(threading.get_native_id()) + 3)]
        assert len((await engine.bm25("policy", 10, ALL, 5.0)).hits) == 2
    finally:
        await engine.close()
