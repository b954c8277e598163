"""Async and sync clients for retrieval.v1.

    async with RetrievalClient("127.0.0.1:50051") as client:
        attempt = await client.retrieve("how do I reset my password", top_k=3)
        if attempt.found: ...
        elif attempt.outcome.is_infrastructure_failure: ...  # never read as "no evidence"

Infrastructure outcomes come back in-band on ``retrieve`` (Attempt.outcome) and as typed
errors on ``lookup`` (BackendTimeoutError, UnavailableError, ...), exactly as the service
documents them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

import grpc

from retrieval_client.tls import TlsOptions, aio_channel, sync_channel
from retrieval_client._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc, types_pb2
from retrieval_client.errors import from_rpc_error
from retrieval_client.types import Attempt, Evidence, document_to_pb, lookup_to_json

Metadata = tuple[tuple[str, str], ...]

_LEGS: dict[str, int] = {"bm25": types_pb2.LEG_KIND_BM25, "knn": types_pb2.LEG_KIND_KNN,
                         "knn_latin": types_pb2.LEG_KIND_KNN_LATIN}
_COLLECTIONS: dict[str, int] = {"doc": types_pb2.COLLECTION_DOC, "faq": types_pb2.COLLECTION_FAQ}


def build_request(
    query: str, top_k: int = 10, *, run_id: str = "", collections: Sequence[str] = (),
    source_ids: Sequence[str] = (), metadata: dict[str, str] | None = None, legs: Sequence[str] = (),
    rerank: bool | None = None, min_quality: float = 0.0, max_context_chars: int = 0,
    tool_call_id: str = "", version_pins: dict[str, str] | None = None,
    gap: retrieval_pb2.EvidenceGap | None = None, budget: retrieval_pb2.RunBudget | None = None,
    max_searches: int = 0, max_results_per_search: int = 0,
) -> retrieval_pb2.RetrieveRequest:
    req = retrieval_pb2.RetrieveRequest(query=query, top_k=top_k, run_id=run_id, tool_call_id=tool_call_id,
                                        version_pins=version_pins or {})
    if max_searches or max_results_per_search:  # the run's budget, used when the run is created
        req.budget.max_searches = max_searches
        req.budget.max_results_per_search = max_results_per_search
    # Unknown names become 0 (UNSPECIFIED), which the server rejects naming the field.
    req.filters.collections.extend(_COLLECTIONS.get(c, 0) for c in collections)  # type: ignore[misc]
    req.filters.source_ids.extend(source_ids)
    req.filters.metadata.update(metadata or {})
    req.options.legs.extend(_LEGS.get(leg, 0) for leg in legs)  # type: ignore[misc]
    if rerank is not None:
        req.options.rerank = types_pb2.RERANK_MODE_ON if rerank else types_pb2.RERANK_MODE_OFF
    req.options.min_quality = min_quality
    req.options.max_context_chars = max_context_chars
    if gap is not None:
        req.gap.CopyFrom(gap)
    if budget is not None:
        req.budget.CopyFrom(budget)
    return req


class RetrievalClient:
    """Asynchronous client (grpc.aio). One channel per client; reuse it."""

    def __init__(self, target: str, *, api_key: str = "", timeout: float = 10.0,
                 channel: grpc.aio.Channel | None = None, tls: TlsOptions | None = None) -> None:
        self._channel = channel or aio_channel(target, tls)
        self._owns_channel = channel is None
        self._metadata: Metadata = (("x-api-key", api_key),) if api_key else ()
        self.timeout = timeout
        self._retrieval = retrieval_pb2_grpc.RetrievalServiceStub(self._channel)
        self._corpus = corpus_pb2_grpc.CorpusServiceStub(self._channel)

    async def __aenter__(self) -> RetrievalClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_channel:
            await self._channel.close()

    async def events(self, query: str, top_k: int = 10, **options: Any) -> AsyncIterator[retrieval_pb2.RetrieveEvent]:
        """The raw event stream (leg reports, evidence, the result)."""
        try:
            async for event in self._retrieval.Retrieve(build_request(query, top_k, **options),
                                                        timeout=self.timeout, metadata=self._metadata):
                yield event
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None

    async def retrieve(self, query: str, top_k: int = 10, **options: Any) -> Attempt:
        evidence: list[Evidence] = []
        async for event in self.events(query, top_k, **options):
            if event.HasField("evidence"):
                evidence.append(Evidence.from_pb(event.evidence))
            elif event.HasField("result"):
                return Attempt.from_pb(event.result, evidence)
        raise RuntimeError("stream ended without an AttemptResult")

    async def lookup(self, query: str, top_k: int = 10, **options: Any) -> dict[str, Any]:
        """The agent projection as a JSON-ready dict (see types.lookup_to_json)."""
        try:
            res = await self._retrieval.Lookup(build_request(query, top_k, **options),
                                               timeout=self.timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        return lookup_to_json(res)

    async def ingest(self, documents: Iterable[dict[str, Any]]) -> corpus_pb2.IngestSummary:
        async def stream() -> AsyncIterator[corpus_pb2.IngestRequest]:
            for doc in documents:
                yield corpus_pb2.IngestRequest(document=document_to_pb(doc))

        try:
            summary: corpus_pb2.IngestSummary = await self._corpus.Ingest(stream(), metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        return summary

    async def get_attempt(self, attempt_id: str) -> retrieval_pb2.AttemptRecord:
        try:
            res = await self._retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=attempt_id),
                                                   timeout=self.timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        return res.attempt

    async def get_evidence(self, evidence_id: str) -> corpus_pb2.GetEvidenceResponse:
        try:
            res: corpus_pb2.GetEvidenceResponse = await self._corpus.GetEvidence(
                corpus_pb2.GetEvidenceRequest(evidence_id=evidence_id), timeout=self.timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        return res


class SyncRetrievalClient:
    """Blocking client for scripts and non-async services."""

    def __init__(self, target: str, *, api_key: str = "", timeout: float = 10.0,
                 tls: TlsOptions | None = None) -> None:
        self._channel = sync_channel(target, tls)
        self._metadata: Metadata = (("x-api-key", api_key),) if api_key else ()
        self.timeout = timeout
        self._retrieval = retrieval_pb2_grpc.RetrievalServiceStub(self._channel)
        self._corpus = corpus_pb2_grpc.CorpusServiceStub(self._channel)

    def __enter__(self) -> SyncRetrievalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def events(self, query: str, top_k: int = 10, **options: Any) -> Iterator[retrieval_pb2.RetrieveEvent]:
        try:
            yield from self._retrieval.Retrieve(build_request(query, top_k, **options),
                                                timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def retrieve(self, query: str, top_k: int = 10, **options: Any) -> Attempt:
        evidence: list[Evidence] = []
        for event in self.events(query, top_k, **options):
            if event.HasField("evidence"):
                evidence.append(Evidence.from_pb(event.evidence))
            elif event.HasField("result"):
                return Attempt.from_pb(event.result, evidence)
        raise RuntimeError("stream ended without an AttemptResult")

    def lookup(self, query: str, top_k: int = 10, **options: Any) -> dict[str, Any]:
        try:
            res = self._retrieval.Lookup(build_request(query, top_k, **options),
                                         timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return lookup_to_json(res)

    def ingest(self, documents: Iterable[dict[str, Any]]) -> corpus_pb2.IngestSummary:
        requests = (corpus_pb2.IngestRequest(document=document_to_pb(d)) for d in documents)
        try:
            summary: corpus_pb2.IngestSummary = self._corpus.Ingest(requests, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return summary
