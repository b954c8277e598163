"""Acknowledged ingest without a transport: every document acknowledged exactly once, after
the engine refresh; never more than max_in_flight read but unacknowledged; a broken input
stream still acknowledges what was read before the error is raised."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from service.ingest.acknowledged import DocumentAck, Incoming, acknowledged_ingest
from service.ingest.documents import DocumentInput
from service.ingest.ingestor import IngestOutcome


class SlowIngestor:
    def __init__(self) -> None:
        self.committed: list[str] = []

    async def ingest(self, doc: DocumentInput) -> IngestOutcome:
        await asyncio.sleep(0.002)
        if not doc.text:
            return IngestOutcome("invalid", field="document.text", message="empty")
        self.committed.append(doc.source_id)
        return IngestOutcome("indexed", 1)


class Engine:
    def __init__(self, ingestor: SlowIngestor) -> None:
        self.ingestor = ingestor
        self.visible: set[str] = set()

    async def refresh(self) -> None:
        self.visible = set(self.ingestor.committed)


def _doc(i: int) -> DocumentInput:
    return DocumentInput(source_id=f"d{i}", version="v1", title="", text="" if i == 7 else f"text {i}",
                         collection="doc", status="approved", acl=(), breadcrumb="", metadata={})


async def test_every_document_is_acknowledged_once_after_refresh_within_the_window() -> None:
    ingestor = SlowIngestor()
    engine = Engine(ingestor)
    pulled = 0
    acked = 0
    peak = 0

    async def documents() -> AsyncIterator[Incoming]:
        nonlocal pulled, peak
        for i in range(100):
            pulled += 1
            peak = max(peak, pulled - acked)
            yield Incoming(i, f"d{i}", "v1", lambda i=i: _doc(i))  # type: ignore[misc]

    acks: list[DocumentAck] = []
    async for batch in acknowledged_ingest(ingestor, engine, documents(), max_in_flight=5, concurrency=3):  # type: ignore[arg-type]
        for ack in batch:
            if ack.outcome.status == "indexed":
                assert ack.source_id in engine.visible, "acknowledged before it was visible"
        acks.extend(batch)
        acked += len(batch)
    assert sorted(a.sequence for a in acks) == list(range(100))
    assert peak <= 5, peak
    bad = [a for a in acks if a.outcome.status == "invalid"]
    assert [(a.sequence, a.outcome.field) for a in bad] == [(7, "document.text")]


async def test_a_broken_stream_acknowledges_what_was_read_then_raises() -> None:
    ingestor = SlowIngestor()

    async def documents() -> AsyncIterator[Incoming]:
        for i in range(3):
            yield Incoming(i, f"d{i}", "v1", lambda i=i: _doc(i))  # type: ignore[misc]
        raise ConnectionResetError("peer went away")

    acks: list[DocumentAck] = []
    with pytest.raises(ConnectionResetError):
        async for batch in acknowledged_ingest(ingestor, Engine(ingestor), documents()):  # type: ignore[arg-type]
            acks.extend(batch)
    assert sorted(a.sequence for a in acks) == [0, 1, 2]


async def test_conversion_failure_is_that_documents_failure() -> None:
    ingestor = SlowIngestor()

    def broken() -> DocumentInput:
        raise ValueError("cannot convert")

    async def documents() -> AsyncIterator[Incoming]:
        yield Incoming(1, "x", "v1", broken)
        yield Incoming(2, "d2", "v1", lambda: _doc(2))

    acks = [a async for batch in acknowledged_ingest(ingestor, Engine(ingestor), documents()) for a in batch]  # type: ignore[arg-type]
    assert {a.sequence: a.outcome.status for a in acks} == {1: "failed", 2: "indexed"}
