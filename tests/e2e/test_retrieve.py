"""Retrieval through real gRPC against the demo corpus: ranking, stream shape, outcomes
produced by policy and data (faults are in test_faults.py)."""

from __future__ import annotations

import json
import uuid

import grpc
import pytest
from google.protobuf.json_format import MessageToDict, MessageToJson
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from service._gen.retrieval.v1 import corpus_pb2, retrieval_pb2, types_pb2
from tests.support import demo_expectations as expect
from tests.support.harness import DEFAULT_EMBEDDER, Live, evidence_of, legs_of, result_of

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("query,expected_source", expect.RANKING_CASES)
async def test_english_and_chinese_queries_rank_the_expected_source_first(
    demo: Live, query: str, expected_source: str
) -> None:
    events = await demo.retrieve(query=query, top_k=3)
    result = result_of(events)
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND
    assert evidence_of(events)[0].source_id == expected_source, [e.evidence_id for e in evidence_of(events)]


@pytest.mark.parametrize("query,version", expect.VERSION_CASES)
async def test_version_sensitive_query_ranks_the_right_version_first(demo: Live, query: str, version: str) -> None:
    top = evidence_of(await demo.retrieve(query=query, top_k=3))[0]
    assert (top.source_id, top.version) == ("release-notes", version)
    assert top.evidence_id.endswith(f"@{version}")


async def test_stream_shape_legs_then_evidence_then_exactly_one_result(demo: Live) -> None:
    events = await demo.retrieve(query="cancel my subscription", top_k=4)
    kinds = [e.WhichOneof("event") for e in events]
    first_evidence = kinds.index("evidence")
    # The default legs: BM25, kNN and (where `models build` built its embedder, as `make test`
    # does) the Latin-script kNN for this English query.
    latin = demo.app.runtime.latin_embedder is not None
    assert set(kinds[:first_evidence]) == {"leg"} and kinds[:first_evidence].count("leg") == 2 + latin
    assert kinds[-1] == "result" and kinds.count("result") == 1
    items = evidence_of(events)
    assert [e.rank for e in items] == list(range(1, len(items) + 1))
    result = result_of(events)
    assert result.returned_count == len(items) <= 4
    assert legs_of(result) == {"LEG_KIND_BM25": "LEG_STATUS_OK", "LEG_KIND_KNN": "LEG_STATUS_OK",
                               "LEG_KIND_RERANK": "LEG_STATUS_SKIPPED",
                               **({"LEG_KIND_KNN_LATIN": "LEG_STATUS_OK"} if latin else {})}
    rerank = next(leg for leg in result.legs if leg.kind == types_pb2.LEG_KIND_RERANK)
    assert rerank.detail == "no reranker model configured"
    assert not result.degraded
    assert result.engine == "embedded"
    assert result.model_ids and result.model_ids[0].startswith(f"{DEFAULT_EMBEDDER}@")
    knn = next(leg for leg in result.legs if leg.kind == types_pb2.LEG_KIND_KNN)
    assert knn.timing.inference_ms > 0
    fused = [e.fused_score for e in items]
    assert fused == sorted(fused, reverse=True)
    assert any(e.HasField("bm25_score") for e in items) and any(e.HasField("dense_score") for e in items)
    # The shipped hybrid calibration (make models installs it beside the e5 model).
    assert result.quality_source == types_pb2.QUALITY_SOURCE_HYBRID_CALIBRATED
    assert 0 < result.top_quality < 1  # a probability now, not 1 - L2/2


async def test_every_response_carries_timing_trailers(demo: Live) -> None:
    # A query no other test asks: the query-embedding cache would otherwise answer it.
    query = f"invoice {uuid.uuid4().hex[:8]}"
    for repeat in (False, True):
        call = demo.retrieval.Retrieve(retrieval_pb2.RetrieveRequest(query=query, top_k=1))
        events = [e async for e in call]
        trailers = dict(await call.trailing_metadata())
        assert trailers["x-attempt-id"] == result_of(events).attempt_id
        for key in ("x-timing-admission-ms", "x-timing-queue-ms", "x-timing-tokenize-ms", "x-timing-inference-ms", "x-timing-total-ms"):
            assert float(trailers[key]) >= 0
        if repeat:  # the same query again: its embedding comes from the cache, no inference
            assert float(trailers["x-timing-inference-ms"]) == 0
        else:
            assert float(trailers["x-timing-inference-ms"]) > 0


