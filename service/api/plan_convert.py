"""Proto <-> domain conversion for retrieval plans (plan.proto)."""

from __future__ import annotations

from service._gen.retrieval.v1 import plan_pb2
from service.errors import FieldViolation
from service.planning.plan import RetrievalPlan
from service.planning.planner import BuiltPlan, IntentInput

_INTENT_NAMES = ("faq_query", "knowledge_query", "follow_up", "greeting", "handoff", "out_of_scope")
_INTENT_IN = {plan_pb2.Intent.Value(f"INTENT_{n.upper()}"): n for n in _INTENT_NAMES}


def intent_to_pb(name: str) -> plan_pb2.Intent.ValueType:
    return plan_pb2.Intent.Value(f"INTENT_{name.upper()}") if name else plan_pb2.INTENT_UNSPECIFIED


def intent_from_pb(m: plan_pb2.IntentSignals, field: str = "intent") -> tuple[IntentInput, list[FieldViolation]]:
    bad: list[FieldViolation] = []
    name = ""
    if m.intent != plan_pb2.INTENT_UNSPECIFIED:
        if m.intent in _INTENT_IN:
            name = _INTENT_IN[m.intent]
        else:
            bad.append(FieldViolation(f"{field}.intent", f"unknown intent {m.intent}"))
    return IntentInput(
        name,
        m.rule_score if m.HasField("rule_score") else None,
        m.confidence if m.HasField("confidence") else None,
    ), bad


def plan_from_pb(m: plan_pb2.RetrievalPlan) -> RetrievalPlan:
    return RetrievalPlan(
        run_faq=m.run_faq, run_doc=m.run_doc, faq_top_k=m.faq_top_k, doc_top_k=m.doc_top_k, rerank=m.rerank,
        faq_direct_threshold=m.faq_direct_threshold, faq_direct_exact_only=m.faq_direct_exact_only,
        final_context_top_n=m.final_context_top_n, min_context_score=m.min_context_score,
        max_context_chars=m.max_context_chars, max_context_doc_chars=m.max_context_doc_chars,
        use_query_variants=m.use_query_variants, question_category=m.question_category,
        prefer_table=m.prefer_table, intent_rule_score=m.intent_rule_score,
        intent_decision_score=m.intent_decision_score, reason=m.reason or "caller_plan",
        intent=_INTENT_IN.get(m.intent, ""),
    )


def plan_to_pb(p: RetrievalPlan) -> plan_pb2.RetrievalPlan:
    return plan_pb2.RetrievalPlan(
        run_faq=p.run_faq, run_doc=p.run_doc, faq_top_k=p.faq_top_k, doc_top_k=p.doc_top_k, rerank=p.rerank,
        faq_direct_threshold=p.faq_direct_threshold, faq_direct_exact_only=p.faq_direct_exact_only,
        final_context_top_n=p.final_context_top_n, min_context_score=p.min_context_score,
        max_context_chars=p.max_context_chars, max_context_doc_chars=p.max_context_doc_chars,
        use_query_variants=p.use_query_variants, question_category=p.question_category,
        prefer_table=p.prefer_table, intent_rule_score=p.intent_rule_score,
        intent_decision_score=p.intent_decision_score, reason=p.reason, intent=intent_to_pb(p.intent),
    )


def built_plan_to_pb(b: BuiltPlan) -> plan_pb2.BuildPlanResponse:
    return plan_pb2.BuildPlanResponse(
        plan=plan_to_pb(b.plan), intent=intent_to_pb(b.intent), rule_score=b.rule_score,
        confidence=b.confidence, decision_score=b.decision_score,
        intent_source=plan_pb2.INTENT_SOURCE_CLASSIFIER if b.from_classifier else plan_pb2.INTENT_SOURCE_CALLER,
        query_variants=list(b.variants),
    )
