"""Retrieval plans end to end on the demo corpus, through the real gRPC server with the
shipped reranker (the plans' default rerank): FAQ direct answers, exact-only plans,
knowledge questions, follow-ups with a history-aware variant, the context budget, the
ledger record, and the intents that never reach planning."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_status import rpc_status
from google.rpc import error_details_pb2

from service._gen.retrieval.v1 import plan_pb2, retrieval_pb2, types_pb2
from service.app import DEFAULT_RERANKER
from service.config import Config
from service.models.base import EmbeddingBackend
from service.offline.builder import default_models_dir
from tests.support.harness import Live, evidence_of, launch, result_of, shutdown

pytestmark = pytest.mark.slow

RERANKER = DEFAULT_RERANKER  # the default pair's reranker
FAQ = plan_pb2.IntentSignals(intent=plan_pb2.INTENT_FAQ_QUERY, confidence=0.9)
KNOWLEDGE = plan_pb2.IntentSignals(intent=plan_pb2.INTENT_KNOWLEDGE_QUERY, confidence=0.9)
FOLLOW_UP = plan_pb2.IntentSignals(intent=plan_pb2.INTENT_FOLLOW_UP, confidence=0.9)


@pytest.fixture(scope="module")
async def planned(tmp_path_factory: pytest.TempPathFactory, e5_embedder: EmbeddingBackend) -> AsyncIterator[Live]:
    if not (default_models_dir() / RERANKER / "model.onnx").exists():
        pytest.fail(f"{RERANKER} is not built: run `make models`")
    cfg = dataclasses.replace(Config(), data_dir=tmp_path_factory.mktemp("plans"), reranker_model=RERANKER)
    live = await launch(cfg, e5_embedder)
    yield live
    await shutdown(live)


async def build(live: Live, query: str, **fields: object) -> plan_pb2.BuildPlanResponse:
    res: plan_pb2.BuildPlanResponse = await live.retrieval.BuildPlan(
        plan_pb2.BuildPlanRequest(query=query, **fields), timeout=10)  # type: ignore[arg-type]
    return res


def violations(err: grpc.aio.AioRpcError) -> dict[str, str]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    bad = error_details_pb2.BadRequest()
    status.details[0].Unpack(bad)
    return {v.field: v.description for v in bad.field_violations}


async def test_an_faq_question_answers_directly_at_or_above_the_threshold_and_not_below(planned: Live) -> None:
    query = "How do I change my email address?"
    plan = (await build(planned, query, intent=FAQ)).plan
    assert plan.reason == "faq_first" and plan.faq_direct_threshold == pytest.approx(0.64)
    events = await planned.retrieve(query=query, top_k=0, plan=plan)
    result, items = result_of(events), evidence_of(events)
    faq = next(e for e in items if e.source_id == "faq-change-email")
    quality = faq.quality
    assert result.plan.reason == "faq_first" and result.faq_direct == (quality >= 0.64)
    for threshold, direct in ((quality - 0.001, True), (quality + 0.001, False)):
        p = plan_pb2.RetrievalPlan()
        p.CopyFrom(plan)
        p.faq_direct_threshold = threshold
        events = await planned.retrieve(query=query, top_k=0, plan=p)
        result = result_of(events)
        assert result.faq_direct is direct, (threshold, quality)
        if direct:
            assert result.faq_direct_evidence_id == evidence_of(events)[0].evidence_id == faq.evidence_id
        else:
            assert result.faq_direct_evidence_id == ""
    lookup = await planned.retrieval.Lookup(retrieval_pb2.RetrieveRequest(query=query, plan=p), timeout=10)
    assert lookup.faq_direct is False and lookup.returned_count >= 1


async def test_an_exact_only_plan_refuses_a_fuzzy_faq_hit(planned: Live) -> None:
    plan = plan_pb2.RetrievalPlan(run_faq=True, run_doc=True, faq_top_k=10, doc_top_k=10, rerank=True,
                                  faq_direct_threshold=0.0, faq_direct_exact_only=True, final_context_top_n=3)
    fuzzy = await planned.retrieve(query="how can I update the email on my account", top_k=0, plan=plan)
    assert any(e.source_id == "faq-change-email" for e in evidence_of(fuzzy))  # found, yet not direct
    assert result_of(fuzzy).faq_direct is False
    exact = await planned.retrieve(query="how do I change my email address", top_k=0, plan=plan)
    assert result_of(exact).faq_direct is True
    assert evidence_of(exact)[0].source_id == "faq-change-email"
    zh = await planned.retrieve(query="如何开具发票", top_k=0, plan=plan)  # the FAQ's title ends with "？"
    assert result_of(zh).faq_direct is True and evidence_of(zh)[0].source_id == "faq-invoice-zh"


async def test_a_knowledge_question_draws_from_documents(planned: Live) -> None:
    events = await planned.retrieve(query="how long are deleted files kept after deletion", top_k=0, intent=KNOWLEDGE)
    result, items = result_of(events), evidence_of(events)
    assert result.plan.reason.startswith("knowledge_doc_enriched") and result.plan.doc_top_k >= 24
    assert items[0].source_id == "kb-data-retention" and items[0].collection == types_pb2.COLLECTION_DOC
    assert result.faq_direct is False
    assert len(items) <= result.plan.final_context_top_n
    legs = {leg.kind: leg for leg in result.legs}
    assert legs[types_pb2.LEG_KIND_BM25].status == types_pb2.LEG_STATUS_OK
    assert legs[types_pb2.LEG_KIND_KNN].status == types_pb2.LEG_STATUS_OK
    assert legs[types_pb2.LEG_KIND_RERANK].status == types_pb2.LEG_STATUS_OK


async def test_a_follow_ups_history_variant_finds_what_the_bare_follow_up_cannot(planned: Live) -> None:
    follow_up, history = "which versions does it need?", ["how do I install the mobile app"]
    bare = evidence_of(await planned.retrieve(query=follow_up, top_k=1))
    assert bare[0].source_id != "kb-mobile-app"  # "it" is the desktop app, as far as the bare question says
    events = await planned.retrieve(query=follow_up, top_k=0, history=history, intent=FOLLOW_UP)
    result = result_of(events)
    assert list(result.query_variants) == [follow_up, "how do I install the mobile app which versions does it need"]
    assert result.plan.reason == "history_aware_follow_up" and result.plan.use_query_variants
    assert evidence_of(events)[0].source_id == "kb-mobile-app"
    built = await build(planned, follow_up, history=history)  # the classifier sees the pronoun and the history
    assert built.intent == plan_pb2.INTENT_FOLLOW_UP and built.intent_source == plan_pb2.INTENT_SOURCE_CLASSIFIER
    assert list(built.query_variants) == list(result.query_variants)


async def test_the_context_budget_cuts_and_says_so(planned: Live) -> None:
    plan = (await build(planned, "how long are deleted files kept", intent=KNOWLEDGE)).plan
    roomy = await planned.retrieve(query="how long are deleted files kept", top_k=0, plan=plan)
    assert result_of(roomy).truncated is False
    plan.max_context_chars = 120
    cut = await planned.retrieve(query="how long are deleted files kept", top_k=0, plan=plan)
    items = evidence_of(cut)
    assert result_of(cut).truncated is True
    assert sum(len(e.excerpt) + len(e.context) for e in items) <= 120
    plan.max_context_chars, plan.final_context_top_n = 0, 2
    fewer = await planned.retrieve(query="how long are deleted files kept", top_k=5, plan=plan)
    assert len(evidence_of(fewer)) == 2 and result_of(fewer).truncated is True
    plan.final_context_top_n, plan.max_context_doc_chars = 3, 40
    per_doc = await planned.retrieve(query="how long are deleted files kept", top_k=0, plan=plan)
    assert result_of(per_doc).truncated is True
    assert all(len(e.excerpt) + len(e.context) <= 40 for e in evidence_of(per_doc))


async def test_the_plan_reason_is_recorded_with_the_attempt(planned: Live) -> None:
    result = result_of(await planned.retrieve(query="报销费用超过5000需要谁审批", top_k=0, intent=FAQ))
    assert result.plan.reason == "faq_first_short_query_guard_pricing_guard"
    record = (await planned.retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=result.attempt_id))).attempt
    assert record.plan_reason == "faq_first_short_query_guard_pricing_guard"
    plain = result_of(await planned.retrieve(query="refund", top_k=1))
    assert not plain.HasField("plan")
    record = (await planned.retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=plain.attempt_id))).attempt
    assert record.plan_reason == ""


@pytest.mark.parametrize("intent", [plan_pb2.INTENT_GREETING, plan_pb2.INTENT_HANDOFF, plan_pb2.INTENT_OUT_OF_SCOPE])
async def test_intents_that_never_reach_planning_are_invalid_argument(planned: Live, intent: int) -> None:
    name = plan_pb2.Intent.Name(intent)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await build(planned, "hello there", intent=plan_pb2.IntentSignals(intent=intent))  # type: ignore[arg-type]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in violations(err.value)["intent.intent"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await planned.retrieve(query="hello there", top_k=3, intent=plan_pb2.IntentSignals(intent=intent))  # type: ignore[arg-type]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in violations(err.value)["intent.intent"]


async def test_the_classifier_refuses_a_greeting_and_bad_plans_name_their_field(planned: Live) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await build(planned, "你好！")
    assert "INTENT_GREETING" in violations(err.value)["intent.intent"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await planned.retrieve(query="refund", top_k=3, plan=plan_pb2.RetrievalPlan(
            run_faq=True, faq_top_k=5, final_context_top_n=3, faq_direct_threshold=1.5))
    assert set(violations(err.value)) == {"plan.faq_direct_threshold"}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await build(planned, "那审批呢", intent=FOLLOW_UP)
    assert "history" in violations(err.value)


def test_a_bad_rules_file_stops_the_server_naming_the_key(tmp_path: Path) -> None:
    cases = {
        "unknown": ("[categories.pricing]\nfaq_topk = { at_least = 24 }\n", "categories.pricing.faq_topk: unknown key"),
        "type": ("[defaults]\nfaq_top_k = \"twenty\"\n", "defaults.faq_top_k: expected an integer"),
        "range": ("[intents.faq_query]\nfaq_direct_threshold = { set = 1.4 }\n",
                  "intents.faq_query.faq_direct_threshold.set: must be within [0.0, 1.0]"),
    }
    for name, (text, message) in cases.items():
        rules = tmp_path / f"{name}.toml"
        rules.write_text(text, encoding="utf-8")
        proc = subprocess.run(
            [sys.executable, "-m", "service", "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / name),
             "--embedding-model", "dummy-hash", "--reranker-model", "", "--plan-rules", str(rules)],
            capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert f"error: invalid plan rules: {rules}: {message}" in proc.stderr


async def cli(*args: str) -> tuple[int, str, str]:
    root = Path(__file__).resolve().parents[2]
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "service", *args, cwd=root,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_the_cli_plans_and_queries_with_history_as_the_readme_says(planned: Live) -> None:
    rc, out, err = await cli("plan", "报销费用超过5000需要谁审批", "--intent", "faq_query", "--confidence", "0.9",
                             "--target", planned.target)
    assert rc == 0, err
    res = json.loads(out)
    # The README's worked example, number for number.
    assert res["plan"]["reason"] == "faq_first_short_query_guard_pricing_guard"
    assert (res["plan"]["faq_top_k"], res["plan"]["doc_top_k"], res["plan"]["final_context_top_n"]) == (24, 24, 6)
    assert res["plan"]["faq_direct_threshold"] == pytest.approx(0.84) and res["plan"]["question_category"] == "pricing"
    assert res["intent_source"] == "INTENT_SOURCE_CALLER"
    rc, out, err = await cli("query", "which versions does it need?", "--history", "how do I install the mobile app",
                             "--intent", "follow_up", "--top-k", "1", "--target", planned.target)
    assert rc == 0, err
    assert "plan history_aware_follow_up" in out and "kb-mobile-app" in out
    rc, out, err = await cli("plan", "hello", "--target", planned.target)
    assert rc == 2 and "INVALID_ARGUMENT" in err and "INTENT_GREETING" in err
