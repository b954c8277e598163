"""Proto <-> domain conversion. The only place that knows both vocabularies."""

from __future__ import annotations

from service._gen.retrieval.v1 import corpus_pb2, retrieval_pb2, types_pb2
from service.api.plan_convert import intent_from_pb, plan_from_pb, plan_to_pb
from service.domain import (
    AttemptRecord,
    GapKind,
    LegKind,
    LegReport,
    LegTiming,
    Outcome,
    QualitySource,
    RelevanceLevel,
)
from service.engines.base import ChunkRecord
from service.errors import FieldViolation
from service.ingest.documents import DocumentInput
from service.pipeline.attempt import AttemptResultOut, EvidenceOut
from service.pipeline.request import AttemptRequest, Gap

_COLLECTION_IN = {types_pb2.COLLECTION_DOC: "doc", types_pb2.COLLECTION_FAQ: "faq"}
_COLLECTION_OUT = {v: k for k, v in _COLLECTION_IN.items()}
_STATUS_IN = {
    types_pb2.SOURCE_STATUS_UNSPECIFIED: "approved",
    types_pb2.SOURCE_STATUS_APPROVED: "approved",
    types_pb2.SOURCE_STATUS_DRAFT: "draft",
    types_pb2.SOURCE_STATUS_RETIRED: "retired",
}
_STATUS_OUT = {"approved": types_pb2.SOURCE_STATUS_APPROVED, "draft": types_pb2.SOURCE_STATUS_DRAFT,
               "retired": types_pb2.SOURCE_STATUS_RETIRED}
_LEG_IN = {types_pb2.LEG_KIND_BM25: LegKind.BM25, types_pb2.LEG_KIND_KNN: LegKind.KNN,
           types_pb2.LEG_KIND_RERANK: LegKind.RERANK, types_pb2.LEG_KIND_KNN_LATIN: LegKind.KNN_LATIN}


def outcome_to_pb(o: Outcome) -> types_pb2.AttemptOutcome.ValueType:
    return types_pb2.AttemptOutcome.Value(f"ATTEMPT_OUTCOME_{o.value}")


def outcome_from_pb(v: int) -> Outcome:
    return Outcome(types_pb2.AttemptOutcome.Name(v).removeprefix("ATTEMPT_OUTCOME_"))  # type: ignore[arg-type]


def relevance_to_pb(r: RelevanceLevel) -> types_pb2.RelevanceLevel.ValueType:
    if r is RelevanceLevel.NONE:
        return types_pb2.RELEVANCE_LEVEL_UNSPECIFIED
    return types_pb2.RelevanceLevel.Value(f"RELEVANCE_LEVEL_{r.value}")


def request_from_pb(m: retrieval_pb2.RetrieveRequest) -> tuple[AttemptRequest, list[FieldViolation]]:
    """Convert; unknown enum values are dropped and returned as violations so validation
    can report them together with every other bad field."""
    bad: list[FieldViolation] = []
    collections = []
    for i, c in enumerate(m.filters.collections):
        if c in _COLLECTION_IN:
            collections.append(_COLLECTION_IN[c])
        else:
            bad.append(FieldViolation(f"filters.collections[{i}]", f"unknown collection {c}"))
    legs = []
    for i, leg in enumerate(m.options.legs):
        if leg in _LEG_IN:
            legs.append(_LEG_IN[leg])
        else:
            bad.append(FieldViolation(f"options.legs[{i}]", f"unknown leg kind {leg}"))
    rerank = {types_pb2.RERANK_MODE_ON: True, types_pb2.RERANK_MODE_OFF: False}.get(m.options.rerank)
    gap = None
    if m.HasField("gap"):
        g = m.gap
        kind = {types_pb2.GAP_KIND_USER_INFORMATION: GapKind.USER_INFORMATION,
                types_pb2.GAP_KIND_EXTERNAL_KNOWLEDGE: GapKind.EXTERNAL_KNOWLEDGE}.get(g.kind, GapKind.UNSPECIFIED)
        gap = Gap(g.gap_id, kind, g.question, g.rationale, g.criticality, g.targeted_query)
    intent = None
    if m.HasField("intent"):
        intent, intent_errors = intent_from_pb(m.intent)
        bad.extend(intent_errors)
    return AttemptRequest(
        query=m.query, top_k=m.top_k, run_id=m.run_id, collections=tuple(collections),
        source_ids=tuple(m.filters.source_ids), metadata=dict(m.filters.metadata),
        legs=tuple(legs), rerank=rerank, min_quality=m.options.min_quality,
        max_context_chars=m.options.max_context_chars, gap=gap, tool_call_id=m.tool_call_id,
        budget_max_searches=m.budget.max_searches, budget_max_results=m.budget.max_results_per_search,
        version_pins=dict(m.version_pins), require_gap=m.budget.require_gap,
        plan=plan_from_pb(m.plan) if m.HasField("plan") else None, intent=intent,
        history=tuple(m.history), query_variants=tuple(m.query_variants),
    ), bad


def timing_to_pb(t: LegTiming | None, total_ms: float = 0.0) -> types_pb2.Timing:
    t = t or LegTiming()
    return types_pb2.Timing(queue_ms=t.queue_ms, tokenize_ms=t.tokenize_ms,
                            inference_ms=t.inference_ms, total_ms=total_ms)


def leg_to_pb(r: LegReport) -> retrieval_pb2.LegReport:
    msg = retrieval_pb2.LegReport(
        kind=types_pb2.LegKind.Value(f"LEG_KIND_{r.kind.value}"),
        status=types_pb2.LegStatus.Value(f"LEG_STATUS_{r.status.value}"),
        latency_ms=r.latency_ms, hit_count=r.hit_count, detail=r.detail,
    )
    if r.timing is not None:
        msg.timing.CopyFrom(timing_to_pb(r.timing))
    return msg


