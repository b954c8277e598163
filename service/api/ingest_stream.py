"""IngestStream transport: requests -> ``Incoming`` documents, ack batches -> responses."""

from __future__ import annotations

from collections.abc import AsyncIterator

from service._gen.retrieval.v1 import corpus_pb2
from service.api import convert
from service.app import App
from service.ingest.acknowledged import Incoming, acknowledged_ingest

_STATUS = {
    "indexed": corpus_pb2.DOCUMENT_STATUS_INDEXED,
    "unchanged": corpus_pb2.DOCUMENT_STATUS_UNCHANGED,
    "invalid": corpus_pb2.DOCUMENT_STATUS_INVALID,
    "failed": corpus_pb2.DOCUMENT_STATUS_FAILED,
}
# Documents ingested concurrently per stream: enough to fill model batches.
_CONCURRENCY = 8


async def _incoming(requests: AsyncIterator[corpus_pb2.IngestStreamRequest]) -> AsyncIterator[Incoming]:
    position = 0
    async for request in requests:
        doc = request.document
        yield Incoming(request.sequence or position, doc.source_id, doc.version,
                       lambda doc=doc: convert.document_from_pb(doc))  # type: ignore[misc]
        position += 1


async def ingest_stream(
    app: App, requests: AsyncIterator[corpus_pb2.IngestStreamRequest]
) -> AsyncIterator[corpus_pb2.IngestStreamResponse]:
    bound = app.cfg.ingest_max_in_flight
    total = 0
    async for batch in acknowledged_ingest(app.ingestor, app.engine, _incoming(requests),
                                           max_in_flight=bound, concurrency=min(_CONCURRENCY, bound)):
        total += len(batch)
        yield corpus_pb2.IngestStreamResponse(
            acks=[corpus_pb2.DocumentAck(sequence=a.sequence, source_id=a.source_id, version=a.version,
                                         status=_STATUS.get(a.outcome.status, corpus_pb2.DOCUMENT_STATUS_FAILED),
                                         chunks=a.outcome.chunks, field=a.outcome.field, message=a.outcome.message)
                  for a in batch],
            acknowledged_total=total, max_in_flight=bound)
