"""A small rule-based intent classifier (Chinese and English), for callers that give no
intent. Keywords and patterns come from the rules file; no model runs here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from service.planning.rules import ClassifierRules, PlanRules


class Intent:
    """Intent names, as the rules file and the proto (``INTENT_<NAME>``) spell them."""

    FAQ_QUERY = "faq_query"
    KNOWLEDGE_QUERY = "knowledge_query"
    FOLLOW_UP = "follow_up"
    GREETING = "greeting"
    HANDOFF = "handoff"
    OUT_OF_SCOPE = "out_of_scope"


PLANNABLE = (Intent.FAQ_QUERY, Intent.KNOWLEDGE_QUERY, Intent.FOLLOW_UP)
# Answered without retrieval (or by a person): never planned.
NOT_PLANNABLE = (Intent.GREETING, Intent.HANDOFF, Intent.OUT_OF_SCOPE)


@dataclass(frozen=True)
class Classification:
    intent: str
    rule_score: float
    confidence: float
    matched: tuple[str, ...] = ()


def _score(rules: ClassifierRules, name: str, query: str) -> tuple[float, list[str]]:
    r = rules.intents[name]
    hits = r.keywords.matches(query) + [p.pattern for p in r.patterns if p.search(query)]
    if not hits:
        return 0.0, []
    return min(1.0, r.base + r.per_match * (len(hits) - 1)), hits


def classify(query: str, history: list[str] | tuple[str, ...], rules: PlanRules) -> Classification:
    """The intent with the best rule score. A greeting or hand-off must match the whole
    query's pattern; a follow-up needs history. Confidence shrinks with the margin over
    the runner-up, so two intents matching equally give a low decision score."""
    c = rules.classifier
    text = re.sub(r"\s+", " ", query).strip()
    if any(p.search(text) for p in c.greeting):
        return Classification(Intent.GREETING, 1.0, 1.0)
    if any(p.search(text) for p in c.handoff):
        return Classification(Intent.HANDOFF, 1.0, 1.0)
    scored = []
    for name in (Intent.FOLLOW_UP, Intent.FAQ_QUERY, Intent.KNOWLEDGE_QUERY):
        if name == Intent.FOLLOW_UP and not history:
            continue
        score, hits = _score(c, name, text)
        if score > 0:
            scored.append((score, name, hits))
    if not scored:
        return Classification(c.default_intent, c.default_rule_score, c.default_rule_score)
    scored.sort(key=lambda s: -s[0])  # stable: follow-up, then FAQ, wins a tie
    best, name, hits = scored[0]
    second = scored[1][0] if len(scored) > 1 else 0.0
    margin = (best - second) / best
    return Classification(name, round(best, 4), round(best * (0.5 + 0.5 * margin), 4), tuple(hits))
