"""The attempt request as the pipeline sees it, and its validation.

Field names in violations are the proto field paths (``options.legs``), so a caller can
map an INVALID_ARGUMENT straight back to what it sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from service.config import Config
from service.domain import COLLECTIONS, GapKind, LegKind
from service.errors import FieldViolation, InvalidArgument
from service.planning.plan import RetrievalPlan
from service.planning.planner import IntentInput


@dataclass(frozen=True)
class Principal:
    name: str
    groups: tuple[str, ...] = ()
    # Trusted internal callers see every document regardless of ACL; never API-key callers.
    unrestricted: bool = False

    def may_read(self, acl: Sequence[str]) -> bool:
        """A document with this ACL (empty: public)."""
        return self.unrestricted or not acl or bool(set(acl) & set(self.groups))

    def owns(self, owner: str) -> bool:
        """What ``owner`` left in the ledger (an attempt record: its query, what it saw)."""
        return self.unrestricted or owner == self.name


ANONYMOUS = Principal("anonymous")


@dataclass(frozen=True)
class Gap:
    gap_id: str = ""
    kind: GapKind = GapKind.UNSPECIFIED
    question: str = ""
    rationale: str = ""
    criticality: float = 0.0
    targeted_query: str = ""


@dataclass(frozen=True)
class AttemptRequest:
    query: str
    top_k: int
    run_id: str = ""
    collections: tuple[str, ...] = ()
    source_ids: tuple[str, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict)
    legs: tuple[LegKind, ...] = ()  # empty: BM25 + KNN
    rerank: bool | None = None  # None: server default
    min_quality: float = 0.0  # 0: server default
    max_context_chars: int = 0  # 0: server default
    gap: Gap | None = None
    tool_call_id: str = ""
    budget_max_searches: int = 0
    budget_max_results: int = 0
    version_pins: dict[str, str] = field(default_factory=dict)
    # Create the run so that an attempt without a gap is refused (no gap, no search).
    require_gap: bool = False
    # Retrieval plans (service/pipeline/plan_execution.py): an explicit plan, or intent
    # signals / history to build one from; extra phrasings of the query.
    plan: RetrievalPlan | None = None
    intent: IntentInput | None = None
    history: tuple[str, ...] = ()
    query_variants: tuple[str, ...] = ()

    @property
    def planned(self) -> bool:
        return self.plan is not None or self.intent is not None or bool(self.history)


def validate(
    req: AttemptRequest, cfg: Config, reranker_configured: bool,
    prior: Sequence[FieldViolation] = (), reranker_unavailable: str = "no reranker model configured",
) -> None:
    """Raise InvalidArgument naming every bad field at once (``prior``: violations found
    while decoding the request)."""
    v: list[FieldViolation] = list(prior)
    if not req.query.strip():
        v.append(FieldViolation("query", "must not be empty"))
    elif len(req.query) > cfg.max_query_chars:
        v.append(FieldViolation("query", f"is {len(req.query)} characters; at most {cfg.max_query_chars}"))
    if req.top_k == 0 and not req.planned:  # planned: 0 = the plan's final_context_top_n
        v.append(FieldViolation("top_k", f"must be between 1 and {cfg.max_top_k}"))
    elif req.top_k > cfg.max_top_k:
        v.append(FieldViolation("top_k", f"is {req.top_k}; at most {cfg.max_top_k}"))
    for i, c in enumerate(req.collections):
        if c not in COLLECTIONS:
            v.append(FieldViolation(f"filters.collections[{i}]", f"unknown collection {c!r}; known: {', '.join(COLLECTIONS)}"))
    for i, s in enumerate(req.source_ids):
        if not s.strip():
            v.append(FieldViolation(f"filters.source_ids[{i}]", "must not be empty"))
    for key in req.metadata:
        if not key.strip():
            v.append(FieldViolation("filters.metadata", "keys must not be empty"))
    for i, leg in enumerate(req.legs):
        if leg is LegKind.RERANK:
            v.append(FieldViolation(f"options.legs[{i}]", "only LEG_KIND_BM25, LEG_KIND_KNN and LEG_KIND_KNN_LATIN can be chosen; use options.rerank for reranking"))
    if len(set(req.legs)) != len(req.legs):
        v.append(FieldViolation("options.legs", "lists a leg twice"))
    if req.rerank is True and not reranker_configured:
        v.append(FieldViolation("options.rerank", f"RERANK_MODE_ON, but this server has no reranker: {reranker_unavailable}"))
    if not 0.0 <= req.min_quality <= 1.0:
        v.append(FieldViolation("options.min_quality", "must be within [0, 1]"))
    if req.gap is not None and req.gap.criticality and not 0.0 <= req.gap.criticality <= 1.0:
        v.append(FieldViolation("gap.criticality", "must be within [0, 1]"))
    if req.run_id and len(req.run_id) > 200:
        v.append(FieldViolation("run_id", "at most 200 characters"))
    if v:
        raise InvalidArgument(v)
