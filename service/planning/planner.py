"""The layered plan builder: defaults -> intent -> short-query guard (not for follow-ups)
-> decision-score guard -> risk category -> table preference (shared/DESIGN.md section 5).

Every number comes from the rules file; this module only knows the order of the layers
and how an adjustment applies. The plan's ``reason`` lists the layers that applied, in
order, joined by "_" (the defaults are not named).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from service.errors import FieldViolation, InvalidArgument
from service.planning.classifier import NOT_PLANNABLE, PLANNABLE, Intent, classify
from service.planning.plan import RetrievalPlan
from service.planning.rules import FIELD_KINDS, Adjustment, Layer, PlanRules
from service.script import HAN, HAN_CHARS

_WORD = re.compile(rf"[^\W{HAN_CHARS}]+")
# A follow-up's own connective and closing particle, dropped before it is joined to the
# question it follows ("那审批呢" after "报销流程是什么" -> "报销流程是什么 审批").
_LEADING = re.compile(r"^\s*(那么|那|还有|另外|然后|and\s+what\s+about|what\s+about|how\s+about|and|also|then|so)[\s,，]*",
                      re.IGNORECASE)
_TRAILING = re.compile(r"[\s呢吗?？。.!！]+$")


@dataclass(frozen=True)
class IntentInput:
    """The caller's intent signals (intent "" = let the classifier decide)."""

    intent: str = ""
    rule_score: float | None = None
    confidence: float | None = None


@dataclass(frozen=True)
class BuiltPlan:
    plan: RetrievalPlan
    intent: str
    rule_score: float
    confidence: float
    decision_score: float
    from_classifier: bool
    variants: tuple[str, ...]  # the query first, then the history-aware rewrite if any


def query_units(query: str) -> tuple[int, bool]:
    """(length, has Han characters): Han characters plus non-Han words."""
    han = len(HAN.findall(query))
    return han + len(_WORD.findall(query)), han > 0


def is_short(query: str, rules: PlanRules) -> bool:
    units, cjk = query_units(query)
    return units <= (rules.shape.short_max_cjk_units if cjk else rules.shape.short_max_words)


def is_complex(query: str, rules: PlanRules) -> bool:
    units, cjk = query_units(query)
    if units >= (rules.shape.complex_min_cjk_units if cjk else rules.shape.complex_min_words):
        return True
    return bool(rules.shape.complex_markers.matches(query)) or len(re.findall(r"[?？]", query)) >= 2


def history_rewrite(query: str, history: list[str] | tuple[str, ...]) -> str:
    """Deterministic history-aware rewrite of a follow-up (no language model): the last
    earlier question, then the follow-up without its connective and closing particle."""
    previous = next((h for h in reversed(history) if h.strip()), "")
    if not previous:
        return query
    rest = _TRAILING.sub("", _LEADING.sub("", query)).strip()
    return f"{_TRAILING.sub('', previous.strip())} {rest}".strip()


def _apply(values: dict[str, Any], adj: Adjustment) -> None:
    kind = FIELD_KINDS[adj.field]
    current = values[adj.field]
    if adj.op == "set":
        new: Any = adj.value
    elif adj.op == "at_least":
        new = max(current, adj.value)
    elif adj.op == "at_most":
        new = min(current, adj.value)
    elif adj.op == "scale":
        new = current * adj.value
    else:  # add
        new = current + adj.value
    if kind == "count":
        new = max(1, int(new + 0.5)) if adj.field != "max_context_doc_chars" else max(0, int(new + 0.5))
    elif kind == "score":
        new = round(min(1.0, max(0.0, float(new))), 4)
    values[adj.field] = new


def _layer(values: dict[str, Any], layer: Layer, reasons: list[str]) -> None:
    for adj in layer.adjustments:
        _apply(values, adj)
    reasons.append(layer.reason)


def not_plannable(intent: str, field: str) -> InvalidArgument:
    return InvalidArgument.one(field, f"INTENT_{intent.upper()} is answered without retrieval and never reaches planning")


def build_plan(query: str, history: list[str] | tuple[str, ...], signals: IntentInput, rules: PlanRules,
               field_prefix: str = "intent") -> BuiltPlan:
    """Apply the layers. Raises InvalidArgument naming ``<field_prefix>.intent`` for an
    intent that never reaches planning, or a follow-up without history."""
    history = [h for h in history if h.strip()]
    bad: list[FieldViolation] = []
    for name in ("rule_score", "confidence"):
        value = getattr(signals, name)
        if value is not None and not 0.0 <= value <= 1.0:
            bad.append(FieldViolation(f"{field_prefix}.{name}", "must be within [0, 1]"))
    if bad:
        raise InvalidArgument(bad)
    if signals.intent:
        intent, from_classifier = signals.intent, False
        rule_score = signals.rule_score if signals.rule_score is not None else (
            signals.confidence if signals.confidence is not None else 1.0)
        confidence = signals.confidence if signals.confidence is not None else rule_score
    else:
        c = classify(query, history, rules)
        intent, rule_score, confidence, from_classifier = c.intent, c.rule_score, c.confidence, True
    if intent in NOT_PLANNABLE:
        raise not_plannable(intent, f"{field_prefix}.intent")
    if intent not in PLANNABLE:
        raise InvalidArgument.one(f"{field_prefix}.intent", f"unknown intent {intent!r}")
    if intent == Intent.FOLLOW_UP and not history:
        raise InvalidArgument.one("history", "INTENT_FOLLOW_UP needs the earlier questions in history")
    decision = signals.confidence if (signals.intent and signals.confidence is not None) else (
        rule_score if signals.intent else confidence)

    values: dict[str, Any] = dict(rules.defaults)
    reasons: list[str] = []
    if is_complex(query, rules):
        values["doc_top_k"] = max(values["doc_top_k"], rules.complex_query_doc_top_k)
    _layer(values, rules.intents[intent], reasons)
    if intent != Intent.FOLLOW_UP and is_short(query, rules):
        _layer(values, rules.short_query_guard, reasons)
    if decision < rules.low_below:
        _layer(values, rules.low_guard, reasons)
    elif decision < rules.guarded_below:
        _layer(values, rules.guarded_guard, reasons)
    category = next((c for c in rules.categories if c.matcher.matches(query)), None)
    if category is not None:
        _layer(values, category.layer, reasons)
    if rules.table.matcher.matches(query):
        _layer(values, rules.table.layer, reasons)

    plan = RetrievalPlan(
        **{k: v for k, v in values.items() if k in {f.name for f in dataclasses.fields(RetrievalPlan)}},
        question_category=category.name if category else "",
        intent_rule_score=round(rule_score, 4), intent_decision_score=round(decision, 4),
        reason="_".join(reasons), intent=intent,
    )
    variants: tuple[str, ...] = (query,)
    if intent == Intent.FOLLOW_UP and plan.use_query_variants:
        rewrite = history_rewrite(query, history)
        if rewrite != query:
            variants = (query, rewrite)
    return BuiltPlan(plan, intent, round(rule_score, 4), round(confidence, 4), round(decision, 4),
                     from_classifier, variants)
