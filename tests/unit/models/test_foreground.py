"""Ingest yields model threads to queries: the gate, and the runtime's ingest pool under it."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from service.models.base import Encoded, FloatArray
from service.models.dummy import HashEmbedder
from service.models.foreground import ForegroundGate
from service.models.runtime import ModelRuntime
from service.threads import thread_nice


class _SlowPassages(HashEmbedder):
    """Passage calls (the ingest pool's) take 30 ms and record how many run at once, and on
    which threads. Batch-dependent like the int8 models, so each request is its own call."""

    batch_invariant = False

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.running = 0
        self.peaks: list[tuple[float, int]] = []
        self.threads: set[int] = set()

    def infer(self, encoded: Encoded) -> FloatArray:
        passage = threading.current_thread().name.startswith("ingest-model")
        if passage:
            with self.lock:
                self.running += 1
                self.peaks.append((time.monotonic(), self.running))
                self.threads.add(threading.get_native_id())
            time.sleep(0.03)
            with self.lock:
                self.running -= 1
        return super().infer(encoded)


async def test_gate_gives_ingest_every_worker_only_while_no_query_runs() -> None:
    gate = ForegroundGate(idle_workers=2, busy_workers=1, linger_s=0.05)
    assert gate.allowed() == 2
    with gate.foreground():
        assert gate.busy() and gate.allowed() == 1
    assert gate.busy(), "a query that just ended still holds ingest back for linger_s"
    await asyncio.sleep(0.06)
    assert not gate.busy() and gate.allowed() == 2
    gate.touch()  # a cached query embedding: still a query
    assert gate.allowed() == 1


async def test_ingest_runs_on_both_threads_alone_and_one_while_queries_run() -> None:
    model = _SlowPassages()
    from service.observability.metrics import ServiceMetrics
    from tests.support.scrape import parse

    metrics = ServiceMetrics()
    rt = ModelRuntime(model, None, workers=2, ingest_workers=2, ingest_nice=5, max_wait_ms=0, max_batch=1,
                      metrics=metrics)
    await rt.start()
    await asyncio.sleep(rt.foreground.linger_s * 2)  # start-up's warm-up query has lingered out
    deadline = time.monotonic() + 30
    try:
        # Alone: two passage calls at a time (each request is one call of its own).
        await asyncio.gather(*(rt.embed_passages([f"alone {i}"], deadline) for i in range(8)))
        assert max(n for _, n in model.peaks) == 2
        # While a query stream runs: one at a time.
        model.peaks.clear()
        stop = time.monotonic() + 0.6

        async def queries() -> None:
            while time.monotonic() < stop:
                await rt.embed_query(f"q {time.monotonic()}", deadline)
                await asyncio.sleep(0.005)

        stream = asyncio.ensure_future(queries())
        await asyncio.sleep(0.05)  # the stream has started
        started = time.monotonic()
        await asyncio.gather(*(rt.embed_passages([f"busy {i}"], deadline) for i in range(8)))
        during = [n for t, n in model.peaks if t >= started + 0.04 and t < stop]  # after any call already running
        await stream
        assert during and max(during) == 1, model.peaks
        assert rt.foreground.held_back_s > 0
        held = parse(metrics.exposition().decode())[("retrieval_ingest_held_back_seconds_total", ())]
        assert abs(held - rt.foreground.held_back_s) < 1e-9
        # The ingest threads run below normal priority.
        assert all(thread_nice(tid) >= thread_nice(threading.get_native_id()) + 5 for tid in model.threads)
        vec, _ = await rt.embed_query("after", deadline)
        assert np.isfinite(vec).all()
    finally:
        await rt.close()
