"""The rerank stage's stored passage states (README "Cached passage states"): fetched from
the engine for the reranked head, row-aligned with it. Best effort by design: a chunk with
no states, stale ones (another reranker, changed content) or an engine that fails or is
slow to answer just gets its states computed by the reranker, as before they existed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from service.engines.base import Engine, EngineError
from service.pipeline.fusion import Candidate

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
