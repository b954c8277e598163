"""Backfill of the Latin-script leg's vectors for chunks ingested before it was served.

A store made before ``latin_embedding_model`` was on (or with another Latin-script model)
has chunks without a ``latin_vector``. Searched as they are, the leg would find only chunks
ingested since, and its weight in the fusion would favour them over older ones. So where
the leg is served, the service catches the store up at start: it pages through the chunks
without that vector (``Engine.chunks_without``), embeds those without Han characters (what
ingest would have embedded: their ``search_text``) in the ingest pool, and stores each vector
only onto the chunk version it was computed for (``Engine.put_vectors``: a chunk re-ingested
or deleted meanwhile keeps what it has). Until every page is done the attempt runner reports
the leg SKIPPED, with this progress as the reason, and fuses the two other legs exactly as
without it (README "The Latin-script dense leg").

Chunks with Han characters never get the vector, so they are read and passed over at each
start (one page of ids and texts per ``page`` chunks); the service reads such pages before it
serves (``App.start``, up to a couple of seconds), so a caught-up store serves the leg from
the first query.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from service.engines.base import Engine, VectorField
from service.models.runtime import ModelRuntime
from service.script import has_han

log = logging.getLogger(__name__)

PAGE = 256
_EMBED_DEADLINE_S = 600.0
RETRY_S = 5.0  # after an engine or model failure, the page is read again this much later


@dataclass
class BackfillProgress:
    scanned: int = 0  # chunks read without the vector (Han ones included)
    stored: int = 0  # Latin-script chunks that got their vector
    done: bool = False

    def reason(self) -> str:
        """Why the leg is not searched yet (the SKIPPED leg's detail)."""
        return (f"catching up: embedding chunks ingested before the Latin-script leg was served "
                f"({self.stored} stored so far)")


class LatinBackfill:
    def __init__(self, engine: Engine, runtime: ModelRuntime, *, page: int | None = None,
                 on_change: Callable[[BackfillProgress], None] | None = None) -> None:
        self.engine = engine
        self.runtime = runtime
        self.page = page or PAGE
        self.progress = BackfillProgress()
        self._after = ""
        self.last_embedded = 0  # Latin-script chunks the last page embedded
        self._on_change = on_change or (lambda _: None)

    async def step(self) -> bool:
        """One page: read, embed the Latin-script chunks, store. True when nothing is left."""
        self.last_embedded = 0
        rows = await self.engine.chunks_without(VectorField.LATIN, self._after, self.page)
        if not rows:
            self.progress.done = True
            self._on_change(self.progress)
            return True
        latin = await asyncio.to_thread(lambda: [r for r in rows if not has_han(r[2])])
        self.last_embedded = len(latin)
        if latin:
            matrix, _ = await self.runtime.embed_passages(
                [text for _, _, text in latin], time.monotonic() + _EMBED_DEADLINE_S, latin=True)
            self.progress.stored += await self.engine.put_vectors(
                VectorField.LATIN, [(cid, content_hash, matrix[i]) for i, (cid, content_hash, _) in enumerate(latin)])
        self.progress.scanned += len(rows)
        self._after = rows[-1][0]
        self.progress.done = len(rows) < self.page
        self._on_change(self.progress)
        return self.progress.done

    async def run(self) -> BackfillProgress:
        """Every page, retrying a failed one after ``RETRY_S`` (the engine may be down at
        start); cancelled with the app."""
        while True:
            try:
                if await self.step():
                    break
            except Exception as exc:  # noqa: BLE001 (engine down, model overloaded: read the page again later)
                log.warning("Latin-script backfill: %s; retrying in %.0f s", exc, RETRY_S)
                await asyncio.sleep(RETRY_S)
        if self.progress.stored:
            log.info("Latin-script backfill done: %d chunks got their vector (%d read)",
                     self.progress.stored, self.progress.scanned)
        return self.progress
