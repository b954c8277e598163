"""Admission before any work: is the server draining, is it overloaded, is this principal at
its concurrency quota, and (with ``max_running_attempts``) is a running slot free or worth
waiting for (``attempt_queue``). Also counts what is in flight, so a graceful stop knows
when every attempt and ingest stream has finished."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from service.api.attempt_queue import AttemptQueue
from service.api.quotas import Quotas
from service.errors import Overloaded, ShuttingDown
from service.pipeline.request import ANONYMOUS, Principal

if TYPE_CHECKING:
    from service.app import App


class Admission:
    def __init__(self, app: App, quotas: Quotas | None = None) -> None:
        self.app = app
        self.quotas = quotas or Quotas()
        self.inflight = 0  # attempts (Retrieve, Lookup)
        self.streams = 0  # ingest streams
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        cfg = app.cfg
        self.queue: AttemptQueue | None = None
        if cfg.max_running_attempts > 0:
            queue = self.queue = AttemptQueue(
                cfg.max_running_attempts, cfg.admission_target_ms / 1000, cfg.admission_interval_ms / 1000,
                on_shed=app.metrics.shed.labels("queue_delay").inc)
            app.metrics.watch_admission_queue(lambda: queue.waiting)

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise ShuttingDown("server is shutting down")

    def admit(self, principal: Principal = ANONYMOUS) -> None:
        """Raise ShuttingDown or Overloaded, or return: the caller then runs ``attempt``
        with no await in between (so the checks and the count agree)."""
        self.refuse_if_draining()
        held = self.inflight + (self.queue.waiting if self.queue else 0)
        if held >= self.app.cfg.max_inflight_attempts:
            self.app.metrics.shed.labels("inflight_limit").inc()
            raise Overloaded(f"{held} attempts in flight or waiting (limit {self.app.cfg.max_inflight_attempts})", 0.25)
        if self.app.runtime.overloaded():
            self.app.metrics.shed.labels("model_queue").inc()
            raise Overloaded("model queues are nearly full", 0.25)
        self.quotas.check_concurrency(principal.name)

    async def take_turn(self, deadline: float) -> float:
        """With a running limit: wait for a running slot (Overloaded when shed); the seconds
        waited (0 without a limit). The caller then enters ``attempt(..., turn=True)`` with no
        await in between; leaving it gives the slot back."""
        if self.queue is None:
            return 0.0
        waited = await self.queue.enter(deadline - time.monotonic())
        self.app.metrics.admission_wait.observe(waited)
        return waited

    @contextlib.contextmanager
    def attempt(self, principal: Principal = ANONYMOUS, turn: bool = False) -> Iterator[None]:
        self.inflight += 1
        self.app.metrics.inflight.inc()
        started = time.monotonic()
        with self._held(principal):
            try:
                yield
            finally:
                self.inflight -= 1
                self.app.metrics.inflight.dec()
                if turn and self.queue is not None:
                    self.queue.leave(time.monotonic() - started)

    def admit_stream(self, principal: Principal = ANONYMOUS) -> None:
        """An ingest stream is refused while draining or at the principal's quota."""
        self.refuse_if_draining()
        self.quotas.check_concurrency(principal.name)

    @contextlib.contextmanager
    def stream(self, principal: Principal = ANONYMOUS) -> Iterator[None]:
        self.streams += 1
        with self._held(principal):
            try:
                yield
            finally:
                self.streams -= 1

    @contextlib.contextmanager
    def _held(self, principal: Principal) -> Iterator[None]:
        self.quotas.enter(principal.name)
        self._idle.clear()
        try:
            yield
        finally:
            self.quotas.leave(principal.name)
            if self.inflight + self.streams == 0:  # the caller's count dropped just before
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no attempt or ingest stream is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