async def test_lookup_is_the_agent_projection_without_scores(demo: Live) -> None:
    res = await demo.retrieval.Lookup(retrieval_pb2.RetrieveRequest(
        query="how do I change my email address", top_k=2, tool_call_id="call-7"))
    data = json.loads(MessageToJson(res, preserving_proto_field_name=True))
    assert data["evidence_status"] == "EVIDENCE_STATUS_EVIDENCE_FOUND"
    assert data["tool_call_id"] == "call-7" and data["query"].startswith("how do I")
    assert data["returned_count"] == len(data["evidence"]) == 2
    assert set(data["evidence"][0]) == {"document_id", "source", "title", "breadcrumb", "excerpt"}
    assert data["evidence"][0]["source"] == "faq-change-email"
    assert data.get("relevance_level") in (None, "RELEVANCE_LEVEL_PRECISE", "RELEVANCE_LEVEL_REFERENCE")
    text = json.dumps(data)
    for forbidden in ("score", "quality", "threshold", "latency", "legs"):
        assert forbidden not in text


async def test_lookup_omits_relevance_when_none(demo: Live) -> None:
    # INSUFFICIENT reaches no relevance level; the projection leaves the field out.
    res = await demo.retrieval.Lookup(retrieval_pb2.RetrieveRequest(
        query="zebra migration patterns", top_k=2, options=retrieval_pb2.RetrievalOptions(min_quality=0.99)))
    data = MessageToDict(res, preserving_proto_field_name=True)
    assert data["evidence_status"] == "EVIDENCE_STATUS_NO_EVIDENCE"
    assert "relevance_level" not in data and not res.HasField("relevance_level")
    assert data.get("evidence", []) == []


async def test_empty_when_every_leg_finished_and_nothing_matched(demo: Live) -> None:
    events = await demo.retrieve(**expect.EMPTY_REQUEST)
    result = result_of(events)
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_EMPTY
    assert result.evidence_status == types_pb2.EVIDENCE_STATUS_NO_EVIDENCE
    assert legs_of(result)["LEG_KIND_BM25"] == legs_of(result)["LEG_KIND_KNN"] == "LEG_STATUS_OK"
    assert not result.degraded and result.returned_count == 0


async def test_insufficient_when_nothing_passes_the_quality_gate(demo: Live) -> None:
    events = await demo.retrieve(**expect.INSUFFICIENT_REQUEST)
    result = result_of(events)
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_INSUFFICIENT
    assert result.retrieved_count > 0 and result.returned_count == 0 and evidence_of(events) == []
    assert 0 < result.top_quality < 0.99


async def test_inadmissible_when_only_a_draft_matches(demo: Live) -> None:
    events = await demo.retrieve(query="Quantum tier price per seat", top_k=3,
                                 filters=retrieval_pb2.Filters(source_ids=["pricing-2027", "legacy-fax-support"]))
    result = result_of(events)
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_INADMISSIBLE
    assert result.retrieved_count >= 2 and result.admissible_count == 0
    assert evidence_of(events) == []


async def test_inadmissible_when_the_pinned_version_is_not_the_one_found(demo: Live) -> None:
    events = await demo.retrieve(query="release notes", top_k=3, version_pins={"release-notes": "v9.9"},
                                 filters=retrieval_pb2.Filters(source_ids=["release-notes"]))
    assert result_of(events).outcome == types_pb2.ATTEMPT_OUTCOME_INADMISSIBLE
    # About versions, not the quality gate: "release notes" is a weak two-word match (its quality
    # sits near the default gate and moves with what other tests ingested), so no gate here.
    pinned = await demo.retrieve(query="release notes", top_k=5, version_pins={"release-notes": "v2.3"},
                                 filters=retrieval_pb2.Filters(source_ids=["release-notes"]),
                                 options=retrieval_pb2.RetrievalOptions(min_quality=1e-9))
    assert {e.version for e in evidence_of(pinned)} == {"v2.3"}


async def test_drafts_never_surface_in_open_queries(demo: Live) -> None:
    # Only a draft answers this: the default gate says "nothing here"; without the gate the
    # admissible neighbours come back, never the draft.
    assert result_of(await demo.retrieve(query="Quantum tier pricing", top_k=10)).outcome == \
        types_pb2.ATTEMPT_OUTCOME_INSUFFICIENT
    items = evidence_of(await demo.retrieve(query="Quantum tier pricing", top_k=10,
                                            options=retrieval_pb2.RetrievalOptions(min_quality=1e-9)))
    assert items and all(e.source_id not in ("pricing-2027", "legacy-fax-support") for e in items)


