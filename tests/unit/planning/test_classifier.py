"""The rule-based intent classifier, Chinese and English."""

from __future__ import annotations

import pytest

from service.errors import InvalidArgument
from service.planning.classifier import classify
from service.planning.planner import IntentInput, build_plan
from service.planning.rules import load_rules

RULES = load_rules()


@pytest.mark.parametrize(("query", "history", "intent"), [
    ("如何开具发票？", [], "faq_query"),
    ("how do I change my email address?", [], "faq_query"),
    ("为什么退款政策规定十四天，和年付套餐有什么区别", [], "knowledge_query"),
    ("explain the difference between the retention policy and the deletion process", [], "knowledge_query"),
    ("那审批呢", ["报销流程是什么"], "follow_up"),
    ("which versions does it need?", ["how do I install the mobile app"], "follow_up"),
    ("and what about refunds", ["how do I cancel"], "follow_up"),
    ("那审批呢", [], "knowledge_query"),  # no history: never a follow-up (falls to the default)
    ("你好！", [], "greeting"),
    ("Hello", [], "greeting"),
    ("我要转人工", [], "handoff"),
    ("can I talk to a human please", [], "handoff"),
    ("hello, how do I reset my password?", [], "faq_query"),  # a greeting must be the whole query
])
def test_classify(query: str, history: list[str], intent: str) -> None:
    c = classify(query, history, RULES)
    assert c.intent == intent, c
    assert 0.0 <= c.confidence <= c.rule_score <= 1.0


def test_nothing_matched_is_the_default_intent_with_a_low_score() -> None:
    c = classify("zebra migration patterns", [], RULES)
    assert (c.intent, c.rule_score) == ("knowledge_query", 0.5)
    built = build_plan("zebra migration patterns", [], IntentInput(), RULES)
    assert built.from_classifier and "low_score_guard" in built.plan.reason


def test_a_classified_greeting_is_refused() -> None:
    with pytest.raises(InvalidArgument) as err:
        build_plan("你好", [], IntentInput(), RULES)
    assert err.value.violations[0].field == "intent.intent"
