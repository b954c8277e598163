"""``EmbeddedEngine``: the in-process engine used when no OpenSearch is configured.

SQLite under the data directory is the durable copy; a ``MemoryIndex`` rebuilt from it at start
answers searches. Every piece of CPU or disk work (analysis, scoring, SQLite) runs on the
engine's own thread pool, never on the event loop, and searches are bounded with
``asyncio.timeout`` so a saturated pool surfaces as ``EngineTimeout`` exactly as a slow
OpenSearch would. After ``close()`` every call raises ``EngineUnavailable``.

Locking: ``_write_lock`` serialises writers (SQLite then memory); ``_index_lock`` guards the
in-memory index, held by a writer only for the final swap, so searches never observe a
half-replaced document. Writes run on a writer thread of their own (``writer_nice`` steps
below normal priority), so a search never queues behind an ingest's analysis and commit.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np

from service.engines.base import (
    ChunkRecord,
    Engine,
    EngineStats,
    EngineTimeout,
    EngineUnavailable,
    Hit,
    SearchFilter,
    SearchResponse,
    Vector,
    VectorField,
    WriteError,
    WriteReport,
)
from service.engines.embedded.analyzer import analyze
from service.engines.embedded.knn import similarity
from service.engines.embedded.memory import MemoryIndex
from service.engines.embedded.store import SqliteStore
from service.threads import niced_pool

log = logging.getLogger(__name__)

T = TypeVar("T")


class _State(enum.Enum):
    NEW = "new"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


class EmbeddedEngine(Engine):
    name = "embedded"

    def __init__(self, data_dir: Path, workers: int = 1, writer_nice: int = 0, search_nice: int = 0) -> None:
        self._data_dir = Path(data_dir)
        # Public so tests can saturate the pool and observe a real EngineTimeout.
        self.workers = workers
        self.executor = niced_pool(workers, "embedded", search_nice)
        # Writes (ingest, deletes) apart from searches: one thread, as writers serialise anyway.
        self.writer = niced_pool(1, "embedded-writer", writer_nice)
        self._index = MemoryIndex()
        self._index_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._store: SqliteStore | None = None
        self._state = _State.NEW
        self._failure = ""

    # -- plumbing ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state is not _State.READY:
            detail = f": {self._failure}" if self._failure else ""
            raise EngineUnavailable(f"embedded engine is {self._state.value}{detail}")

    def _guarded(self, fn: Callable[[], T]) -> Callable[[], T]:
        def run() -> T:
            self._check_open()  # work queued before close() must not touch a closed store
            try:
                return fn()
            except sqlite3.Error as exc:
                raise EngineUnavailable(f"embedded store failed: {exc}") from exc

        return run

    async def _call(
        self, fn: Callable[[], T], timeout_s: float | None = None, pool: ThreadPoolExecutor | None = None
    ) -> T:
        self._check_open()
        try:
            future = asyncio.wrap_future((pool or self.executor).submit(self._guarded(fn)))
        except RuntimeError as exc:  # pool already shut down
            raise EngineUnavailable("embedded engine is closed") from exc
        if timeout_s is None:
            return await future
        try:
            async with asyncio.timeout(timeout_s):  # cancels the pool's future, as wait_for did
                return await future
        except TimeoutError as exc:
            raise EngineTimeout(f"embedded engine did not answer within {timeout_s}s") from exc

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        if self._state is not _State.NEW:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.executor, self._open)
        except (OSError, sqlite3.Error) as exc:
            self._state, self._failure = _State.FAILED, str(exc)
            log.error("embedded engine could not open %s: %s", self._data_dir, exc)
            return
        self._state = _State.READY

    def _open(self) -> None:
        store = SqliteStore(self._data_dir)
        hashes = store.document_hashes()
        index = MemoryIndex()
        records = store.load()
        for key, group in itertools.groupby(records, key=lambda r: (r.source_id, r.version)):
            index.add_document(key, hashes[key], [(r, analyze(r.search_text)) for r in group])
        self._store, self._index = store, index

    async def close(self) -> None:
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        store = self._store
        if store is not None:
            self._store = None

            def close_store() -> None:
                with self._write_lock:  # let an in-flight write finish its transaction
                    store.close()

            closing = asyncio.wrap_future(self.writer.submit(close_store))
            self.executor.shutdown(wait=False)
            self.writer.shutdown(wait=False)
            await closing
        else:
            self.executor.shutdown(wait=False)
            self.writer.shutdown(wait=False)

    async def ready(self) -> bool:
        return self._state is _State.READY

    # -- writes -----------------------------------------------------------------------------

    async def document_hash(self, source_id: str, version: str) -> str | None:
        def work() -> str | None:
            with self._index_lock:
                return self._index.doc_hashes.get((source_id, version))

        return await self._call(work)

    def _invalid(
        self, source_id: str, version: str, chunks: Sequence[ChunkRecord]
    ) -> list[WriteError]:
        """Reasons to refuse the batch; called under the write lock."""
        errors: list[WriteError] = []
        seen: set[str] = set()
        dimensions = {f: self._index.vector_index(f).dimension for f in VectorField}
        for c in chunks:
            problem = None
            owner = self._index.owner_of(c.chunk_id)
            if (c.source_id, c.version) != (source_id, version):
                problem = f"chunk belongs to {c.source_id}@{c.version}, not {source_id}@{version}"
            elif c.chunk_id in seen:
                problem = "duplicate chunk_id in batch"
            elif owner is not None and owner != (source_id, version):
                problem = f"chunk_id already used by {owner[0]}@{owner[1]}"
            for f, given in ((VectorField.PRIMARY, c.vector), (VectorField.LATIN, c.latin_vector)):
                if problem is None and given is not None:
                    vector = np.asarray(given, dtype=np.float32)
                    problem = self._index.vector_index(f).check(vector)
                    dimension = dimensions[f]
                    if problem is None and dimension is not None and len(vector) != dimension:
                        problem = f"{f.value} dimension {len(vector)} != batch dimension {dimension}"
                    if problem is None:
                        dimensions[f] = dimension or len(vector)
            seen.add(c.chunk_id)
            if problem:
                errors.append(WriteError(chunk_id=c.chunk_id, message=problem))
        return errors

    async def replace_document(
        self, source_id: str, version: str, chunks: Sequence[ChunkRecord]
    ) -> WriteReport:
        """All or nothing: one invalid chunk refuses the whole batch and leaves the stored
        version as it was, so a bad re-ingest never half-deletes a document."""
        chunks = list(chunks)
        key = (source_id, version)

        def work() -> WriteReport:
            analysed = [(c, analyze(c.search_text)) for c in chunks]
            with self._write_lock:
                self._check_open()
                errors = self._invalid(source_id, version, chunks)
                if errors:
                    return WriteReport(written=0, errors=errors)
                content_hash = chunks[0].content_hash if chunks else ""
                assert self._store is not None
                self._store.replace_document(source_id, version, content_hash, chunks)
                with self._index_lock:
                    self._index.delete_document(key)
                    self._index.add_document(key, content_hash, analysed)
            return WriteReport(written=len(chunks))

        return await self._call(work, pool=self.writer)

    async def put_passage_states(self, states: Sequence[tuple[str, str, bytes]], states_key: str) -> int:
        items = list(states)
        if not items:
            return 0

        def work() -> int:
            with self._write_lock:
                self._check_open()
                assert self._store is not None
                return self._store.put_passage_states(items, states_key)

        return await self._call(work, pool=self.writer)

    async def chunks_without(self, field: VectorField, after: str, limit: int) -> list[tuple[str, str, str]]:
        def work() -> list[tuple[str, str, str]]:
            with self._index_lock:
                return [(c.chunk_id, c.content_hash, c.search_text) for c in self._index.chunks_without(field, after, limit)]

        return await self._call(work)

    async def chunks_without_states(self, states_key: str, after: str, limit: int
                                    ) -> tuple[list[tuple[str, str, str]], str | None]:
        def work() -> tuple[list[tuple[str, str, str]], str | None]:
            with self._index_lock:
                page = self._index.chunks_after(after, limit)
            if not page:
                return [], None
            assert self._store is not None
            stored = self._store.passage_states([(c.chunk_id, c.content_hash) for c in page], states_key)
            return ([(c.chunk_id, c.content_hash, c.search_text) for c in page if c.chunk_id not in stored],
                    page[-1].chunk_id if len(page) == limit else None)

        return await self._call(work)

    async def put_vectors(self, field: VectorField, vectors: Sequence[tuple[str, str, Vector]]) -> int:
        items = list(vectors)
        if not items:
            return 0

        def work() -> int:
            with self._write_lock:
                self._check_open()
                assert self._store is not None
                index = self._index.vector_index(field)
                dimension = index.dimension
                valid: list[tuple[str, str, Vector]] = []
                for cid, content_hash, given in items:  # like a write's checks: the index's dimension, finite
                    vector = np.asarray(given, dtype=np.float32)
                    if index.check(vector) is None and len(vector) == (dimension or len(vector)):
                        dimension = len(vector)
                        valid.append((cid, content_hash, vector))
                written = self._store.put_vectors(field, valid)
                by_id = {cid: v for cid, _, v in valid}
                with self._index_lock:
                    for cid in written:
                        self._index.set_vector(field, cid, by_id[cid])
                return len(written)

        return await self._call(work, pool=self.writer)

    async def delete_document(self, source_id: str, version: str | None = None) -> int:
        def work() -> int:
            with self._write_lock:
                self._check_open()
                assert self._store is not None
                self._store.delete_document(source_id, version)
                with self._index_lock:
                    keys = (
                        self._index.documents(source_id)
                        if version is None
                        else [(source_id, version)]
                    )
                    return sum(self._index.delete_document(key) for key in keys)

        return await self._call(work, pool=self.writer)

    async def refresh(self) -> None:
        """Writes are visible as soon as they are acknowledged; this only checks liveness."""
        self._check_open()

    # -- reads ------------------------------------------------------------------------------

    async def bm25(self, query: str, k: int, flt: SearchFilter, timeout_s: float) -> SearchResponse:
        def work() -> SearchResponse:
            started = time.perf_counter()
            terms = analyze(query)
            with self._index_lock:
                allowed = self._index.allowed(flt)
                ranked = self._index.bm25.search(terms, k, allowed)
                hits = [Hit(self._index.hit_record(slot), score) for slot, score in ranked]
            return SearchResponse(hits=hits, took_ms=(time.perf_counter() - started) * 1000)

        return await self._call(work, timeout_s)

    async def knn(
        self, vector: Vector, k: int, flt: SearchFilter, timeout_s: float,
        field: VectorField = VectorField.PRIMARY,
    ) -> SearchResponse:
        query = np.asarray(vector, dtype=np.float32)

        def work() -> SearchResponse:
            started = time.perf_counter()
            with self._index_lock:
                vectors = self._index.vector_index(field)
                dimension = vectors.dimension
                if dimension is not None and query.shape != (dimension,):
                    raise ValueError(f"query vector shape {query.shape}, index has {dimension} ({field.value})")
                allowed = self._index.allowed(flt)
                ranked = vectors.search(query, k, allowed)
                hits = [
                    Hit(self._index.hit_record(slot), similarity(d2), math.sqrt(d2))
                    for slot, d2 in ranked
                ]
            return SearchResponse(hits=hits, took_ms=(time.perf_counter() - started) * 1000)

        return await self._call(work, timeout_s)

    async def get_chunks(self, chunk_ids: Sequence[str]) -> list[ChunkRecord]:
        ids = list(chunk_ids)

        def work() -> list[ChunkRecord]:
            with self._index_lock:
                found = (self._index.record(chunk_id) for chunk_id in ids)
                return [record for record in found if record is not None]

        return await self._call(work)

    async def passage_states(self, chunks: Sequence[tuple[str, str]], states_key: str) -> dict[str, bytes]:
        wanted = list(chunks)

        def work() -> dict[str, bytes]:
            assert self._store is not None
            return self._store.passage_states(wanted, states_key)

        return await self._call(work)

    async def versions(self, source_id: str) -> list[str]:
        def work() -> list[str]:
            with self._index_lock:
                return sorted(v for (s, v) in self._index.doc_hashes if s == source_id)

        return await self._call(work)

    async def stats(self) -> EngineStats:
        def work() -> EngineStats:
            with self._index_lock:
                return EngineStats(
                    chunk_count=self._index.chunk_count,
                    document_count=len(self._index.doc_hashes),
                    dimension=self._index.vectors.dimension,
                )

        return await self._call(work)
