"""Ingest: validate, chunk, embed (model pool) and write one document version.

Idempotent: the content hash covers every indexed field and the embedding model, so the
same source, version and content is a no-op. Changed content replaces only that version.
With a reranker that can reuse passage states (``runtime.states_key``) and ``rerank_states``
on, each chunk's states are computed here too and stored with it (README "Cached passage
states"; read off the embedding pass where they can be, ``service/models/one_pass.py``);
the hash leaves the reranker out, so a new reranker does not re-ingest anything: its key
differs, and the fill's scan at start (``states_fill.py``) computes the states in the
background (a rerank that comes first computes its head's itself). The chunks ingest
stores without states (past the passage cap, with the one pass only) are handed to the
fill, which computes theirs once ingest has been quiet for a while.
With a Latin-script embedder (``latin_embedding_model``), chunks without Han characters also
get its vector, in the same pool; the hash covers that model too, so turning it on re-embeds
a document at its next ingest.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from service.config import Config
from service.engines.base import ChunkRecord, Engine, Vector, make_chunk_id
from service.ingest.chunking import chunk_document, embedded_text
from service.ingest.documents import DocumentInput, validate_document
from service.ingest.states_fill import StatesFill
from service.models.base import FloatArray
from service.models.runtime import ModelRuntime
from service.script import has_han

if TYPE_CHECKING:
    from service.observability.metrics import ServiceMetrics

# Ingest is not latency-critical; give embedding generous room but never wait forever.
_EMBED_DEADLINE_S = 600.0


@dataclass(frozen=True)
class IngestOutcome:
    status: str  # "indexed" | "unchanged" | "invalid" | "failed"
    chunks: int = 0
    field: str = ""
    message: str = ""


class Ingestor:
    def __init__(self, cfg: Config, engine: Engine, runtime: ModelRuntime,
                 metrics: ServiceMetrics | None = None) -> None:
        self.cfg = cfg
        self.engine = engine
        self.runtime = runtime
        self._active = 0  # documents being ingested now
        self._quiet_since = time.monotonic()
        # The fill of the states ingest leaves (run by the app); None: states are not
        # stored at ingest, or the fill is off.
        self.states_fill: StatesFill | None = None
        if runtime.ingest_states and runtime.states_key is not None and cfg.rerank_states_fill:
            self.states_fill = StatesFill(engine, runtime, runtime.states_key, ingest_idle_for=self.idle_for,
                                          idle_s=cfg.rerank_states_fill_idle_s, metrics=metrics)
        info = runtime.embedder.info
        self._model_key = f"{info.model_id}@{info.sha256}"
        if runtime.latin_embedder is not None:
            latin = runtime.latin_embedder.info
            self._model_key += f"+latin:{latin.model_id}@{latin.sha256}"

    def idle_for(self) -> float:
        """Seconds since the last document was ingested; 0 while one is."""
        return 0.0 if self._active else time.monotonic() - self._quiet_since

    async def ingest(self, doc: DocumentInput) -> IngestOutcome:
        self._active += 1
        try:
            return await self._ingest(doc)
        finally:
            self._active -= 1
            self._quiet_since = time.monotonic()

    async def _ingest(self, doc: DocumentInput) -> IngestOutcome:
        violations = validate_document(doc)
        if violations:
            first = violations[0]
            return IngestOutcome("invalid", field=first.field,
                                 message="; ".join(f"{v.field}: {v.description}" for v in violations))
        content_hash = doc.content_hash(self._model_key)
        if await self.engine.document_hash(doc.source_id, doc.version) == content_hash:
            return IngestOutcome("unchanged")
        pieces = await asyncio.to_thread(
            chunk_document, doc.text, doc.breadcrumb, doc.collection,
            self.cfg.chunk_chars, self.cfg.parent_chars,
        )
        texts = [embedded_text(doc.title, p) for p in pieces]
        deadline = time.monotonic() + _EMBED_DEADLINE_S
        states_key = self.runtime.states_key if self.runtime.ingest_states else None
        # The Latin-script embedder's vectors, for chunks without Han characters.
        latin_rows = [i for i, t in enumerate(texts) if not has_han(t)] if self.runtime.latin_embedder else []
        latin_vectors: list[Vector | None] = [None] * len(pieces)
        latin = self._latin(texts, latin_rows, deadline)
        batch = self.cfg.embed_batch
        states: list[bytes | None] = [None] * len(pieces)
        if states_key is None:
            (vectors, _), latin_matrix = await asyncio.gather(
                self.runtime.embed_passages(texts, deadline, batch=batch), latin)
        else:
            # A rerank reads a chunk as it is embedded (``rerank_passage_text``): the states
            # are computed over ``texts`` too.
            if self.runtime.one_pass_states:  # vector and states from one pass where they can
                (vectors, states, _), latin_matrix = await asyncio.gather(
                    self.runtime.embed_passages_with_states(texts, deadline, batch=batch), latin)
            else:  # the reranker's lower layers, in the same pool, alongside the embeddings
                (vectors, _), latin_matrix, blobs = await asyncio.gather(
                    self.runtime.embed_passages(texts, deadline, batch=batch), latin,
                    self.runtime.passage_states(texts, deadline, batch=batch))
                states = list(blobs)
        for row, i in enumerate(latin_rows):
            latin_vectors[i] = latin_matrix[row]
        records = [
            ChunkRecord(
                chunk_id=make_chunk_id(doc.source_id, p.index, doc.version),
                source_id=doc.source_id, version=doc.version, chunk_index=p.index,
                collection=doc.collection, status=doc.status, title=doc.title,
                breadcrumb=p.breadcrumb, text=p.text, parent_text=p.parent_text,
                search_text=text, acl=doc.acl, metadata=dict(doc.metadata),
                content_hash=content_hash, vector=vectors[i], latin_vector=latin_vectors[i],
                rerank_states=states[i], rerank_states_key=states_key or "",
            )
            for i, (p, text) in enumerate(zip(pieces, texts))
        ]
        report = await self.engine.replace_document(doc.source_id, doc.version, records)
        if report.errors:
            return IngestOutcome("failed", report.written,
                                 message="; ".join(f"{e.chunk_id}: {e.message}" for e in report.errors[:5]))
        if self.states_fill is not None:  # it exists only where ingest stores states
            self.states_fill.left([(r.chunk_id, content_hash, r.search_text) for r in records if r.rerank_states is None])
        return IngestOutcome("indexed", len(records))

    async def _latin(self, texts: list[str], rows: list[int], deadline: float) -> FloatArray:
        if not rows:
            return np.zeros((0, 0), np.float32)
        matrix, _ = await self.runtime.embed_passages([texts[i] for i in rows], deadline, batch=self.cfg.embed_batch,
                                                      latin=True)
        return matrix
