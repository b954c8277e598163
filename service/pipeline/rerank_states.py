"""The rerank stage's stored passage states (README "Cached passage states"): fetched from
the engine for the reranked head, row-aligned with it. Best effort by design: a chunk with
no states, stale ones (another reranker, changed content) or an engine that fails or is
slow to answer just gets its states computed by the reranker, as before they existed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from service.engines.base import Engine, EngineError
from service.pipeline.fusion import Candidate

if TYPE_CHECKING:
    from service.observability.metrics import ServiceMetrics

log = logging.getLogger(__name__)

# The most of the rerank budget the read may take: past it, computing is the better bet.
_READ_SHARE = 0.25


async def stored_states(engine: Engine, states_key: str | None, head: Sequence[Candidate],
                        budget_s: float) -> list[bytes | None]:
    """One entry per candidate in ``head``: its stored states, or None (compute them)."""
    if states_key is None or not head:
        return [None] * len(head)
    refs = [(c.chunk.chunk_id, c.chunk.content_hash) for c in head]
    try:
        found = await asyncio.wait_for(engine.passage_states(refs, states_key), budget_s * _READ_SHARE)
    except (EngineError, TimeoutError) as exc:
        log.warning("passage states not read (%s); the reranker computes them", exc)
        return [None] * len(head)
    return [found.get(c.chunk.chunk_id) for c in head]


class StatesWriteBack:
    """Write-back (``rerank_states_write_back``): the states a rerank computed for head
    chunks that had none are stored, off the request path, so the next rerank of a hot chunk
    reads them instead. Best effort and bounded: at most ``max_pending`` writes in flight
    (past that a rerank's states are not kept; a later rerank offers them again), a chunk
    already being written is skipped, and a failed write only means computing next time. The
    engine stores them only onto the chunk version they were computed for."""

    def __init__(self, engine: Engine, states_key: str | None, enabled: bool, max_pending: int = 8,
                 metrics: ServiceMetrics | None = None) -> None:
        self.engine = engine
        self._metrics = metrics
        self.states_key = states_key if enabled else None
        self.max_pending = max_pending
        self._pending: set[asyncio.Task[None]] = set()
        self._writing: set[str] = set()
        self.written = 0

    def offer(self, head: Sequence[Candidate], computed: dict[int, bytes]) -> None:
        if self.states_key is None or not computed:
            return
        items = [(head[i].chunk.chunk_id, head[i].chunk.content_hash, blob) for i, blob in sorted(computed.items())
                 if head[i].chunk.chunk_id not in self._writing]
        if not items:
            return
        if len(self._pending) >= self.max_pending:
            self._count("skipped", len(items))
            return
        self._writing.update(cid for cid, _, _ in items)
        task = asyncio.get_running_loop().create_task(self._write(items, self.states_key), name="states-write-back")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write(self, items: list[tuple[str, str, bytes]], states_key: str) -> None:
        try:
            written = await self.engine.put_passage_states(items, states_key)
            self.written += written
            self._count("written", written)
            self._count("stale", len(items) - written)
        except EngineError as exc:
            log.warning("passage states not written back (%s); reranks compute them", exc)
            self._count("failed", len(items))
        finally:
            self._writing.difference_update(cid for cid, _, _ in items)

    def _count(self, result: str, n: int) -> None:
        if self._metrics is not None and n > 0:
            self._metrics.states_write_back.labels(result).inc(n)

    async def drain(self) -> None:
        """Wait for the writes in flight (shutdown, before the engine closes; tests)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
