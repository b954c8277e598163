"""The layered planner, table-driven: the issue's worked examples verbatim, English
equivalents of each, a short query, compliance, troubleshooting and summary questions."""

from __future__ import annotations

from typing import Any

import pytest

from service.errors import InvalidArgument
from service.planning.planner import IntentInput, build_plan, history_rewrite
from service.planning.rules import load_rules

RULES = load_rules()

# (query, history, intent, confidence, expected plan fields; "reason" exact, "min_*" floors)
CASES: list[tuple[str, list[str], str, float, dict[str, Any]]] = [
    # The table, verbatim.
    ("异地入职材料办理时需要准备哪些资料和审批信息", [], "faq_query", 0.9,
     dict(doc_top_k=10, faq_direct_threshold=0.64, final_context_top_n=4, use_query_variants=False, reason="faq_first")),
    ("公司会议室预约规则在哪里查看以及需要遵守哪些流程要求", [], "knowledge_query", 0.9,
     dict(doc_top_k=24, final_context_top_n=5, use_query_variants=True, reason="knowledge_doc_enriched")),
    ("那审批呢", ["报销流程是什么"], "follow_up", 0.75,
     dict(faq_top_k=24, doc_top_k=24, use_query_variants=True, reason="history_aware_follow_up_rule_score_guard")),
    ("报销费用超过5000需要谁审批", [], "faq_query", 0.9,
     dict(question_category="pricing", doc_top_k=24, faq_direct_threshold=0.84, final_context_top_n=6,
          reason="faq_first_short_query_guard_pricing_guard")),
    ("材料清单里的付款金额字段是什么", [], "faq_query", 0.9,
     dict(prefer_table=True, faq_direct_exact_only=True, final_context_top_n=7,
          reason="faq_first_pricing_guard_table_row_preferred")),
    ("帮我分析一下这个问题", [], "knowledge_query", 0.6,
     dict(faq_direct_exact_only=True, min_faq_direct_threshold=0.86, min_final_context_top_n=6)),
    # English equivalents.
    ("what documents and approval information do I need to prepare for onboarding at a remote office", [],
     "faq_query", 0.9,
     dict(doc_top_k=10, faq_direct_threshold=0.64, final_context_top_n=4, use_query_variants=False, reason="faq_first")),
    ("where can I find the meeting room booking rules and which process requirements must be followed", [],
     "knowledge_query", 0.9,
     dict(doc_top_k=24, final_context_top_n=5, use_query_variants=True, reason="knowledge_doc_enriched")),
    ("what about approval", ["what is the reimbursement process"], "follow_up", 0.75,
     dict(faq_top_k=24, doc_top_k=24, use_query_variants=True, reason="history_aware_follow_up_rule_score_guard")),
    ("who approves expenses over 5000", [], "faq_query", 0.9,
     dict(question_category="pricing", doc_top_k=24, faq_direct_threshold=0.84, final_context_top_n=6,
          reason="faq_first_short_query_guard_pricing_guard")),
    ("what is the payment amount field in the materials list", [], "faq_query", 0.9,
     dict(prefer_table=True, faq_direct_exact_only=True, final_context_top_n=7,
          reason="faq_first_pricing_guard_table_row_preferred")),
    ("help me analyse this problem", [], "knowledge_query", 0.6,
     dict(faq_direct_exact_only=True, min_faq_direct_threshold=0.86, min_final_context_top_n=6)),
    # A short query alone: fewer document candidates, a higher FAQ threshold.
    ("reset password", [], "faq_query", 0.9,
     dict(doc_top_k=8, faq_direct_threshold=0.70, reason="faq_first_short_query_guard")),
    ("重置密码", [], "faq_query", 0.9,
     dict(doc_top_k=8, faq_direct_threshold=0.70, reason="faq_first_short_query_guard")),
    # Risk categories beyond pricing.
    ("how long are audit logs retained to meet compliance requirements", [], "knowledge_query", 0.9,
     dict(question_category="compliance", doc_top_k=30, faq_direct_threshold=0.86,
          reason="knowledge_doc_enriched_compliance_guard")),
    ("个人信息的保留期限和隐私合规要求是如何规定的，审计日志需要保存多久", [], "knowledge_query", 0.9,
     dict(question_category="compliance", doc_top_k=30, faq_direct_threshold=0.86,
          reason="knowledge_doc_enriched_compliance_guard")),
    ("the desktop app shows an error every time I upload a large folder", [], "knowledge_query", 0.9,
     dict(question_category="troubleshooting", doc_top_k=30, final_context_top_n=6, max_context_chars=8000,
          reason="knowledge_doc_enriched_troubleshooting_guard")),
    ("桌面客户端每次上传大文件夹的时候都会报错应该怎么排查", [], "knowledge_query", 0.9,
     dict(question_category="troubleshooting", doc_top_k=30, final_context_top_n=6,
          reason="knowledge_doc_enriched_troubleshooting_guard")),
    ("summarize what changed across the last two releases of the desktop app", [], "knowledge_query", 0.9,
     dict(question_category="summary", doc_top_k=30, final_context_top_n=6,
          reason="knowledge_doc_enriched_summary_guard")),
    # The decision-score tiers: 0.82 is unguarded, 0.70 guarded, below 0.70 low.
    ("公司会议室预约规则在哪里查看以及需要遵守哪些流程要求", [], "knowledge_query", 0.82,
     dict(faq_direct_threshold=0.72, reason="knowledge_doc_enriched")),
    ("公司会议室预约规则在哪里查看以及需要遵守哪些流程要求", [], "knowledge_query", 0.70,
     dict(faq_direct_threshold=0.82, faq_direct_exact_only=False, reason="knowledge_doc_enriched_rule_score_guard")),
    ("公司会议室预约规则在哪里查看以及需要遵守哪些流程要求", [], "knowledge_query", 0.69,
     dict(faq_direct_threshold=0.86, faq_direct_exact_only=True, doc_top_k=32, final_context_top_n=6,
          reason="knowledge_doc_enriched_low_score_guard")),
    # Follow-ups skip the short-query guard, however short.
    ("那呢", ["退款政策是什么"], "follow_up", 0.9,
     dict(faq_direct_threshold=0.82, reason="history_aware_follow_up")),
]


