"""One IngestStream from a test's side: every document with its sequence number (1-based),
the acks collected by sequence, and the stream's error when it broke."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc

Acks = dict[int, corpus_pb2.DocumentAck]


async def stream_documents(target: str, docs: Sequence[corpus_pb2.Document], *, timeout: float = 180,
                           on_response: Callable[[Acks], Awaitable[None]] | None = None,
                           ) -> tuple[Acks, grpc.aio.AioRpcError | None]:
    """``on_response(acks)`` runs after each response (a fault a test injects mid-stream)."""
    acks: Acks = {}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = corpus_pb2_grpc.CorpusServiceStub(channel)

        async def requests() -> AsyncIterator[corpus_pb2.IngestStreamRequest]:
            for i, d in enumerate(docs):
                yield corpus_pb2.IngestStreamRequest(document=d, sequence=i + 1)

        try:
            async for response in stub.IngestStream(requests(), timeout=timeout):
                for ack in response.acks:
                    assert ack.sequence not in acks, "acknowledged twice"
                    acks[ack.sequence] = ack
                if on_response is not None:
                    await on_response(acks)
        except grpc.aio.AioRpcError as err:
            return acks, err
    return acks, None
