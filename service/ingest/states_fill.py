"""The fill: passage states for the chunks ingest left without, computed while the service idles.

With states at ingest (``rerank_states``), a chunk can still have none for the served
reranker: the one pass leaves the chunks past the passage cap to their first rerank
(``rerank_states_second_pass`` off, ~9 % of Chinese chunks), and a store may hold chunks
ingested before states were on or under another reranker. A rerank computes such a chunk's
states and write-back keeps them, but that first rerank pays for it: on a cold Chinese corpus
p50 ~100 ms instead of ~17 ms at 50 pairs (README "One pass only"). The fill computes them
before a query has to:

- **what**: the chunks ingest hands over as it leaves them (``left``), and at start (or when
  more were handed over than it keeps) every chunk the engine lists without current states
  (``Engine.chunks_without_states``, paged by chunk id);
- **when**: only once ingest has been quiet for ``idle_s`` and no query is using the models,
  checked before each chunk, so bulk ingest keeps its speed and a query meets at most one
  chunk's lower layers on one ingest thread (niced below the query pool);
- **how**: each chunk alone through the reranker's passage states (``runtime.passage_states``,
  one row a call: the very bytes ingest's second pass or a rerank would store), stored with
  ``Engine.put_passage_states``, only onto the chunk version it was computed for; a chunk
  that got its states meanwhile (a rerank's write-back) is skipped.

Nothing here changes an answer: stored or computed, a rerank reads the same states.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.engines.base import Engine
from service.models.runtime import ModelRuntime

if TYPE_CHECKING:
    from service.observability.metrics import ServiceMetrics

log = logging.getLogger(__name__)

PAGE = 256  # chunks a scan reads at a time
BATCH = 16  # chunks checked, computed and stored together
MAX_PENDING = 4096  # chunks handed over and not yet filled; past it, a scan finds them
RETRY_S = 5.0  # after an engine or model failure, the work is tried again this much later,
RETRY_MAX_S = 60.0  # doubling while it keeps failing (a node down for an hour: ~60 lines, not 720)
_POLL_S = 0.05
_DEADLINE_S = 600.0

Row = tuple[str, str, str]  # chunk_id, content_hash, the text its states are computed over


@dataclass
class FillProgress:
    written: int = 0  # chunks that got their states from the fill
    scans: int = 0  # scans finished


class StatesFill:
    def __init__(self, engine: Engine, runtime: ModelRuntime, states_key: str, *,
                 ingest_idle_for: Callable[[], float], idle_s: float,
                 metrics: ServiceMetrics | None = None, page: int = PAGE, max_pending: int = MAX_PENDING) -> None:
        self.engine = engine
        self.runtime = runtime
        self.states_key = states_key
        self.idle_s = idle_s
        self.page = page
        self.max_pending = max_pending
        self.progress = FillProgress()
        self._ingest_idle_for = ingest_idle_for
        self._metrics = metrics
        self._pending: dict[str, tuple[str, str]] = {}  # chunk_id -> (content_hash, text)
        self._scan_from: str | None = ""  # a scan's next chunk id ("" = the start); None: no scan due
        self._scans_asked = 0  # scans asked for since start (a page read before the last ask is stale)
        self._busy = False  # a batch or page taken and not finished
        self._unrefreshed = False  # written since the last refresh
        self._wake = asyncio.Event()
        self._report()

    def left(self, rows: Sequence[Row]) -> None:
        """Chunks ingest stored without states (after their write was acknowledged)."""
        if not rows:
            return
        if len(self._pending) + len(rows) > self.max_pending:
            self._scan_from = ""  # too many to keep: a scan from the start finds them
            self._scans_asked += 1
        else:
            self._pending.update((cid, (h, text)) for cid, h, text in rows)
        self._report()
        self._wake.set()

    def _report(self) -> None:
        if self._metrics is not None:
            self._metrics.states_fill_pending.set(len(self._pending))
            self._metrics.states_fill_scanning.set(0 if self._scan_from is None else 1)

    @property
    def caught_up(self) -> bool:
        """Nothing handed over is left, no scan is due and nothing is being filled."""
        return not self._pending and self._scan_from is None and not self._busy

    async def run(self) -> None:
        """Fill until cancelled (with the app); a failed step is retried after ``RETRY_S``,
        doubling up to ``RETRY_MAX_S`` while it keeps failing."""
        delay = RETRY_S
        while True:
            if self.caught_up:
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.step()
                delay = RETRY_S
            except Exception as exc:  # noqa: BLE001 (engine down, model overloaded: try again later)
                log.warning("passage states fill: %s; retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    async def step(self) -> None:
        """One batch of the chunks handed over, else one page of a scan, when idle."""
        await self._until_idle()
        self._busy = True
        try:
            if self._pending:
                await self._fill_pending()
            elif self._scan_from is not None:
                await self._scan_page(self._scan_from)
            if self._unrefreshed and not self._pending and self._scan_from is None:
                # Caught up: make the writes visible now. A realtime read of a chunk written
                # since the last refresh makes OpenSearch refresh inside that read, and an
                # index no one searched for 30 s skips its scheduled refreshes: without this
                # the first reranks after a fill read p90 45 ms against 22 stored (one run;
                # 17-23 with it, README "Ingest on OpenSearch").
                await self.engine.refresh()
                self._unrefreshed = False
        finally:
            self._busy = False
            self._report()

    async def _fill_pending(self) -> None:
        ids = list(self._pending)[:BATCH]
        rows = [(cid, *self._pending.pop(cid)) for cid in ids]
        try:
            await self._fill(rows)
        except BaseException:
            for cid, h, text in rows:  # not lost: tried again (a newer hand-over wins)
                self._pending.setdefault(cid, (h, text))
            raise

    async def _scan_page(self, after: str) -> None:
        asked = self._scans_asked
        rows, next_from = await self.engine.chunks_without_states(self.states_key, after, self.page)
        for i in range(0, len(rows), BATCH):
            await self._fill(rows[i : i + BATCH])
        if self._scans_asked != asked:  # a hand-over asked for a scan from the start meanwhile
            return
        self._scan_from = next_from
        if next_from is None:
            self.progress.scans += 1
            log.info("passage states fill: scan done, %d chunks filled so far", self.progress.written)

    async def _fill(self, rows: Sequence[Row]) -> None:
        have = await self.engine.passage_states([(cid, h) for cid, h, _ in rows], self.states_key)
        todo = [row for row in rows if row[0] not in have]
        computed: list[tuple[str, str, bytes]] = []
        for cid, h, text in todo:
            await self._until_idle()
            [blob] = await self.runtime.passage_states([text], time.monotonic() + _DEADLINE_S, batch=1)
            computed.append((cid, h, blob))
        written = await self.engine.put_passage_states(computed, self.states_key) if computed else 0
        self.progress.written += written
        self._unrefreshed = self._unrefreshed or written > 0
        if self._metrics is not None:
            self._metrics.states_fill.labels("had").inc(len(rows) - len(todo))
            self._metrics.states_fill.labels("written").inc(written)
            self._metrics.states_fill.labels("stale").inc(len(computed) - written)

    async def _until_idle(self) -> None:
        """Until ingest has been quiet for ``idle_s`` and no query is using the models."""
        while True:
            quiet = self._ingest_idle_for()
            if quiet >= self.idle_s and not self.runtime.foreground.busy():
                return
            await asyncio.sleep(max(_POLL_S, self.idle_s - quiet))
