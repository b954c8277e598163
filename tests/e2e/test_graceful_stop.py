"""Graceful stop of a real `python -m service serve` process on a real SIGTERM: health turns
NOT_SERVING at once, new attempts get UNAVAILABLE, an in-flight ingest stream finishes
within the grace period, the ledger is flushed (attempts made before the stop are on disk)
and the process exits 0; a second SIGTERM stops at once."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc, types_pb2
from tests.support.service_live import NOT_SERVING, SERVING, health_status
from tests.support.tcp_proxy import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 30.0


def _doc(i: int) -> corpus_pb2.Document:
    return corpus_pb2.Document(source_id=f"stop-{i}", version="v1", title=f"Doc {i}",
                               text=f"Document number {i} about kayaks and piers.",
                               collection=types_pb2.COLLECTION_DOC)


class Served:
    def __init__(self, tmp: Path) -> None:
        self.target = f"127.0.0.1:{free_port()}"
        self.data = tmp / "data"
        self.log_path = tmp / "serve.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RETRIEVAL_EMBEDDING_MODEL": "dummy-hash",
               "RETRIEVAL_RERANKER_MODEL": "", "RETRIEVAL_SHUTDOWN_GRACE_S": str(GRACE_S)}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "service", "serve", "--listen", self.target, "--data-dir", str(self.data)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.channel = grpc.aio.insecure_channel(self.target)
        self.retrieval = retrieval_pb2_grpc.RetrievalServiceStub(self.channel)
        self.corpus = corpus_pb2_grpc.CorpusServiceStub(self.channel)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait_serving(self) -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                if await health_status(self.channel) == SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
        raise AssertionError(f"not SERVING in time:\n{self.log()}")

    async def close(self) -> None:
        await self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


async def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        assert time.monotonic() < deadline, "process did not exit in time"
        await asyncio.sleep(0.05)
    return proc.returncode


async def test_sigterm_drains_in_flight_stream_refuses_new_work_and_flushes_the_ledger(tmp_path: Path) -> None:
    served = Served(tmp_path)
    try:
        await served.wait_serving()
        # One attempt before the stop: its ledger record must be on disk after the exit.
        before = [ev async for ev in served.retrieval.Retrieve(
            retrieval_pb2.RetrieveRequest(query="kayak", top_k=3, run_id="run-before-stop"), timeout=10)]
        attempt_id = before[-1].result.attempt_id

        queue: asyncio.Queue[corpus_pb2.IngestRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[corpus_pb2.IngestRequest]:
            while (item := await queue.get()) is not None:
                yield item

        await queue.put(corpus_pb2.IngestRequest(document=_doc(0)))
        ingest = asyncio.ensure_future(served.corpus.Ingest(requests(), timeout=60))
        await asyncio.sleep(0.5)  # the stream is open and its first document in
        assert not ingest.done()

        signalled = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        # NOT_SERVING at once (the server still answers while it drains).
        while await health_status(served.channel) != NOT_SERVING:
            assert time.monotonic() - signalled < 2.0, "health did not turn NOT_SERVING at once"
            await asyncio.sleep(0.02)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await served.retrieval.Lookup(retrieval_pb2.RetrieveRequest(query="kayak", top_k=3), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert served.proc.poll() is None, "exited while a stream was in flight"

        # The in-flight stream keeps going and finishes well inside the grace period.
        for i in range(1, 5):
            await queue.put(corpus_pb2.IngestRequest(document=_doc(i)))
        await queue.put(None)
        summary = await ingest
        assert summary.documents_received == 5 and summary.documents_indexed == 5, summary
        code = await _wait_exit(served.proc, GRACE_S)
        assert code == 0, served.log()
        assert time.monotonic() - signalled < GRACE_S, "waited for the grace period though nothing was in flight"
        log = served.log()
        assert "ledger writer flushed" in log and "engine closed" in log, log

        with sqlite3.connect(served.data / "ledger.sqlite3") as db:
            rows = db.execute("SELECT count(*) FROM attempts WHERE attempt_id = ?", (attempt_id,)).fetchone()
        assert rows == (1,), "the attempt made before the stop is in the ledger"
    finally:
        await served.close()


async def test_second_sigterm_stops_at_once(tmp_path: Path) -> None:
    served = Served(tmp_path)
    try:
        await served.wait_serving()
        queue: asyncio.Queue[corpus_pb2.IngestRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[corpus_pb2.IngestRequest]:
            while (item := await queue.get()) is not None:
                yield item

        await queue.put(corpus_pb2.IngestRequest(document=_doc(0)))
        ingest = asyncio.ensure_future(served.corpus.Ingest(requests(), timeout=60))
        await asyncio.sleep(0.5)
        served.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert served.proc.poll() is None, "the first SIGTERM waits for the open stream"
        signalled = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        code = await _wait_exit(served.proc, 10)
        assert time.monotonic() - signalled < 5.0, "second SIGTERM did not stop at once"
        assert code == 0, served.log()
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await ingest
        assert cut.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), cut.value
        assert "second stop signal" in served.log()
    finally:
        await queue.put(None)
        await served.close()
