"""Acknowledged ingest: commit documents as they arrive and acknowledge each one once it is
committed (written and refreshed, so visible to searches) or has failed.

Flow control: at most ``max_in_flight`` documents are read but not yet acknowledged; while at
that bound the reader stops pulling from the caller's stream, so the transport's own flow
control pushes back on a fast client and the server's memory stays bounded. Documents are
ingested ``concurrency`` at a time (enough to fill model batches); whatever is finished when
the previous acknowledgement has gone out is refreshed once and acknowledged together, so a
slow engine refresh batches more documents instead of slowing each one down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from service.engines.base import Engine, EngineError
from service.ingest.documents import DocumentInput
from service.ingest.ingestor import IngestOutcome, Ingestor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DocumentAck:
    sequence: int
    source_id: str
    version: str
    outcome: IngestOutcome


@dataclass(frozen=True)
class Incoming:
    """One document as read from the caller's stream: converted lazily (a conversion error
    is that document's failure, not the stream's)."""

    sequence: int
    source_id: str
    version: str
    convert: Callable[[], DocumentInput]


_END = object()


async def acknowledged_ingest(
    ingestor: Ingestor, engine: Engine, documents: AsyncIterator[Incoming], *,
    max_in_flight: int = 64, concurrency: int = 8,
) -> AsyncIterator[list[DocumentAck]]:
    """Yield batches of acks until every document read from ``documents`` is acknowledged.
    An error reading the stream is raised after the documents already read are acknowledged."""
    window = asyncio.Semaphore(max_in_flight)
    gate = asyncio.Semaphore(concurrency)
    done: asyncio.Queue[DocumentAck | object] = asyncio.Queue()
    tasks: set[asyncio.Task[None]] = set()
    read_error: list[BaseException] = []

    async def one(item: Incoming) -> None:
        async with gate:
            try:
                outcome = await ingestor.ingest(item.convert())
            except Exception as exc:  # engine/model failure: this document's, not the stream's
                log.warning("ingest of %s@%s failed: %s", item.source_id, item.version, exc)
                outcome = IngestOutcome("failed", message=f"{type(exc).__name__}: {exc}")
        await done.put(DocumentAck(item.sequence, item.source_id, item.version, outcome))

    async def reader() -> None:
        stream = documents.__aiter__()
        try:
            while True:
                await window.acquire()  # before reading: never hold more than the window
                try:
                    item = await stream.__anext__()
                except StopAsyncIteration:
                    window.release()
                    break
                task = asyncio.ensure_future(one(item))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except Exception as exc:  # the caller's stream broke: ack what was read, then raise
            read_error.append(exc)
        while tasks:
            await asyncio.gather(*list(tasks), return_exceptions=True)
        await done.put(_END)

    reading = asyncio.ensure_future(reader())
    try:
        ended = False
        while not ended:
            batch: list[DocumentAck] = []
            first = await done.get()
            for item in (first, *_drain(done)):
                if item is _END:
                    ended = True
                else:
                    assert isinstance(item, DocumentAck)
                    batch.append(item)
            if not batch:
                continue
            if any(a.outcome.status == "indexed" for a in batch):
                try:
                    await engine.refresh()
                except EngineError as exc:  # written and durable; visibility follows the engine's own refresh
                    log.warning("refresh before acknowledging %d documents failed: %s", len(batch), exc)
            yield batch
            for _ in batch:
                window.release()
        if read_error:
            raise read_error[0]
    finally:
        reading.cancel()
        for task in list(tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reading


def _drain(queue: asyncio.Queue[DocumentAck | object]) -> list[DocumentAck | object]:
    items: list[DocumentAck | object] = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
