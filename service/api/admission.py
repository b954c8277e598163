"""Admission before any work: is the server draining, is it overloaded, is this principal at
its concurrency quota. Also counts what is in flight, so a graceful stop knows when every
attempt and ingest stream has finished."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

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

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise ShuttingDown("server is shutting down")

    def admit(self, principal: Principal = ANONYMOUS) -> None:
        """Raise ShuttingDown or Overloaded, or return: the caller then runs ``attempt``
        with no await in between (so the checks and the count agree)."""
        self.refuse_if_draining()
        if self.inflight >= self.app.cfg.max_inflight_attempts:
            self.app.metrics.shed.labels("inflight_limit").inc()
            raise Overloaded(f"{self.inflight} attempts in flight (limit {self.app.cfg.max_inflight_attempts})", 0.25)
        if self.app.runtime.overloaded():
            self.app.metrics.shed.labels("model_queue").inc()
            raise Overloaded("model queues are nearly full", 0.25)
        self.quotas.check_concurrency(principal.name)

    @contextlib.contextmanager
    def attempt(self, principal: Principal = ANONYMOUS) -> Iterator[None]:
        self.inflight += 1
        self.app.metrics.inflight.inc()
        with self._held(principal):
            try:
                yield
            finally:
                self.inflight -= 1
                self.app.metrics.inflight.dec()

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
