"""Plan execution stages: variant fusion, the FAQ direct answer, the plan's context
budget and the plan resolution at admission."""

from __future__ import annotations

import dataclasses

import pytest

from service.config import Config
from service.engines.base import ChunkRecord
from service.errors import InvalidArgument
from service.pipeline.context_budget import apply_plan_budget
from service.pipeline.fusion import Candidate
from service.pipeline.plan_execution import (
    cut_to_plan,
    faq_direct_answer,
    normalize_question,
    rerank_query,
    resolve_plan,
)
from service.pipeline.request import AttemptRequest
from service.pipeline.variants import fuse_variants
from service.planning.plan import RetrievalPlan
from service.planning.planner import IntentInput
from service.planning.rules import load_rules

RULES = load_rules()


def cand(cid: str, *, collection: str = "doc", quality: float = 0.5, fused: float = 0.1, title: str = "",
         text: str = "x" * 10, parent: str = "") -> Candidate:
    chunk = ChunkRecord(cid, cid, "v1", 0, collection, "approved", title, "", text, parent or text, text)
    return Candidate(chunk, fused_score=fused, quality=quality)


def test_one_variant_keeps_its_order_and_several_are_fused_with_rrf() -> None:
    a, b, c = cand("a", fused=0.3), cand("b", fused=0.2), cand("c", fused=0.1)
    assert [x.chunk.chunk_id for x, _ in fuse_variants([[a, b, c]])] == ["a", "b", "c"]
    b2 = cand("b", fused=0.5)
    fused = fuse_variants([[a, b, c], [b2, c]])
    assert [x.chunk.chunk_id for x, _ in fused] == ["b", "c", "a"]  # b: 1/62 + 1/61 beats c: 1/63 + 1/62
    assert fused[0][0] is b2  # the signals of the variant that scored it best


def test_the_faq_direct_answer_needs_the_threshold_and_for_exact_only_the_question() -> None:
    faq = cand("faq", collection="faq", quality=0.7, title="如何开具发票？")
    doc = cand("doc", quality=0.9)
    assert faq_direct_answer([doc, faq], 0.7, False, "anything") is faq  # at the threshold
    assert faq_direct_answer([doc, faq], 0.71, False, "anything") is None  # below it
    assert faq_direct_answer([doc, faq], 0.5, True, "怎么开发票") is None  # fuzzy
    assert faq_direct_answer([doc, faq], 0.5, True, " 如何开具发票 ") is faq  # exact, normalized
    assert faq_direct_answer([doc], 0.0, False, "x") is None
    assert normalize_question("How do I change my E-mail address?") == normalize_question("how do i change my email address")


def test_the_plan_budget_counts_items_and_characters() -> None:
    items = [cand(f"d{i}", text="t" * 50, parent="p" * 100) for i in range(6)]
    plan = RetrievalPlan(final_context_top_n=4, max_context_chars=0, max_context_doc_chars=0)
    out, truncated = apply_plan_budget(items, 0, plan, 10_000)
    assert len(out) == 4 and truncated is False  # top_k 0: the plan's count is no cut
    out, truncated = apply_plan_budget(items, 5, plan, 10_000)
    assert len(out) == 4 and truncated is True  # the caller asked for 5
    out, truncated = apply_plan_budget(items, 0, dataclasses.replace(plan, max_context_doc_chars=60), 10_000)
    assert truncated and all(len(b.excerpt) + len(b.context) <= 60 for b in out)
    out, truncated = apply_plan_budget(items, 0, dataclasses.replace(plan, max_context_chars=200), 10_000)
    assert truncated and sum(len(b.excerpt) + len(b.context) for b in out) <= 200


