"""Ingest yields model threads to queries.

A bulk ingest keeps every model thread busy with passage batches. The ingest pool's threads
already run at background priority (service/threads.py), but on few cores a second ingest
thread still slows a query's own model call (the cores share caches and memory bandwidth):
query p95 during an ingest went to 2.2x idle with two ingest threads, 1.6x with one. So an
ingest runs on all its threads only while no query-time model work is in flight or was in
the last ``linger_s``; otherwise on ``busy_workers`` of them. Queries mark themselves with
``foreground()``; ingest batches take a ``background()`` slot around each executor hop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

_POLL_S = 0.002  # how often a held-back ingest batch looks again


class ForegroundGate:
    def __init__(self, idle_workers: int, busy_workers: int, linger_s: float = 0.05,
                 on_held_back: Callable[[float], None] | None = None) -> None:
        self.idle_workers = max(1, idle_workers)
        self.busy_workers = max(1, min(busy_workers, self.idle_workers))
        self.linger_s = linger_s
        self._active = 0
        self._last = -float("inf")
        self._background = 0
        self.held_back_s = 0.0  # total time ingest batches waited for a slot (tests)
        self._on_held_back = on_held_back  # the metric

    def busy(self) -> bool:
        return self._active > 0 or time.monotonic() - self._last < self.linger_s

    def touch(self) -> None:
        """A query did something without model work (a cached embedding): still a query."""
        self._last = time.monotonic()

    @contextmanager
    def foreground(self) -> Iterator[None]:
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            self._last = time.monotonic()

    def allowed(self) -> int:
        return self.busy_workers if self.busy() else self.idle_workers

    @asynccontextmanager
    async def background(self) -> AsyncIterator[None]:
        if self._background >= self.allowed():
            started = time.monotonic()
            while self._background >= self.allowed():
                await asyncio.sleep(_POLL_S)
            waited = time.monotonic() - started
            self.held_back_s += waited
            if self._on_held_back is not None:
                self._on_held_back(waited)
        self._background += 1
        try:
            yield
        finally:
            self._background -= 1
