"""gRPC servicers: transport only. They authenticate, convert, admit, call the pipeline
and map domain errors through the one status table."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc
from service._gen.retrieval.v1 import plan_pb2
from service.api import convert, plan_convert
from service.api.admission import Admission
from service.api.auth import Authenticator
from service.api.errors import LOOKUP_OUTCOME_ERRORS, abort_with
from service.api.ingest_stream import ingest_stream
from service.app import App
from service.engines.base import EngineError
from service.errors import BackendFailure, DomainError, InvalidArgument, NotFound
from service.ingest.ingestor import IngestOutcome
from service.pipeline.attempt import AttemptResultOut, EvidenceEvent, EvidenceOut, LegEvent, ResultEvent
from service.pipeline.plan_execution import resolve_plan
from service.pipeline.request import AttemptRequest, Principal, validate
from service.planning.planner import IntentInput, build_plan

log = logging.getLogger(__name__)
Context = grpc.aio.ServicerContext[Any, Any]


def _deadline(context: Context, default_s: float) -> float:
    remaining = context.time_remaining()
    budget = default_s if remaining is None else min(remaining, 3600.0)
    return time.monotonic() + budget


def _trailers(result: AttemptResultOut, admission_wait_s: float) -> tuple[tuple[str, str], ...]:
    t = result.timing
    return (
        ("x-attempt-id", result.attempt_id),
        ("x-timing-admission-ms", f"{admission_wait_s * 1000:.3f}"),
        ("x-timing-queue-ms", f"{t.queue_ms:.3f}"),
        ("x-timing-tokenize-ms", f"{t.tokenize_ms:.3f}"),
        ("x-timing-inference-ms", f"{t.inference_ms:.3f}"),
        ("x-timing-total-ms", f"{result.total_ms:.3f}"),
    )


class RetrievalServicer(retrieval_pb2_grpc.RetrievalServiceServicer):
    def __init__(self, app: App, auth: Authenticator, admission: Admission) -> None:
        self.app = app
        self.auth = auth
        self.admission = admission

    def _prepare(self, request: retrieval_pb2.RetrieveRequest, context: Context) -> tuple[AttemptRequest, Principal]:
        principal = self.auth.authenticate(context)
        req, conversion_errors = convert.request_from_pb(request)
        validate(req, self.app.cfg, self.app.runtime.reranker is not None, conversion_errors,
                 self.app.runner.rerank.unavailable)
        req = resolve_plan(req, self.app.plan_rules, self.app.cfg)
        self.admission.admit(principal)
        searches = self.auth.quotas.search_ceiling(principal.name, req.budget_max_searches,
                                                   self.app.cfg.default_max_searches)
        if searches != req.budget_max_searches:  # the principal's ceiling on a run's budget
            req = dataclasses.replace(req, budget_max_searches=searches)
        return req, principal

    async def Retrieve(  # noqa: N802 (gRPC method name)
        self, request: retrieval_pb2.RetrieveRequest, context: Context
    ) -> AsyncIterator[retrieval_pb2.RetrieveEvent]:
        deadline = _deadline(context, self.app.cfg.default_deadline_s)
        try:
            req, principal = self._prepare(request, context)
            waited_s = await self.admission.take_turn(deadline)
        except DomainError as exc:
            await abort_with(context, exc)
            return
        with self.admission.attempt(principal, turn=True):
            async for event in self.app.runner.run(req, principal, deadline):
                if isinstance(event, LegEvent):
                    yield retrieval_pb2.RetrieveEvent(leg=convert.leg_to_pb(event.report))
                elif isinstance(event, EvidenceEvent):
                    yield retrieval_pb2.RetrieveEvent(evidence=convert.evidence_to_pb(event.evidence))
                else:
                    context.set_trailing_metadata(_trailers(event.result, waited_s))
                    yield retrieval_pb2.RetrieveEvent(result=convert.result_to_pb(event.result))

    async def Lookup(  # noqa: N802
        self, request: retrieval_pb2.RetrieveRequest, context: Context
    ) -> retrieval_pb2.LookupResult:
        deadline = _deadline(context, self.app.cfg.default_deadline_s)
        try:
            req, principal = self._prepare(request, context)
            waited_s = await self.admission.take_turn(deadline)
        except DomainError as exc:
            await abort_with(context, exc)
            raise AssertionError("unreachable")  # abort raises
        evidence: list[EvidenceOut] = []
        result: AttemptResultOut | None = None
        with self.admission.attempt(principal, turn=True):
            async for event in self.app.runner.run(req, principal, deadline):
                if isinstance(event, EvidenceEvent):
                    evidence.append(event.evidence)
                elif isinstance(event, ResultEvent):
                    result = event.result
        assert result is not None
        trailers = _trailers(result, waited_s)
        error = LOOKUP_OUTCOME_ERRORS.get(result.outcome)
        if error is not None:
            message = f"attempt {result.attempt_id}: {result.outcome.value} ({result.stopping_reason})"
            await abort_with(context, error(message), trailers)
        context.set_trailing_metadata(trailers)
        return convert.lookup_to_pb(req.query, req.tool_call_id, result, evidence)

    async def GetAttempt(  # noqa: N802
        self, request: retrieval_pb2.GetAttemptRequest, context: Context
    ) -> retrieval_pb2.GetAttemptResponse:
        try:
            principal = self.auth.authenticate(context)
            if not request.attempt_id:
                raise InvalidArgument.one("attempt_id", "must not be empty")
            record = await self.app.ledger_ops.get_attempt(request.attempt_id)
            # Another principal's attempt (its query, the evidence it saw) answers like an unknown id.
            if record is None or not principal.owns(record.principal):
                raise NotFound(f"no attempt {request.attempt_id!r}")
        except DomainError as exc:
            await abort_with(context, exc)
            raise AssertionError("unreachable")
        return retrieval_pb2.GetAttemptResponse(attempt=convert.record_to_pb(record))

    async def BuildPlan(  # noqa: N802
        self, request: plan_pb2.BuildPlanRequest, context: Context
    ) -> plan_pb2.BuildPlanResponse:
        try:
            self.auth.authenticate(context)
            intent, bad = (plan_convert.intent_from_pb(request.intent) if request.HasField("intent")
                           else (IntentInput(), []))
            probe = AttemptRequest(query=request.query, top_k=1)
            validate(probe, self.app.cfg, True, bad)
            built = build_plan(request.query, list(request.history), intent, self.app.plan_rules)
        except DomainError as exc:
            await abort_with(context, exc)
            raise AssertionError("unreachable")
        return plan_convert.built_plan_to_pb(built)


def parse_evidence_id(evidence_id: str) -> tuple[str, int, str]:
    """``source#chunk@version`` -> parts; raises InvalidArgument."""
    try:
        head, version = evidence_id.rsplit("@", 1)
        source, chunk = head.rsplit("#", 1)
        index = int(chunk)
    except ValueError:
        raise InvalidArgument.one("evidence_id", "expected source#chunk@version, e.g. E31#0@v3")
    if not source or not version or index < 0:
        raise InvalidArgument.one("evidence_id", "expected source#chunk@version, e.g. E31#0@v3")
    return source, index, version


