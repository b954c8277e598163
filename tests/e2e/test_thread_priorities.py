"""Thread priorities of a real server (service/threads.py): the event loop keeps its own, the
query-time workers (model pool, embedded engine searches, SQLite ledger) run `worker_nice`
steps below it, and ingest's threads `ingest_nice` steps below it, after a retrieve and an
ingest have started every pool."""

from __future__ import annotations

import asyncio
import threading
import time

from service._gen.retrieval.v1 import corpus_pb2, types_pb2
from service.threads import thread_nice
from tests.support.harness import StartServer, result_of


def _nices_by_pool(before: set[threading.Thread]) -> dict[str, set[int]]:
    """The nice value of each live thread not in ``before`` (other tests' servers, such as the
    session's shared demo server, have pools of the same names; compared as Thread objects:
    an ident is reused once its thread has exited), grouped by its pool's name
    (``model_0`` -> ``model``); the loop's thread as ``MainThread``."""
    out: dict[str, set[int]] = {"MainThread": {thread_nice(threading.get_native_id())}}
    for t in threading.enumerate():
        if t.native_id is None or t in before:
            continue
        pool = t.name.rsplit("_", 1)[0] if t.name[-1:].isdigit() else t.name
        out.setdefault(pool, set()).add(thread_nice(t.native_id))
    return out


async def _pools_started(before: set[threading.Thread], pools: tuple[str, ...], timeout: float = 5.0) -> dict[str, set[int]]:
    """``_nices_by_pool`` once every named pool has a thread: the ledger records an attempt
    off the caller's path, so its worker may start just after the result reached us."""
    deadline = time.monotonic() + timeout
    nices = _nices_by_pool(before)
    while not all(p in nices for p in pools) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        nices = _nices_by_pool(before)
    return nices


async def test_query_workers_run_below_the_event_loop_and_ingest_below_them(start_server: StartServer) -> None:
    loop_nice = thread_nice(threading.get_native_id())
    before = set(threading.enumerate())
    live = await start_server(worker_nice=4, ingest_nice=9, demo=False)
    doc = corpus_pb2.Document(source_id="prio", version="v1", title="Priorities", text="renewal of a home policy",
                              collection=types_pb2.COLLECTION_DOC, status=types_pb2.SOURCE_STATUS_APPROVED)
    summary = await live.ingest([doc])
    assert summary.documents_indexed == 1
    result = result_of(await live.retrieve(query="home policy renewal", top_k=3))
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND
    nices = await _pools_started(before, ("model", "embedded", "ledger", "ingest-model", "embedded-writer"))
    assert nices["MainThread"] == {loop_nice}
    for pool in ("model", "embedded", "ledger"):
        assert nices.get(pool) == {min(19, loop_nice + 4)}, (pool, nices)
    for pool in ("ingest-model", "embedded-writer"):
        assert nices.get(pool) == {min(19, loop_nice + 9)}, (pool, nices)


async def test_zero_worker_nice_leaves_query_workers_at_the_loops_priority(start_server: StartServer) -> None:
    loop_nice = thread_nice(threading.get_native_id())
    before = set(threading.enumerate())
    live = await start_server(worker_nice=0, demo=False)
    result = result_of(await live.retrieve(query="anything at all", top_k=3))
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_EMPTY
    nices = await _pools_started(before, ("model", "embedded", "ledger"))
    for pool in ("model", "embedded", "ledger"):
        assert nices.get(pool) == {loop_nice}, (pool, nices)
