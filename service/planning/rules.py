"""Plan rules as data: the TOML rules file, loaded and validated once at start.

The shipped file (``default_rules.toml`` beside this module) holds every number the
planner uses; a deployment's ``plan_rules_file`` is merged over it key by key. Any
problem (an unknown key, a wrong type, a score outside [0, 1], a bad pattern) raises
``RulesError`` naming the dotted key, so a bad file stops the server before it serves.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.script import has_han

DEFAULT_RULES_PATH = Path(__file__).with_name("default_rules.toml")

# Plan fields a layer may adjust, and their kind. "score" fields live in [0, 1].
FIELD_KINDS: dict[str, str] = {
    "run_faq": "bool",
    "run_doc": "bool",
    "faq_top_k": "count",
    "doc_top_k": "count",
    "rerank": "bool",
    "faq_direct_threshold": "score",
    "faq_direct_exact_only": "bool",
    "final_context_top_n": "count",
    "min_context_score": "score",
    "max_context_chars": "count",
    "max_context_doc_chars": "count",
    "use_query_variants": "bool",
    "prefer_table": "bool",
}
OPERATIONS = ("set", "at_least", "at_most", "scale", "add")
INTENT_NAMES = ("faq_query", "knowledge_query", "follow_up")
CLASSIFIER_INTENTS = ("faq_query", "knowledge_query", "follow_up")


class RulesError(ValueError):
    """The rules file is invalid; the message names the file and the key."""


@dataclass(frozen=True)
class Adjustment:
    field: str
    op: str  # one of OPERATIONS
    value: float | bool


@dataclass(frozen=True)
class Layer:
    reason: str
    adjustments: tuple[Adjustment, ...]


@dataclass(frozen=True)
class KeywordMatcher:
    """English keywords match whole words (case-insensitive); keywords with Han
    characters match as substrings (Chinese has no word boundaries)."""

    keywords: tuple[str, ...]
    _pattern: re.Pattern[str] | None

    @classmethod
    def of(cls, keywords: tuple[str, ...]) -> KeywordMatcher:
        parts = []
        for k in keywords:
            body = r"\s+".join(re.escape(w) for w in k.lower().split())
            parts.append(body if has_han(k) else rf"(?<![\w']){body}(?![\w'])")
        return cls(keywords, re.compile("|".join(parts)) if parts else None)

    def matches(self, text: str) -> list[str]:
        if self._pattern is None:
            return []
        return [m.group(0) for m in self._pattern.finditer(text.lower())]


@dataclass(frozen=True)
class Category:
    name: str
    layer: Layer
    matcher: KeywordMatcher


@dataclass(frozen=True)
class IntentRules:
    base: float
    per_match: float
    keywords: KeywordMatcher
    patterns: tuple[re.Pattern[str], ...]


@dataclass(frozen=True)
class ClassifierRules:
    default_intent: str
    default_rule_score: float
    intents: dict[str, IntentRules]
    greeting: tuple[re.Pattern[str], ...]
    handoff: tuple[re.Pattern[str], ...]


@dataclass(frozen=True)
class QueryShape:
    short_max_cjk_units: int
    short_max_words: int
    complex_min_cjk_units: int
    complex_min_words: int
    complex_markers: KeywordMatcher


@dataclass(frozen=True)
class PlanRules:
    defaults: dict[str, float | bool]
    complex_query_doc_top_k: int
    shape: QueryShape
    intents: dict[str, Layer]
    short_query_guard: Layer
    low_below: float
    guarded_below: float
    low_guard: Layer
    guarded_guard: Layer
    categories: tuple[Category, ...]
    table: Category
    classifier: ClassifierRules
    source: str  # where the rules came from, for messages


class _Reader:
    """Typed access to one TOML table that remembers its dotted path and rejects
    unknown keys."""

    def __init__(self, data: Mapping[str, Any], path: str, source: str) -> None:
        self.data, self.path, self.source = data, path, source
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def fail(self, key: str, why: str) -> RulesError:
        return RulesError(f"{self.source}: {key}: {why}")

    def raw(self, name: str) -> Any:
        self.seen.add(name)
        if name not in self.data:
            raise self.fail(self.key(name), "missing")
        return self.data[name]

    def table(self, name: str) -> _Reader:
        value = self.raw(name)
        if not isinstance(value, dict):
            raise self.fail(self.key(name), f"expected a table, got {_kind(value)}")
        return _Reader(value, self.key(name), self.source)

    def number(self, name: str, lo: float | None = None, hi: float | None = None) -> float:
        value = self.raw(name)
        return _number(value, self.key(name), self.source, lo, hi)

    def integer(self, name: str, lo: int = 0) -> int:
        value = self.raw(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(self.key(name), f"expected an integer, got {_kind(value)}")
        if value < lo:
            raise self.fail(self.key(name), f"must be >= {lo}, got {value}")
        return value

    def string(self, name: str) -> str:
        value = self.raw(name)
        if not isinstance(value, str) or not value:
            raise self.fail(self.key(name), f"expected a non-empty string, got {_kind(value)}")
        return value

    def strings(self, name: str) -> tuple[str, ...]:
        value = self.raw(name)
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise self.fail(self.key(name), "expected a list of non-empty strings")
        return tuple(value)

    def patterns(self, name: str) -> tuple[re.Pattern[str], ...]:
        out = []
        for i, p in enumerate(self.strings(name)):
            try:
                out.append(re.compile(p, re.IGNORECASE))
            except re.error as exc:
                raise self.fail(f"{self.key(name)}[{i}]", f"bad regular expression: {exc}")
        return tuple(out)

    def done(self, allowed_extra: tuple[str, ...] = ()) -> None:
        unknown = sorted(set(self.data) - self.seen - set(allowed_extra))
        if unknown:
            raise self.fail(self.key(unknown[0]), "unknown key")


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)


def _number(value: Any, key: str, source: str, lo: float | None, hi: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RulesError(f"{source}: {key}: expected a number, got {_kind(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{lo}, {hi}]" if lo is not None and hi is not None else (f">= {lo}" if lo is not None else f"<= {hi}")
        raise RulesError(f"{source}: {key}: must be within {bounds}, got {value}")
    return float(value)


def _field_value(kind: str, value: Any, key: str, source: str) -> float | bool:
    if kind == "bool":
        if not isinstance(value, bool):
            raise RulesError(f"{source}: {key}: expected a boolean, got {_kind(value)}")
        return value
    if kind == "score":
        return _number(value, key, source, 0.0, 1.0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RulesError(f"{source}: {key}: expected an integer, got {_kind(value)}")
    if value < 0:
        raise RulesError(f"{source}: {key}: must be >= 0, got {value}")
    return value


def _adjustment(field: str, value: Any, key: str, source: str) -> Adjustment:
    kind = FIELD_KINDS[field]
    if not isinstance(value, dict):
        return Adjustment(field, "set", _field_value(kind, value, key, source))
    if len(value) != 1:
        raise RulesError(f"{source}: {key}: expected one operation of {', '.join(OPERATIONS)}")
    op, operand = next(iter(value.items()))
    if op not in OPERATIONS:
        raise RulesError(f"{source}: {key}.{op}: unknown key (operations: {', '.join(OPERATIONS)})")
    if kind == "bool" and op != "set":
        raise RulesError(f"{source}: {key}.{op}: a boolean field can only be set")
    if op == "scale":
        return Adjustment(field, op, _number(operand, f"{key}.{op}", source, 0.0, None))
    if op == "add":
        limit = 1.0 if kind == "score" else None
        return Adjustment(field, op, _number(operand, f"{key}.{op}", source,
                                             -limit if limit else None, limit))
    return Adjustment(field, op, _field_value(kind, operand, f"{key}.{op}", source))


def _layer(r: _Reader, extra: tuple[str, ...] = ()) -> Layer:
    reason = r.string("reason")
    if not re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)*", reason):
        raise r.fail(r.key("reason"), "must be lower_snake_case")
    adjustments = []
    for name, value in r.data.items():
        if name == "reason" or name in extra or name in r.seen:
            continue
        if name not in FIELD_KINDS:
            raise r.fail(r.key(name), f"unknown key (adjustable fields: {', '.join(FIELD_KINDS)})")
        r.seen.add(name)
        adjustments.append(_adjustment(name, value, r.key(name), r.source))
    r.done(extra)
    return Layer(reason, tuple(adjustments))


def _is_operation(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and set(value) <= set(OPERATIONS)


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Tables merge key by key; an adjustment ({at_least = ...}) is replaced whole."""
    out = dict(base)
    for k, v in override.items():
        mergeable = isinstance(v, dict) and isinstance(out.get(k), dict) and not _is_operation(out[k])
        out[k] = _merge(out[k], v) if mergeable else v
    return out