@pytest.mark.parametrize(("query", "history", "intent", "confidence", "expected"), CASES,
                         ids=[f"{c[2]}-{c[3]}-{c[0][:24]}" for c in CASES])
def test_plan_layers(query: str, history: list[str], intent: str, confidence: float, expected: dict[str, Any]) -> None:
    built = build_plan(query, history, IntentInput(intent, None, confidence), RULES)
    plan = built.plan
    for key, want in expected.items():
        if key.startswith("min_"):
            assert getattr(plan, key[4:]) >= want, (key, plan)
        elif isinstance(want, float):
            assert getattr(plan, key) == pytest.approx(want), (key, plan)
        else:
            assert getattr(plan, key) == want, (key, plan)
    assert plan.intent == intent and plan.intent_decision_score == pytest.approx(confidence)
    assert built.from_classifier is False


def test_defaults_apply_without_any_layer_but_the_intent() -> None:
    plan = build_plan("what is the capital of the moon and why is it there", [],
                      IntentInput("faq_query", None, 0.95), RULES).plan
    assert (plan.run_faq, plan.run_doc, plan.faq_top_k, plan.rerank, plan.final_context_top_n) == (True, True, 20, True, 4)


def test_a_complex_query_gets_more_document_candidates_before_the_intent() -> None:
    # "以及" makes it complex: doc_top_k 24 from the defaults layer, halved by FAQ_QUERY.
    plan = build_plan("公司会议室预约规则在哪里查看以及需要遵守哪些流程要求", [], IntentInput("faq_query", None, 0.9), RULES).plan
    assert plan.doc_top_k == 12 and plan.reason == "faq_first"


def test_a_follow_up_gets_a_deterministic_history_aware_variant() -> None:
    built = build_plan("那审批呢", ["报销流程是什么"], IntentInput("follow_up", None, 0.9), RULES)
    assert built.variants == ("那审批呢", "报销流程是什么 审批")
    assert history_rewrite("and what about refunds?", ["How do I cancel my plan?"]) == "How do I cancel my plan refunds"
    assert history_rewrite("那审批呢", ["", "  "]) == "那审批呢"


def test_scores_decide_the_decision_score() -> None:
    only_rule = build_plan("how do I reset my password when the link has expired", [], IntentInput("faq_query", 0.75, None), RULES)
    assert only_rule.decision_score == 0.75 and "rule_score_guard" in only_rule.plan.reason
    trusted = build_plan("how do I reset my password when the link has expired", [], IntentInput("faq_query", None, None), RULES)
    assert trusted.decision_score == 1.0 and trusted.plan.reason == "faq_first"


@pytest.mark.parametrize("intent", ["greeting", "handoff", "out_of_scope"])
def test_direct_answer_intents_never_reach_planning(intent: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        build_plan("hello", [], IntentInput(intent), RULES)
    (v,) = err.value.violations
    assert v.field == "intent.intent" and f"INTENT_{intent.upper()}" in v.description


def test_bad_signals_name_their_field() -> None:
    with pytest.raises(InvalidArgument) as err:
        build_plan("refund", [], IntentInput("faq_query", 1.2, -0.1), RULES)
    assert {v.field for v in err.value.violations} == {"intent.rule_score", "intent.confidence"}
    with pytest.raises(InvalidArgument) as err:
        build_plan("那审批呢", [], IntentInput("follow_up", None, 0.9), RULES)
    assert err.value.violations[0].field == "history"
