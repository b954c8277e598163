"""SQLite persistence for the embedded engine (``engine.sqlite3`` in the data directory).

SQLite is the source of truth: every write commits here in one transaction before the
in-memory index changes, and start-up rebuilds memory from it. ``seq`` keeps insertion order,
so BM25 tie-breaks (lower doc id first) survive a restart.

The reranker's passage states live in their own table (``passage_states``), written and
deleted in the same transaction as their chunks but never loaded into memory: a rerank reads
its ~20 rows by primary key through a second, read-only connection (WAL lets it read while a
writer commits), so ingest writes never wait on those reads or the other way round.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from service.engines.base import ChunkRecord, Vector, VectorField

FILENAME = "engine.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    source_id TEXT NOT NULL,
    version TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    PRIMARY KEY (source_id, version)
);
CREATE TABLE IF NOT EXISTS chunks (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    chunk_id TEXT NOT NULL UNIQUE,
    source_id TEXT NOT NULL,
    version TEXT NOT NULL,
    chunk_index INTEGER NOT NULL,
    collection TEXT NOT NULL,
    status TEXT NOT NULL,
    title TEXT NOT NULL,
    breadcrumb TEXT NOT NULL,
    text TEXT NOT NULL,
    parent_text TEXT NOT NULL,
    search_text TEXT NOT NULL,
    acl TEXT NOT NULL,
    metadata TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    vector BLOB,
    latin_vector BLOB
);
CREATE INDEX IF NOT EXISTS chunks_by_document ON chunks (source_id, version);
CREATE TABLE IF NOT EXISTS passage_states (
    chunk_id TEXT PRIMARY KEY,
    source_id TEXT NOT NULL,
    version TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    states_key TEXT NOT NULL,
    states BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS passage_states_by_document ON passage_states (source_id, version);
"""

_COLUMNS = (
    "chunk_id, source_id, version, chunk_index, collection, status, title, breadcrumb, "
    "text, parent_text, search_text, acl, metadata, content_hash, vector, latin_vector"
)