class CorpusServicer(corpus_pb2_grpc.CorpusServiceServicer):
    # Documents embedded concurrently: enough to fill model batches, bounded for memory.
    CONCURRENCY = 8

    def __init__(self, app: App, auth: Authenticator, admission: Admission) -> None:
        self.app = app
        self.auth = auth
        self.admission = admission

    async def Ingest(  # noqa: N802
        self, request_iterator: AsyncIterator[corpus_pb2.IngestRequest], context: Context
    ) -> corpus_pb2.IngestSummary:
        try:
            principal = self.auth.authenticate(context)
            self.admission.admit_stream(principal)
        except DomainError as exc:
            await abort_with(context, exc)
            raise AssertionError("unreachable")
        with self.admission.stream(principal):
            return await self._ingest(request_iterator, context)

    async def IngestStream(  # noqa: N802
        self, request_iterator: AsyncIterator[corpus_pb2.IngestStreamRequest], context: Context
    ) -> AsyncIterator[corpus_pb2.IngestStreamResponse]:
        try:
            principal = self.auth.authenticate(context)
            self.admission.admit_stream(principal)
        except DomainError as exc:
            await abort_with(context, exc)
            return
        with self.admission.stream(principal):
            async for response in ingest_stream(self.app, request_iterator):
                yield response

    async def _ingest(
        self, request_iterator: AsyncIterator[corpus_pb2.IngestRequest], context: Context
    ) -> corpus_pb2.IngestSummary:
        started = time.monotonic()
        gate = asyncio.Semaphore(self.CONCURRENCY)
        tasks: list[asyncio.Task[IngestOutcome]] = []
        docs: list[corpus_pb2.Document] = []

        async def one(doc: corpus_pb2.Document) -> IngestOutcome:
            async with gate:
                try:
                    return await self.app.ingestor.ingest(convert.document_from_pb(doc))
                except Exception as exc:  # engine/model failure: reported per document
                    log.warning("ingest of %s@%s failed: %s", doc.source_id, doc.version, exc)
                    return IngestOutcome("failed", message=f"{type(exc).__name__}: {exc}")

        try:
            async for item in request_iterator:
                docs.append(item.document)
                await gate.acquire()  # back-pressure on the client stream
                gate.release()
                tasks.append(asyncio.ensure_future(one(item.document)))
            outcomes = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        if not docs:
            await abort_with(context, InvalidArgument.one("document", "the stream carried no documents"))
        summary = corpus_pb2.IngestSummary(documents_received=len(docs))
        for i, (doc, out) in enumerate(zip(docs, outcomes)):
            self.app.metrics.ingested(out.status, out.chunks if out.status == "indexed" else 0)
            if out.status == "indexed":
                summary.documents_indexed += 1
                summary.chunks_indexed += out.chunks
            elif out.status == "unchanged":
                summary.documents_unchanged += 1
            else:
                summary.errors.append(corpus_pb2.DocumentError(
                    index=i, source_id=doc.source_id, version=doc.version, field=out.field, message=out.message))
        try:
            await self.app.engine.refresh()
        except EngineError as exc:  # writes were acknowledged; visibility follows the engine's own refresh
            log.warning("refresh after ingest failed: %s", exc)
        elapsed = time.monotonic() - started
        summary.elapsed_ms = elapsed * 1000
        summary.chunks_per_second = summary.chunks_indexed / elapsed if elapsed > 0 else 0.0
        return summary

    async def DeleteDocument(  # noqa: N802
        self, request: corpus_pb2.DeleteDocumentRequest, context: Context
    ) -> corpus_pb2.DeleteDocumentResponse:
        try:
            self.auth.authenticate(context)
            if not request.source_id:
                raise InvalidArgument.one("source_id", "must not be empty")
            try:
                deleted = await self.app.engine.delete_document(request.source_id, request.version or None)
                if deleted:
                    await self.app.engine.refresh()
            except EngineError as exc:
                raise BackendFailure(f"engine {self.app.engine.name}: {exc}")
            if deleted == 0:
                raise NotFound(f"no chunks for {request.source_id}@{request.version or '*'}")
        except DomainError as exc:
            await abort_with(context, exc)
            raise AssertionError("unreachable")
        return corpus_pb2.DeleteDocumentResponse(chunks_deleted=deleted)

    async def GetEvidence(  # noqa: N802
        self, request: corpus_pb2.GetEvidenceRequest, context: Context
    ) -> corpus_pb2.GetEvidenceResponse:
        try:
            principal = self.auth.authenticate(context)
            source, _, _ = parse_evidence_id(request.evidence_id)
            try:
                found = await self.app.engine.get_chunks([request.evidence_id])
                versions = await self.app.engine.versions(source)
                # Only versions this caller may see: a hidden source answers like an unknown one.
                heads = await self.app.engine.get_chunks([f"{source}#0@{v}" for v in versions])
            except EngineError as exc:
                raise BackendFailure(f"engine {self.app.engine.name}: {exc}")
        except DomainError as exc:
            await abort_with(context, exc)
            raise AssertionError("unreachable")

        visible = [c for c in found if principal.may_read(c.acl)]
        seen_versions = {c.version for c in heads if principal.may_read(c.acl)}
        versions = [v for v in versions if v in seen_versions]
        if visible:
            chunk = visible[0]
            return corpus_pb2.GetEvidenceResponse(
                fidelity=corpus_pb2.FIDELITY_EXACT, evidence=convert.chunk_to_pb(chunk),
                status=convert.status_to_pb(chunk.status), available_versions=versions)
        return corpus_pb2.GetEvidenceResponse(fidelity=corpus_pb2.FIDELITY_DEGRADED, available_versions=versions)