def test_resolution_builds_the_plan_and_its_variants() -> None:
    cfg = Config()
    req = AttemptRequest(query="那审批呢", top_k=0, history=("报销流程是什么",), intent=IntentInput("follow_up", None, 0.9))
    resolved = resolve_plan(req, RULES, cfg)
    assert resolved.plan is not None and resolved.plan.reason == "history_aware_follow_up"
    assert resolved.query_variants == ("报销流程是什么 审批",) and rerank_query(resolved) == "报销流程是什么 审批"
    faq = resolve_plan(AttemptRequest(query="如何开具发票", top_k=3, query_variants=("怎么开发票",),
                                      intent=IntentInput("faq_query", None, 0.9)), RULES, cfg)
    assert faq.query_variants == ()  # FAQ_QUERY plans run no variants
    plain = resolve_plan(AttemptRequest(query="refund", top_k=3, query_variants=("money back",)), RULES, cfg)
    assert plain.plan is None and plain.query_variants == ("money back",)


def test_resolution_refuses_bad_plans_and_variants_naming_the_field() -> None:
    cfg = Config()
    with pytest.raises(InvalidArgument) as err:
        resolve_plan(AttemptRequest(query="q", top_k=3, plan=RetrievalPlan(run_faq=False, run_doc=False)), RULES, cfg)
    assert err.value.violations[0].field == "plan.run_faq"
    with pytest.raises(InvalidArgument) as err:
        resolve_plan(AttemptRequest(query="q", top_k=3, query_variants=("a", "b", "c", "d", "e")), RULES, cfg)
    assert err.value.violations[0].field == "query_variants"
    with pytest.raises(InvalidArgument) as err:
        resolve_plan(AttemptRequest(query="q", top_k=3, collections=("faq",),
                                    plan=RetrievalPlan(run_faq=False, run_doc=True)), RULES, cfg)
    assert err.value.violations[0].field == "filters.collections"


def test_sub_search_reports_aggregate_to_one_per_leg_kind() -> None:
    from service.domain import LegKind, LegReport, LegStatus, LegTiming
    from service.pipeline.legs import LegRun
    from service.pipeline.plan_execution import _aggregate

    parts = [
        ("faq", LegRun(LegReport(LegKind.BM25, LegStatus.OK, 3.0, 4), [])),
        ("doc", LegRun(LegReport(LegKind.BM25, LegStatus.TIMEOUT, 9.0, 1, "engine reported timed_out"), [])),
        ("faq", LegRun(LegReport(LegKind.KNN, LegStatus.OK, 5.0, 2, "", LegTiming(1, 2, 3)), [])),
        ("doc", LegRun(LegReport(LegKind.KNN, LegStatus.OK, 7.0, 3, "", LegTiming(1, 1, 1)), [])),
    ]
    bm25 = _aggregate(LegKind.BM25, parts).report
    assert (bm25.status, bm25.latency_ms, bm25.hit_count) == (LegStatus.TIMEOUT, 9.0, 5)
    assert bm25.detail == "doc: engine reported timed_out"
    knn = _aggregate(LegKind.KNN, parts).report
    assert (knn.status, knn.hit_count, knn.timing) == (LegStatus.OK, 5, LegTiming(2, 3, 4))
    errored = parts + [("doc/variant 1", LegRun(LegReport(LegKind.KNN, LegStatus.ERROR, 1.0, 0, "boom"), []))]
    assert _aggregate(LegKind.KNN, errored).report.status is LegStatus.ERROR
    assert _aggregate(LegKind.RERANK, parts).report.status is LegStatus.SKIPPED


def test_each_collection_is_cut_to_its_plan_size_and_an_empty_one_hands_over_its_share() -> None:
    faq = [cand(f"f{i}", collection="faq") for i in range(30)]
    doc = [cand(f"d{i}") for i in range(40)]
    # Both found something: each keeps its own size, in its own order.
    cut = cut_to_plan([faq, doc], [20, 10])
    assert [len(x) for x in cut] == [20, 10] and cut[1] == doc[:10]
    # No FAQ entries matched (a knowledge base without FAQ): the documents get the FAQ's share.
    assert [len(x) for x in cut_to_plan([[], doc], [20, 10])] == [0, 30]
    assert [len(x) for x in cut_to_plan([faq[:5], []], [20, 10])] == [5, 0]  # short lists stay short
    assert cut_to_plan([[], []], [20, 10]) == [[], []]
    # Three lists, one empty: its share is split, the remainder to the first.
    assert [len(x) for x in cut_to_plan([faq, [], doc], [5, 3, 5])] == [7, 0, 6]
