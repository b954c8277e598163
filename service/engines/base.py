"""The one interface every search engine implements, and the records that cross it.

Both engines (embedded, OpenSearch) must score BM25 the same way (Lucene BM25, k1=1.2,
b=0.75, one field: ``ChunkRecord.search_text`` analysed like OpenSearch's built-in ``cjk``
analyzer) and return kNN hits by L2 distance over unit vectors, so one shared test suite
runs against both.

Failure contract (the pipeline turns these into leg statuses):
- raise ``EngineTimeout`` when the engine did not answer inside ``timeout_s``;
- raise ``EngineUnavailable`` when it is unreachable or failed outright;
- return ``SearchResponse(complete=False, ...)`` when it answered with partial results
  (OpenSearch ``timed_out: true`` or failed shards): that is never "no hits".
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

Vector = npt.NDArray[np.float32]


class EngineError(Exception):
    """Base class for engine failures."""


class EngineTimeout(EngineError):
    """The engine did not answer within the time it was given."""


class EngineUnavailable(EngineError):
    """The engine is unreachable or failed (connection refused, 5xx, closed store)."""


class VectorField(enum.Enum):
    """Which of a chunk's vectors a kNN search reads: ``vector``, the embedder's (every
    chunk has one), or ``latin_vector``, the Latin-script embedder's (``latin_embedding_model``;
    only chunks without Han characters have one, README "The Latin-script dense leg")."""

    PRIMARY = "vector"
    LATIN = "latin_vector"


class PartialReason(enum.Enum):
    NONE = "none"
    TIMED_OUT = "timed_out"  # engine stopped early (OpenSearch timed_out: true)
    SHARDS_FAILED = "shards_failed"  # some shards failed; hits come from the rest


def make_chunk_id(source_id: str, chunk_index: int, version: str) -> str:
    """Evidence identity: source, chunk and version (``E31#0@v3``)."""
    return f"{source_id}#{chunk_index}@{version}"


@dataclass(frozen=True)
class ChunkRecord:
    """One indexed unit. Child chunks are matched; ``parent_text`` gives their context."""

    chunk_id: str
    source_id: str
    version: str
    chunk_index: int
    collection: str  # "doc" | "faq"
    status: str  # "approved" | "draft" | "retired"
    title: str
    breadcrumb: str
    text: str
    parent_text: str
    search_text: str  # the single BM25 field (title + breadcrumb + text)
    acl: tuple[str, ...] = ()  # empty = public
    metadata: Mapping[str, str] = field(default_factory=dict)
    content_hash: str = ""  # hash of the whole source document version (idempotent ingest)
    vector: Vector | None = None  # unit-length embedding of search_text
    latin_vector: Vector | None = None  # the Latin-script embedder's, for chunks without Han characters
    # The reranker's passage states for this chunk (service/models/passage_states.py) and the
    # key of the model that wrote them; stored with the chunk (so a re-ingest replaces them)
    # but never carried by search hits. Read them with ``Engine.passage_states``.
    rerank_states: bytes | None = None
    rerank_states_key: str = ""


@dataclass(frozen=True)
class SearchFilter:
    """Applied inside the engine query, before ranking (never after)."""

    collections: tuple[str, ...] = ()  # empty = every collection
    source_ids: tuple[str, ...] = ()  # empty = every source
    metadata: Mapping[str, str] = field(default_factory=dict)  # exact keyword equality
    # None = no ACL restriction (trusted internal use). Otherwise a chunk is visible when
    # its acl is empty (public) or shares a group with these.
    acl_groups: tuple[str, ...] | None = ()


@dataclass(frozen=True)
class Hit:
    chunk: ChunkRecord  # vector may be None in hits
    score: float  # BM25 score for lexical hits; similarity score for kNN hits
    distance: float | None = None  # L2 distance between unit vectors (kNN hits only)


@dataclass(frozen=True)
class SearchResponse:
    hits: list[Hit]
    complete: bool = True
    partial_reason: PartialReason = PartialReason.NONE
    detail: str = ""
    took_ms: float = 0.0


@dataclass(frozen=True)
class WriteError:
    chunk_id: str
    message: str


@dataclass(frozen=True)
class WriteReport:
    written: int
    errors: list[WriteError] = field(default_factory=list)


@dataclass(frozen=True)
class EngineStats:
    chunk_count: int
    document_count: int
    dimension: int | None


class Engine(abc.ABC):
    """Async engine interface. Implementations never block the event loop."""

    name: str = "engine"

    @abc.abstractmethod
    async def start(self) -> None:
        """Open stores / connections, create indices if needed. Must not fail when the
        backing server is down: readiness is reported by ``ready``."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def ready(self) -> bool:
        """True when searches can be answered now."""

    @abc.abstractmethod
    async def document_hash(self, source_id: str, version: str) -> str | None:
        """Content hash stored for this source version, or None if not indexed."""

    @abc.abstractmethod
    async def replace_document(
        self, source_id: str, version: str, chunks: Sequence[ChunkRecord]
    ) -> WriteReport:
        """Atomically (as far as the engine allows) replace every chunk of one source
        version with ``chunks``. Other versions of the same source are untouched."""

    @abc.abstractmethod
    async def delete_document(self, source_id: str, version: str | None = None) -> int:
        """Delete one version (or all versions when None). Returns chunks deleted."""

    @abc.abstractmethod
    async def bm25(
        self, query: str, k: int, flt: SearchFilter, timeout_s: float
    ) -> SearchResponse: ...

    @abc.abstractmethod
    async def knn(
        self, vector: Vector, k: int, flt: SearchFilter, timeout_s: float,
        field: VectorField = VectorField.PRIMARY,
    ) -> SearchResponse:
        """Nearest chunks to ``vector`` by ``field``; chunks without that vector are not
        candidates."""

    @abc.abstractmethod
    async def get_chunks(self, chunk_ids: Sequence[str]) -> list[ChunkRecord]:
        """Exact chunks by id (any status, any version); missing ids are left out."""

    @abc.abstractmethod
    async def refresh(self) -> None:
        """Make every acknowledged write visible to search."""

    @abc.abstractmethod
    async def stats(self) -> EngineStats: ...

    @abc.abstractmethod
    async def versions(self, source_id: str) -> list[str]:
        """Versions of a source that are stored now (any status), sorted."""

    @abc.abstractmethod
    async def chunks_without(self, field: VectorField, after: str, limit: int) -> list[tuple[str, str, str]]:
        """Up to ``limit`` chunks that have no ``field`` vector, ordered by chunk id, those
        after ``after`` ("" = from the start): ``(chunk_id, content_hash, search_text)`` (what
        ingest embeds). Finds the
        chunks a store made before a vector field existed must catch up on (the Latin-script
        leg's backfill, ``ingest/backfill.py``)."""

    @abc.abstractmethod
    async def put_vectors(self, field: VectorField, vectors: Sequence[tuple[str, str, Vector]]) -> int:
        """Store each ``(chunk_id, content_hash, vector)`` as that chunk's ``field`` vector,
        only where the chunk still exists with that content hash and has none yet: a chunk
        re-ingested or deleted since it was read keeps what it has. A vector of the wrong
        dimension is not stored. Returns how many were stored."""

    async def passage_states(self, chunks: Sequence[tuple[str, str]], states_key: str) -> dict[str, bytes]:
        """Stored reranker passage states by chunk id, for ``(chunk_id, content_hash)`` pairs:
        only states written with ``states_key`` for a chunk that still has that content hash
        (anything else is stale, and the reranker computes the states instead). An engine
        that stores none returns {}."""
        return {}

    async def chunks_without_states(self, states_key: str, after: str, limit: int
                                    ) -> tuple[list[tuple[str, str, str]], str | None]:
        """One page of the fill of passage states (``ingest/states_fill.py``): of the next
        ``limit`` chunks by chunk id after ``after`` ("" = from the start), those without
        states stored for ``states_key`` at their current content hash, as ``(chunk_id,
        content_hash, search_text)`` (the text their states are computed over), and the id
        to read on from (None: no chunk is left to read). An engine that stores none: ([], None)."""
        return [], None

    async def put_passage_states(self, states: Sequence[tuple[str, str, bytes]], states_key: str) -> int:
        """Store ``(chunk_id, content_hash, states)`` computed by a rerank for chunks that had
        none (write-back, ``rerank_states_write_back``), each only where that chunk still
        exists with that content hash: a chunk re-ingested or deleted since it was reranked
        keeps what it has. Returns how many were stored; an engine that stores none, 0."""
        return 0
