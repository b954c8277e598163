"""The rules file: the shipped one loads; a bad one fails naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.planning.planner import IntentInput, build_plan
from service.planning.rules import RulesError, load_rules


def test_the_shipped_rules_load_with_the_documented_defaults() -> None:
    rules = load_rules()
    assert rules.defaults["faq_top_k"] == 20 and rules.defaults["doc_top_k"] == 20
    assert rules.defaults["faq_direct_threshold"] == 0.72 and rules.defaults["final_context_top_n"] == 4
    assert rules.complex_query_doc_top_k == 24
    assert [c.name for c in rules.categories] == ["pricing", "compliance", "troubleshooting", "summary"]


@pytest.mark.parametrize(("text", "message"), [
    ("[categories.pricing]\nfaq_topk = { at_least = 24 }\n", "categories.pricing.faq_topk: unknown key"),
    ("[defaults]\nmystery = 1\n", "defaults.mystery: unknown key"),
    ("surprise = true\n", "surprise: unknown key"),
    ("[defaults]\nfaq_top_k = \"twenty\"\n", "defaults.faq_top_k: expected an integer, got a string"),
    ("[defaults]\nrerank = 1\n", "defaults.rerank: expected a boolean, got an integer"),
    ("[defaults]\nfaq_direct_threshold = 1.2\n", "defaults.faq_direct_threshold: must be within [0.0, 1.0], got 1.2"),
    ("[intents.faq_query]\nfaq_direct_threshold = { set = 1.4 }\n",
     "intents.faq_query.faq_direct_threshold.set: must be within [0.0, 1.0], got 1.4"),
    ("[intents.faq_query]\nfaq_direct_threshold = { at_least = -0.1 }\n",
     "intents.faq_query.faq_direct_threshold.at_least: must be within [0.0, 1.0]"),
    ("[decision_score_guard]\nlow_below = 1.5\n", "decision_score_guard.low_below: must be within [0.0, 1.0]"),
    ("[categories.pricing]\ndoc_top_k = { double = 2 }\n", "categories.pricing.doc_top_k.double: unknown key"),
    ("[table]\nprefer_table = { at_least = true }\n", "table.prefer_table.at_least: a boolean field can only be set"),
    ("[categories.pricing]\nkeywords = \"price\"\n", "categories.pricing.keywords: expected a list of non-empty strings"),
    ("[classifier.greeting]\npatterns = [\"(unclosed\"]\n", "classifier.greeting.patterns[0]: bad regular expression"),
    ("[intents.faq_query]\nreason = \"FAQ First\"\n", "intents.faq_query.reason: must be lower_snake_case"),
    ("[defaults\n", "not valid TOML"),
])
def test_a_bad_rules_file_names_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "rules.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(RulesError) as err:
        load_rules(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_an_override_merges_over_the_shipped_rules_key_by_key(tmp_path: Path) -> None:
    path = tmp_path / "rules.toml"
    path.write_text("[intents.faq_query]\nfaq_direct_threshold = { set = 0.5 }\n\n"
                    "[categories.pricing]\nkeywords = [\"tariff\"]\n", encoding="utf-8")
    rules = load_rules(path)
    plan = build_plan("what is the tariff for an extra seat this year", [], IntentInput("faq_query", None, 0.9), rules).plan
    assert plan.reason == "faq_first_pricing_guard" and plan.faq_direct_threshold == 0.84
    plan = build_plan("what is the price for an extra seat this year", [], IntentInput("faq_query", None, 0.9), rules).plan
    assert plan.reason == "faq_first" and plan.faq_direct_threshold == 0.5
