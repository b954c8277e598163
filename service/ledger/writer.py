"""Attempt records are written off the caller's path.

An attempt waits on the ledger at most once: for its budget reservation (attempts without a
run wait on nothing). Its record, observations and gap go to this writer, which batches
them into one store write per batch and retries while the store is down, so a ledger
outage never changes what the caller gets back and loses no record unless more than
``max_pending`` pile up (then the oldest are dropped, counted, and logged).

Reads that must see this process's own writes (GetAttempt, GetRun, ResolveGap, ...) call
``flush`` first: read-your-writes within a process; another replica's records are visible
once its writer has written them (milliseconds, while its ledger is up).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

from service.ledger.base import AttemptEntry, Ledger

log = logging.getLogger(__name__)


class AttemptWriter:
    def __init__(self, ledger: Ledger, *, max_pending: int = 10000, max_batch: int = 256,
                 retry_s: float = 0.2, max_retry_s: float = 5.0) -> None:
        self.ledger = ledger
        self.max_pending = max_pending
        self.max_batch = max_batch
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self._pending: collections.deque[AttemptEntry] = collections.deque()
        self._inflight = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self.written = 0
        self.dropped = 0
        self.failures = 0
        self.last_error = ""

    @property
    def pending(self) -> int:
        return len(self._pending) + self._inflight

    def submit(self, entry: AttemptEntry) -> None:
        """Queue one attempt's writes; never blocks, never raises."""
        if len(self._pending) >= self.max_pending:
            self._pending.popleft()
            self.dropped += 1
            log.error("ledger writer: %d records pending, dropped the oldest (%d dropped so far)",
                      self.max_pending, self.dropped)
        self._pending.append(entry)
        self._idle.clear()
        self._wake.set()
        self.start()

    async def flush(self, timeout_s: float) -> bool:
        """Wait until everything submitted so far is written; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ledger-writer")

    async def close(self, timeout_s: float = 5.0) -> None:
        if not await self.flush(timeout_s):
            log.error("ledger writer: %d records not written at shutdown (%s)", self.pending, self.last_error)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        delay = self.retry_s
        while True:
            if not self._pending:
                if self._inflight == 0:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._pending.popleft() for _ in range(min(self.max_batch, len(self._pending)))]
            self._inflight = len(batch)
            try:
                await self.ledger.record(batch)
            except asyncio.CancelledError:
                self._pending.extendleft(reversed(batch))
                self._inflight = 0
                raise
            except Exception as exc:  # the store is down or refused: keep the batch, retry later
                self._pending.extendleft(reversed(batch))
                self._inflight = 0
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("ledger writer: %d records waiting, retry in %.1fs: %s", self.pending, delay, self.last_error)
                await asyncio.sleep(delay)
                delay = min(self.max_retry_s, delay * 2)
                continue
            self._inflight = 0
            self.written += len(batch)
            delay = self.retry_s