async def test_user_information_gap_is_permission_denied_and_recorded(demo: Live) -> None:
    events = await demo.retrieve(query="what is my account email", top_k=3, gap=retrieval_pb2.EvidenceGap(
        gap_id="g-1", kind=types_pb2.GAP_KIND_USER_INFORMATION, question="user's email"))
    result = result_of(events)
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_PERMISSION_DENIED
    assert [e.WhichOneof("event") for e in events] == ["result"]  # nothing was searched
    record = (await demo.retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=result.attempt_id))).attempt
    assert record.outcome == types_pb2.ATTEMPT_OUTCOME_PERMISSION_DENIED and record.gap_id == "g-1"


async def test_budget_is_enforced_and_an_exhausted_budget_searches_nothing(demo: Live) -> None:
    outcomes, befores = [], []
    for _ in range(3):
        r = result_of(await demo.retrieve(query="invoice", top_k=2, run_id="run-budget-1",
                                          budget=retrieval_pb2.RunBudget(max_searches=2)))
        outcomes.append(r.outcome)
        befores.append((r.budget_before, r.budget_after))
    assert outcomes == [types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND] * 2 + [types_pb2.ATTEMPT_OUTCOME_BUDGET_DENIED]
    assert befores == [(2, 1), (1, 0), (0, 0)]
    denied = result_of(await demo.retrieve(query="invoice", top_k=2, run_id="run-budget-1"))
    assert denied.outcome == types_pb2.ATTEMPT_OUTCOME_BUDGET_DENIED and not denied.legs


async def test_results_per_search_budget_caps_top_k(demo: Live) -> None:
    r = await demo.retrieve(query="how do I reset my password", top_k=5, run_id="run-budget-2",
                            budget=retrieval_pb2.RunBudget(max_searches=3, max_results_per_search=1))
    assert len(evidence_of(r)) == 1


async def test_acl_is_applied_inside_the_engine_for_anonymous_callers(demo: Live) -> None:
    events = await demo.retrieve(query="orion-pager escalation runbook", top_k=5)
    assert all(e.source_id != "internal-escalation" for e in evidence_of(events))
    only = await demo.retrieve(query="orion-pager", top_k=5, filters=retrieval_pb2.Filters(source_ids=["internal-escalation"]))
    assert result_of(only).outcome == types_pb2.ATTEMPT_OUTCOME_EMPTY


async def test_category_filter_is_retried_unfiltered_when_weak(demo: Live) -> None:
    events = await demo.retrieve(query="offline sync desktop", top_k=3,
                                 filters=retrieval_pb2.Filters(metadata={"category": "no-such-category"}))
    result = result_of(events)
    assert result.retried_unfiltered
    assert result.outcome == types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND
    assert evidence_of(events)[0].source_id == "release-notes"
    strong = result_of(await demo.retrieve(query="how are subscriptions billed", top_k=3,
                                           filters=retrieval_pb2.Filters(metadata={"category": "pricing"})))
    assert not strong.retried_unfiltered