def parse_rules(data: Mapping[str, Any], source: str) -> PlanRules:
    top = _Reader(data, "", source)

    d = top.table("defaults")
    defaults: dict[str, float | bool] = {}
    for name, kind in FIELD_KINDS.items():
        if name == "prefer_table":
            continue
        defaults[name] = _field_value(kind, d.raw(name), d.key(name), source)
    defaults["prefer_table"] = False
    complex_doc = d.integer("complex_query_doc_top_k", 1)
    d.done()
    for name in ("faq_top_k", "doc_top_k", "final_context_top_n"):
        if defaults[name] < 1:
            raise RulesError(f"{source}: defaults.{name}: must be >= 1")

    s = top.table("query_shape")
    shape = QueryShape(s.integer("short_max_cjk_units"), s.integer("short_max_words"),
                       s.integer("complex_min_cjk_units", 1), s.integer("complex_min_words", 1),
                       KeywordMatcher.of(s.strings("complex_markers")))
    s.done()

    it = top.table("intents")
    intents = {name: _layer(it.table(name)) for name in INTENT_NAMES}
    it.done()

    short = _layer(top.table("short_query_guard"))

    g = top.table("decision_score_guard")
    low_below = g.number("low_below", 0.0, 1.0)
    guarded_below = g.number("guarded_below", 0.0, 1.0)
    if guarded_below < low_below:
        raise RulesError(f"{source}: decision_score_guard.guarded_below: must be >= low_below")
    low, guarded = _layer(g.table("low")), _layer(g.table("guarded"))
    g.done()

    c = top.table("categories")
    categories = []
    for name in c.data:
        cr = c.table(name)
        categories.append(Category(name, _layer(cr, ("keywords",)), KeywordMatcher.of(cr.strings("keywords"))))
    c.done()

    t = top.table("table")
    table = Category("table", _layer(t, ("keywords",)), KeywordMatcher.of(t.strings("keywords")))

    k = top.table("classifier")
    default_intent = k.string("default_intent")
    if default_intent not in CLASSIFIER_INTENTS:
        raise k.fail(k.key("default_intent"), f"must be one of {', '.join(CLASSIFIER_INTENTS)}")
    intent_rules = {}
    for name in CLASSIFIER_INTENTS:
        ir = k.table(name)
        intent_rules[name] = IntentRules(ir.number("base", 0.0, 1.0), ir.number("per_match", 0.0, 1.0),
                                         KeywordMatcher.of(ir.strings("keywords")), ir.patterns("patterns"))
        ir.done()
    gr, hr = k.table("greeting"), k.table("handoff")
    classifier = ClassifierRules(default_intent, k.number("default_rule_score", 0.0, 1.0), intent_rules,
                                 gr.patterns("patterns"), hr.patterns("patterns"))
    gr.done()
    hr.done()
    k.done()
    top.done()
    return PlanRules(defaults, complex_doc, shape, intents, short, low_below, guarded_below, low, guarded,
                     tuple(categories), table, classifier, source)


def load_rules(path: Path | str | None = None) -> PlanRules:
    """The shipped rules, with ``path`` (a deployment's file) merged over them."""
    with DEFAULT_RULES_PATH.open("rb") as fh:
        data = tomllib.load(fh)
    source = str(DEFAULT_RULES_PATH.name)
    if path:
        p = Path(path)
        try:
            with p.open("rb") as fh:
                override = tomllib.load(fh)
        except OSError as exc:
            raise RulesError(f"{p}: cannot read plan rules: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise RulesError(f"{p}: not valid TOML: {exc}") from exc
        data, source = _merge(data, override), str(p)
    return parse_rules(data, source)