class SqliteStore:
    """One connection, used by one thread at a time (the engine holds its write lock)."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(data_dir / FILENAME, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(chunks)")}
        if "latin_vector" not in columns:  # a store made before the Latin-script leg
            with self._db:
                self._db.execute("ALTER TABLE chunks ADD COLUMN latin_vector BLOB")
        self._reader = sqlite3.connect(f"file:{data_dir / FILENAME}?mode=ro", uri=True, check_same_thread=False)
        self._reader_lock = threading.Lock()

    def close(self) -> None:
        with self._reader_lock:
            self._reader.close()
        self._db.close()

    def passage_states(self, chunks: Sequence[tuple[str, str]], states_key: str) -> dict[str, bytes]:
        """States stored with ``states_key`` for chunks whose content hash still matches."""
        wanted = dict(chunks)
        if not wanted:
            return {}
        marks = ", ".join("?" * len(wanted))
        with self._reader_lock:
            rows = self._reader.execute(
                f"SELECT chunk_id, content_hash, states FROM passage_states WHERE states_key = ? AND chunk_id IN ({marks})",
                (states_key, *wanted),
            ).fetchall()
        return {cid: bytes(blob) for cid, content_hash, blob in rows if wanted.get(cid) == content_hash}

    def load(self) -> Iterator[ChunkRecord]:
        """Every chunk in insertion order (a document's chunks are contiguous)."""
        for row in self._db.execute(f"SELECT {_COLUMNS} FROM chunks ORDER BY seq"):
            yield _record(row)

    def document_hashes(self) -> dict[tuple[str, str], str]:
        rows = self._db.execute("SELECT source_id, version, content_hash FROM documents")
        return {(s, v): h for s, v, h in rows}

    def replace_document(
        self, source_id: str, version: str, content_hash: str, chunks: Sequence[ChunkRecord]
    ) -> None:
        """Swap one source version's chunks in a single transaction (all or nothing)."""
        with self._db:
            self._delete(source_id, version)
            if not chunks:
                return
            self._db.execute(
                "INSERT INTO documents (source_id, version, content_hash) VALUES (?, ?, ?)",
                (source_id, version, content_hash),
            )
            self._db.executemany(
                f"INSERT INTO chunks ({_COLUMNS}) VALUES ({', '.join('?' * 16)})",
                [_row(c) for c in chunks],
            )
            self._db.executemany(
                "INSERT INTO passage_states (chunk_id, source_id, version, content_hash, states_key, states) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [(c.chunk_id, c.source_id, c.version, c.content_hash, c.rerank_states_key, c.rerank_states)
                 for c in chunks if c.rerank_states is not None],
            )

    def put_passage_states(self, states: Sequence[tuple[str, str, bytes]], states_key: str) -> int:
        """Write-back of rerank-computed states, only onto a chunk stored with that content
        hash (one transaction; a stale entry writes nothing)."""
        written = 0
        with self._db:
            for chunk_id, content_hash, blob in states:
                cur = self._db.execute(
                    "INSERT OR REPLACE INTO passage_states (chunk_id, source_id, version, content_hash, states_key, states) "
                    "SELECT chunk_id, source_id, version, content_hash, ?, ? FROM chunks WHERE chunk_id = ? AND content_hash = ?",
                    (states_key, blob, chunk_id, content_hash),
                )
                written += max(0, cur.rowcount)
        return written

    def put_vectors(self, field: VectorField, vectors: Sequence[tuple[str, str, Vector]]) -> list[str]:
        """Backfill of a vector column: each only onto a chunk stored with that content hash
        that has none yet (one transaction). Returns the chunk ids written."""
        column = field.value  # an enum's own column name, never input
        written: list[str] = []
        with self._db:
            for chunk_id, content_hash, vector in vectors:
                cur = self._db.execute(
                    f"UPDATE chunks SET {column} = ? WHERE chunk_id = ? AND content_hash = ? AND {column} IS NULL",
                    (_blob(vector), chunk_id, content_hash),
                )
                if cur.rowcount > 0:
                    written.append(chunk_id)
        return written

    def delete_document(self, source_id: str, version: str | None) -> None:
        with self._db:
            self._delete(source_id, version)

    def _delete(self, source_id: str, version: str | None) -> None:
        where, args = (
            ("source_id = ?", (source_id,))
            if version is None
            else ("source_id = ? AND version = ?", (source_id, version))
        )
        self._db.execute(f"DELETE FROM chunks WHERE {where}", args)
        self._db.execute(f"DELETE FROM passage_states WHERE {where}", args)
        self._db.execute(f"DELETE FROM documents WHERE {where}", args)


def _blob(vector: object | None) -> bytes | None:
    return None if vector is None else np.asarray(vector, dtype="<f4").tobytes()


def _vector(blob: object) -> Vector | None:
    assert blob is None or isinstance(blob, bytes)
    return None if blob is None else np.frombuffer(blob, dtype=np.float32).copy()


def _row(c: ChunkRecord) -> tuple[object, ...]:
    return (
        c.chunk_id,
        c.source_id,
        c.version,
        c.chunk_index,
        c.collection,
        c.status,
        c.title,
        c.breadcrumb,
        c.text,
        c.parent_text,
        c.search_text,
        json.dumps(list(c.acl)),
        json.dumps(dict(c.metadata), sort_keys=True),
        c.content_hash,
        _blob(c.vector),
        _blob(c.latin_vector),
    )


def _record(row: Sequence[object]) -> ChunkRecord:
    (chunk_id, source_id, version, chunk_index, collection, status, title, breadcrumb, text,
     parent_text, search_text, acl, metadata, content_hash, vector, latin_vector) = row  # fmt: skip
    assert isinstance(acl, str) and isinstance(metadata, str) and isinstance(chunk_index, int)
    return ChunkRecord(
        chunk_id=str(chunk_id),
        source_id=str(source_id),
        version=str(version),
        chunk_index=chunk_index,
        collection=str(collection),
        status=str(status),
        title=str(title),
        breadcrumb=str(breadcrumb),
        text=str(text),
        parent_text=str(parent_text),
        search_text=str(search_text),
        acl=tuple(json.loads(acl)),
        metadata=json.loads(metadata),
        content_hash=str(content_hash),
        vector=_vector(vector),
        latin_vector=_vector(latin_vector),
    )
