"""Typed, plain-Python views of the service's messages."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.json_format import MessageToDict

from retrieval_client._gen.retrieval.v1 import corpus_pb2, retrieval_pb2, types_pb2


class Outcome(enum.Enum):
    EVIDENCE_FOUND = "EVIDENCE_FOUND"
    EMPTY = "EMPTY"
    INSUFFICIENT = "INSUFFICIENT"
    INADMISSIBLE = "INADMISSIBLE"
    TIMEOUT = "TIMEOUT"
    BACKEND_ERROR = "BACKEND_ERROR"
    BUDGET_DENIED = "BUDGET_DENIED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    CANCELLED = "CANCELLED"

    @property
    def is_infrastructure_failure(self) -> bool:
        """True when the backend, not the knowledge base, is why there is no evidence."""
        return self in (Outcome.TIMEOUT, Outcome.BACKEND_ERROR)


def _name(enum_type: Any, value: int, prefix: str) -> str:
    return str(enum_type.Name(value)).removeprefix(prefix)


@dataclass(frozen=True)
class Leg:
    kind: str  # "BM25" | "KNN" | "RERANK"
    status: str  # "OK" | "TIMEOUT" | "ERROR" | "SKIPPED"
    latency_ms: float
    hit_count: int
    detail: str

    @classmethod
    def from_pb(cls, m: retrieval_pb2.LegReport) -> Leg:
        return cls(_name(types_pb2.LegKind, m.kind, "LEG_KIND_"), _name(types_pb2.LegStatus, m.status, "LEG_STATUS_"),
                   m.latency_ms, m.hit_count, m.detail)


@dataclass(frozen=True)
class Evidence:
    evidence_id: str
    source_id: str
    version: str
    title: str
    breadcrumb: str
    excerpt: str
    context: str
    rank: int
    quality: float
    fused_score: float
    bm25_score: float | None
    dense_score: float | None
    rerank_score: float | None
    metadata: dict[str, str]

    @classmethod
    def from_pb(cls, m: retrieval_pb2.EvidenceItem) -> Evidence:
        return cls(m.evidence_id, m.source_id, m.version, m.title, m.breadcrumb, m.excerpt, m.context,
                   m.rank, m.quality, m.fused_score,
                   m.bm25_score if m.HasField("bm25_score") else None,
                   m.dense_score if m.HasField("dense_score") else None,
                   m.rerank_score if m.HasField("rerank_score") else None, dict(m.metadata))


@dataclass(frozen=True)
class Attempt:
    """The closing AttemptResult of a Retrieve stream, with the evidence before it."""

    attempt_id: str
    outcome: Outcome
    relevance_level: str | None  # "PRECISE" | "HIGHLY_RELEVANT" | "REFERENCE" | None
    degraded: bool
    truncated: bool
    stopping_reason: str
    legs: list[Leg]
    evidence: list[Evidence] = field(default_factory=list)
    raw: retrieval_pb2.AttemptResult | None = None

    @property
    def found(self) -> bool:
        return self.outcome is Outcome.EVIDENCE_FOUND

    @classmethod
    def from_pb(cls, m: retrieval_pb2.AttemptResult, evidence: list[Evidence]) -> Attempt:
        level = _name(types_pb2.RelevanceLevel, m.relevance_level, "RELEVANCE_LEVEL_")
        return cls(m.attempt_id, Outcome(_name(types_pb2.AttemptOutcome, m.outcome, "ATTEMPT_OUTCOME_")),
                   None if level == "UNSPECIFIED" else level, m.degraded, m.truncated, m.stopping_reason,
                   [Leg.from_pb(x) for x in m.legs], evidence, m)


def lookup_to_json(m: retrieval_pb2.LookupResult) -> dict[str, Any]:
    """The agent projection as a tool-result dict: snake_case names, enum values without
    their proto prefixes (EVIDENCE_FOUND / NO_EVIDENCE, PRECISE / REFERENCE), and
    relevance_level absent when the call reached none."""
    out: dict[str, Any] = MessageToDict(m, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
    out["evidence_status"] = _name(types_pb2.EvidenceStatus, m.evidence_status, "EVIDENCE_STATUS_")
    if m.HasField("relevance_level"):
        out["relevance_level"] = _name(types_pb2.RelevanceLevel, m.relevance_level, "RELEVANCE_LEVEL_")
    return out


_COLLECTIONS = {"doc": types_pb2.COLLECTION_DOC, "faq": types_pb2.COLLECTION_FAQ}
_STATUSES = {"approved": types_pb2.SOURCE_STATUS_APPROVED, "draft": types_pb2.SOURCE_STATUS_DRAFT,
             "retired": types_pb2.SOURCE_STATUS_RETIRED}


def document_to_pb(doc: dict[str, Any]) -> corpus_pb2.Document:
    """A document in the JSONL ingest format -> protobuf (unknown values are left for the
    server to reject with the field named)."""
    return corpus_pb2.Document(
        source_id=str(doc.get("source_id", "")), version=str(doc.get("version", "")),
        title=str(doc.get("title", "")), text=str(doc.get("text", "")),
        collection=_COLLECTIONS.get(str(doc.get("collection", "doc")), types_pb2.COLLECTION_UNSPECIFIED),
        status=_STATUSES.get(str(doc.get("status", "approved")), types_pb2.SOURCE_STATUS_UNSPECIFIED),
        acl=[str(g) for g in doc.get("acl", [])], breadcrumb=str(doc.get("breadcrumb", "")),
        metadata={str(k): str(v) for k, v in dict(doc.get("metadata", {})).items()},
    )