def chunk_to_pb(chunk: ChunkRecord, excerpt: str | None = None, context: str | None = None) -> retrieval_pb2.EvidenceItem:
    parent = chunk.parent_text if chunk.parent_text != chunk.text else ""
    return retrieval_pb2.EvidenceItem(
        evidence_id=chunk.chunk_id, source_id=chunk.source_id, version=chunk.version,
        title=chunk.title, breadcrumb=chunk.breadcrumb,
        excerpt=chunk.text if excerpt is None else excerpt,
        context=parent if context is None else context,
        collection=_COLLECTION_OUT.get(chunk.collection, types_pb2.COLLECTION_UNSPECIFIED),
        chunk_index=chunk.chunk_index, metadata=dict(chunk.metadata),
    )


def evidence_to_pb(e: EvidenceOut) -> retrieval_pb2.EvidenceItem:
    c = e.candidate
    msg = chunk_to_pb(c.chunk, e.excerpt, e.context)
    msg.rank = e.rank
    msg.attempt_id = e.attempt_id
    msg.acquired_for_gap_id = e.gap_id
    msg.fused_score = c.fused_score
    msg.quality = c.quality
    if c.bm25_score is not None:
        msg.bm25_score = c.bm25_score
    if c.dense_score is not None:
        msg.dense_score = c.dense_score
    if c.latin_dense_score is not None:
        msg.latin_dense_score = c.latin_dense_score
    if c.rerank_score is not None:
        msg.rerank_score = c.rerank_score
    return msg


def result_to_pb(r: AttemptResultOut) -> retrieval_pb2.AttemptResult:
    msg = retrieval_pb2.AttemptResult(
        attempt_id=r.attempt_id, outcome=outcome_to_pb(r.outcome),
        evidence_status=(types_pb2.EVIDENCE_STATUS_EVIDENCE_FOUND if r.evidence_found
                         else types_pb2.EVIDENCE_STATUS_NO_EVIDENCE),
        relevance_level=relevance_to_pb(r.relevance_level), returned_count=r.returned_count,
        truncated=r.truncated, degraded=r.degraded, legs=[leg_to_pb(x) for x in r.legs],
        stopping_reason=r.stopping_reason, retrieved_count=r.retrieved_count,
        admissible_count=r.admissible_count,
        quality_source=(types_pb2.QUALITY_SOURCE_UNSPECIFIED if r.quality_source is QualitySource.NONE
                        else types_pb2.QualitySource.Value(f"QUALITY_SOURCE_{r.quality_source.value}")),
        top_quality=r.top_quality, retried_unfiltered=r.retried_unfiltered,
        timing=timing_to_pb(r.timing, r.total_ms), model_ids=r.model_ids, engine=r.engine,
        faq_direct=r.faq_direct, faq_direct_evidence_id=r.faq_direct_evidence_id, query_variants=r.query_variants,
    )
    if r.plan is not None:
        msg.plan.CopyFrom(plan_to_pb(r.plan))
    if r.budget_before is not None:
        msg.budget_before = r.budget_before
    if r.budget_after is not None:
        msg.budget_after = r.budget_after
    return msg


def lookup_to_pb(query: str, tool_call_id: str, r: AttemptResultOut, evidence: list[EvidenceOut]) -> retrieval_pb2.LookupResult:
    msg = retrieval_pb2.LookupResult(
        evidence_status=(types_pb2.EVIDENCE_STATUS_EVIDENCE_FOUND if r.evidence_found
                         else types_pb2.EVIDENCE_STATUS_NO_EVIDENCE),
        tool_call_id=tool_call_id, query=query,
        evidence=[retrieval_pb2.LookupEvidence(
            document_id=e.candidate.chunk.chunk_id, source=e.candidate.chunk.source_id,
            title=e.candidate.chunk.title, breadcrumb=e.candidate.chunk.breadcrumb, excerpt=e.excerpt)
            for e in evidence],
        returned_count=len(evidence), truncated=r.truncated, faq_direct=r.faq_direct,
    )
    if r.relevance_level is not RelevanceLevel.NONE:
        msg.relevance_level = relevance_to_pb(r.relevance_level)
    return msg


def record_to_pb(a: AttemptRecord) -> retrieval_pb2.AttemptRecord:
    msg = retrieval_pb2.AttemptRecord(
        attempt_id=a.attempt_id, run_id=a.run_id, gap_id=a.gap_id, channel=a.channel,
        query=a.query, requested_top_k=a.requested_top_k, evidence_ids=a.evidence_ids,
        retrieved_count=a.retrieved_count, admissible_count=a.admissible_count,
        outcome=outcome_to_pb(a.outcome), stopping_reason=a.stopping_reason,
        legs=[leg_to_pb(x) for x in a.legs], principal=a.principal,
        created_at_ms=a.created_at_ms, total_ms=a.total_ms, model_ids=a.model_ids,
        plan_reason=a.plan_reason,
    )
    if a.budget_before is not None:
        msg.budget_before = a.budget_before
    if a.budget_after is not None:
        msg.budget_after = a.budget_after
    return msg


def document_from_pb(d: corpus_pb2.Document) -> DocumentInput:
    return DocumentInput(
        source_id=d.source_id, version=d.version, title=d.title, text=d.text,
        collection=_COLLECTION_IN.get(d.collection, ""),
        status=_STATUS_IN.get(d.status, "invalid"), acl=tuple(d.acl),
        breadcrumb=d.breadcrumb, metadata=dict(d.metadata),
    )


def status_to_pb(status: str) -> types_pb2.SourceStatus.ValueType:
    return _STATUS_OUT.get(status, types_pb2.SOURCE_STATUS_UNSPECIFIED)