def violations(err: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    out = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            out.extend(v.field for v in bad.field_violations)
    return out


@pytest.mark.parametrize("request_fields,field", [
    ({"query": "", "top_k": 3}, "query"),
    ({"query": "x", "top_k": 0}, "top_k"),
    ({"query": "x", "top_k": 51}, "top_k"),
    ({"query": "x" * 2001, "top_k": 3}, "query"),
    ({"query": "x", "top_k": 3, "filters": retrieval_pb2.Filters(collections=[7])}, "filters.collections[0]"),
    ({"query": "x", "top_k": 3, "options": retrieval_pb2.RetrievalOptions(rerank=types_pb2.RERANK_MODE_ON)}, "options.rerank"),
])
async def test_invalid_arguments_name_the_field(demo: Live, request_fields: dict[str, object], field: str) -> None:
    for call in ("Retrieve", "Lookup"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if call == "Retrieve":
                await demo.retrieve(**request_fields)
            else:
                await demo.retrieval.Lookup(retrieval_pb2.RetrieveRequest(**request_fields))  # type: ignore[arg-type]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in violations(err.value)
        assert field in (err.value.details() or "")


async def test_get_attempt_returns_the_recorded_fact(demo: Live) -> None:
    result = result_of(await demo.retrieve(query="refund", top_k=2, run_id="run-rec"))
    rec = (await demo.retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=result.attempt_id))).attempt
    assert rec.query == "refund" and rec.run_id == "run-rec" and rec.requested_top_k == 2
    assert rec.outcome == result.outcome and len(rec.evidence_ids) == result.returned_count
    assert {leg.kind for leg in rec.legs} == {types_pb2.LEG_KIND_BM25, types_pb2.LEG_KIND_KNN, types_pb2.LEG_KIND_RERANK}
    assert rec.budget_before == 20 and rec.budget_after == 19
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await demo.retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id="missing"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_get_evidence_returns_the_exact_version(demo: Live) -> None:
    res = await demo.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id="release-notes#0@v2.3"))
    assert res.fidelity == corpus_pb2.FIDELITY_EXACT
    assert "v2.3" in res.evidence.excerpt and res.evidence.version == "v2.3"
    assert list(res.available_versions) == ["v2.3", "v2.4"]
    gone = await demo.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id="release-notes#0@v1.0"))
    assert gone.fidelity == corpus_pb2.FIDELITY_DEGRADED and not gone.HasField("evidence")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await demo.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id="no-version"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_health_serving_and_reflection(demo: Live) -> None:
    health = health_pb2_grpc.HealthStub(demo.channel)
    for name in ("", "retrieval.v1.RetrievalService", "retrieval.v1.CorpusService", "liveness"):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(demo.channel)

    async def reqs():  # type: ignore[no-untyped-def]
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    names = set()
    async for resp in stub.ServerReflectionInfo(reqs()):
        names |= {s.name for s in resp.list_services_response.service}
    assert {"retrieval.v1.RetrievalService", "retrieval.v1.CorpusService", "grpc.health.v1.Health"} <= names

    # Load tools (ghz) resolve a call by its method symbol; the service's file must come back.
    async def by_symbol(symbol: str) -> reflection_pb2.ServerReflectionResponse:
        async def one():  # type: ignore[no-untyped-def]
            yield reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
        return [r async for r in stub.ServerReflectionInfo(one())][0]

    for symbol in ("retrieval.v1.RetrievalService.Lookup", "retrieval.v1.CorpusService.IngestStream",
                   "retrieval.v1.LedgerService.GetRun", "retrieval.v1.RetrieveRequest"):
        resp = await by_symbol(symbol)
        assert resp.WhichOneof("message_response") == "file_descriptor_response", (symbol, resp.error_response)
    for unknown in ("retrieval.v1.RetrievalService.NoSuchMethod", "no.such.Service.Method", "Nothing"):
        assert (await by_symbol(unknown)).WhichOneof("message_response") == "error_response", unknown


async def test_a_leg_left_out_by_request_is_skipped_not_failed(demo: Live) -> None:
    bm25_only = retrieval_pb2.RetrievalOptions(legs=[types_pb2.LEG_KIND_BM25])
    found = result_of(await demo.retrieve(query="can I get a PDF invoice", top_k=2, options=bm25_only))
    assert found.outcome == types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND and not found.degraded
    assert legs_of(found)["LEG_KIND_KNN"] == "LEG_STATUS_SKIPPED"
    assert found.quality_source == types_pb2.QUALITY_SOURCE_HYBRID_CALIBRATED and 0 < found.top_quality < 1
    nothing = result_of(await demo.retrieve(query="qzxjv wkpfy", top_k=2, options=bm25_only))
    assert nothing.outcome == types_pb2.ATTEMPT_OUTCOME_EMPTY and not nothing.degraded


async def test_an_off_topic_question_says_nothing_here_by_default(demo: Live) -> None:
    """The default quality gate (the calibration's, per language, fitted against off-domain
    questions): gibberish and questions from another domain end INSUFFICIENT with no
    relevance level, a question the corpus answers keeps its evidence; a caller can lower
    the gate and see what was refused."""
    found = result_of(await demo.retrieve(query="how do I reset my password", top_k=3))
    assert found.outcome == types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND, found.top_quality
    ungated = retrieval_pb2.RetrievalOptions(min_quality=1e-9)
    for query in ("zxqvj kplmw wrrtz qqjx", "what is the capital of mongolia", "蒙古的首都是哪里"):
        gated = result_of(await demo.retrieve(query=query, top_k=3))
        assert gated.outcome == types_pb2.ATTEMPT_OUTCOME_INSUFFICIENT, (query, gated.top_quality)
        assert gated.stopping_reason == "below_quality_gate"
        assert gated.relevance_level == types_pb2.RELEVANCE_LEVEL_UNSPECIFIED
        assert gated.evidence_status == types_pb2.EVIDENCE_STATUS_NO_EVIDENCE
        assert gated.quality_source == types_pb2.QUALITY_SOURCE_HYBRID_CALIBRATED
        assert gated.top_quality < found.top_quality / 4, (query, gated.top_quality, found.top_quality)
        plain = result_of(await demo.retrieve(query=query, top_k=3, options=ungated))
        assert plain.outcome == types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND and plain.top_quality == gated.top_quality
