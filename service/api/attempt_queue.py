"""Latency-bounded admission (opt-in, ``max_running_attempts`` > 0): at most that many
attempts run at once, the rest wait here, and under sustained overload a wait is cut short
with RESOURCE_EXHAUSTED instead of growing with the backlog.

Why a queue rather than a lower in-flight count: attempts that run together share two
cores, so each one's latency grows with how many run; a small running limit keeps that
near the unloaded latency. A bare count that small would refuse a burst that the server
clears in a few milliseconds; the queue absorbs it.

The policy is controlled delay with adaptive LIFO (CoDel's idea applied to a request
queue, as in Maurer, "Fail at Scale", 2015):

- While a slot has stood free within the last window, the server keeps up: waiters run first
  in, first out, for as long as their callers' deadlines allow (a burst drains).
- Once no slot has been free for a whole window (a standing queue: work arrives faster than
  it finishes), a waiter may wait only ``target``, and the newest runs first. The ones that
  get in wait almost nothing; the older ones are shed while their callers can still retry or
  go elsewhere, instead of every caller waiting out the backlog.

The window is ``interval``, or twice the recent mean time an attempt holds its slot when
that is longer: a rerank holds one for ~200 ms, and a window shorter than an attempt would
call every busy moment a standing queue.

All of it runs on the event loop (no locks): ``enter`` and ``leave`` never block.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from service.errors import Overloaded


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[None]
    since: float
    timer: asyncio.TimerHandle | None = field(default=None)


class AttemptQueue:
    def __init__(self, running: int, target_s: float, interval_s: float,
                 on_shed: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic) -> None:
        if running < 1:
            raise ValueError("max_running_attempts must be >= 1 for a running limit")
        if not 0 < target_s <= interval_s:
            raise ValueError("admission_target_ms must be > 0 and at most admission_interval_ms")
        self.limit = running
        self.target_s = target_s
        self.interval_s = interval_s
        self.running = 0
        self._on_shed = on_shed
        self._clock = clock
        self._waiters: deque[_Waiter] = deque()
        self._spare_at = clock()  # the last moment a slot stood free (and nobody was shed lately)
        self._shed_at = float("-inf")  # the last moment a waiter was shed
        self._held_s = 0.0  # moving mean of how long an attempt holds its slot

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def window(self) -> float:
        return max(self.interval_s, 2 * self._held_s)

    def standing(self, now: float | None = None) -> bool:
        """No slot has been free for a whole window: arrivals outpace the running attempts."""
        now = self._clock() if now is None else now
        return now - self._spare_at > self.window()

    def _spare(self, now: float) -> None:
        # A slot free because its waiters were just shed is no sign of spare capacity: the
        # queue stands until a whole window has passed with nobody shed.
        if now - self._shed_at > self.window():
            self._spare_at = now

    async def enter(self, budget_s: float) -> float:
        """Take a running slot, waiting for one if all are taken (at most ``budget_s``, the
        caller's remaining deadline); the seconds waited. Raises Overloaded when shed."""
        now = self._clock()
        if self.running < self.limit and not self._waiters:
            self.running += 1
            self._spare(now)
            return 0.0
        budget_s = max(0.0, budget_s)
        if self.standing(now):
            self._shed_stale(now)
            budget_s = min(self.target_s, budget_s)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), now)
        waiter.timer = loop.call_later(budget_s, self._expire, waiter)
        self._waiters.append(waiter)
        try:
            await waiter.future
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.leave(0.0)  # handed a slot just as the caller went: pass it on
            elif not waiter.future.done() or waiter.future.cancelled():
                self._discard(waiter)
            raise
        finally:
            waiter.timer.cancel()
        return self._clock() - waiter.since

    def leave(self, held_s: float) -> None:
        """An attempt that held a slot for ``held_s`` finished: hand the slot to a waiter, or
        free it."""
        if held_s > 0:
            self._held_s += 0.1 * (held_s - self._held_s)
        now = self._clock()
        standing = self.standing(now)
        if standing:
            self._shed_stale(now)
        while self._waiters:
            waiter = self._waiters.pop() if standing else self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_result(None)  # the slot passes on: running stays the same
                return
        self.running -= 1
        self._spare(now)

    def _shed_stale(self, now: float) -> None:
        """Shed from the old end whatever has waited past the target."""
        while self._waiters and now - self._waiters[0].since > self.target_s:
            self._shed(self._waiters.popleft(), now)

    def _expire(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            self._discard(waiter)
            self._shed(waiter, self._clock())

    def _shed(self, waiter: _Waiter, now: float) -> None:
        if waiter.future.done():
            return
        self._shed_at = now
        waited_ms = (now - waiter.since) * 1000
        waiter.future.set_exception(Overloaded(
            f"waited {waited_ms:.0f} ms for one of {self.limit} running slots "
            f"({len(self._waiters)} still waiting)", self.interval_s))
        self._on_shed()

    def _discard(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
