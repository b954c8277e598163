"""LedgerService end to end (real server, embedded engine, e5 int8, SQLite ledger): the
design's list for targeted evidence and provenance (shared/DESIGN.md section 4)."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from service._gen.retrieval.v1 import corpus_pb2, ledger_pb2, ledger_pb2_grpc, retrieval_pb2, types_pb2
from service.engines.base import EngineUnavailable
from tests.support import demo_expectations as expect
from tests.support.harness import Live, StartServer, demo_documents, evidence_of, result_of

EXTERNAL = types_pb2.GAP_KIND_EXTERNAL_KNOWLEDGE
OUT = types_pb2


def rid(tag: str = "run") -> str:
    return f"{tag}-{uuid.uuid4().hex[:10]}"


def stub(live: Live) -> ledger_pb2_grpc.LedgerServiceStub:
    return ledger_pb2_grpc.LedgerServiceStub(live.channel)


def gap(gap_id: str, criticality: float = 0.9, kind: int = EXTERNAL) -> retrieval_pb2.EvidenceGap:
    return retrieval_pb2.EvidenceGap(gap_id=gap_id, kind=kind, question=f"question {gap_id}", criticality=criticality)  # type: ignore[arg-type]


@contextmanager
def engine_calls(live: Live) -> Iterator[list[str]]:
    """Count what reaches the engine's search legs (the real engine still answers)."""
    engine = live.app.engine
    calls: list[str] = []
    originals = {name: getattr(engine, name) for name in ("bm25", "knn")}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        async def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return await fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(engine, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name in originals:
            delattr(engine, name)


async def get_run(live: Live, run_id: str, **kw: Any) -> ledger_pb2.Run:
    run: ledger_pb2.Run = await stub(live).GetRun(ledger_pb2.GetRunRequest(run_id=run_id, **kw))
    return run


async def test_evidence_carries_provenance_and_the_run_observed_exactly_what_it_returned(demo: Live) -> None:
    run = rid()
    events = await demo.retrieve(query="how do I reset my password", top_k=3, run_id=run, gap=gap("g-pw"))
    result, items = result_of(events), evidence_of(events)
    assert result.outcome == OUT.ATTEMPT_OUTCOME_EVIDENCE_FOUND and items
    assert all(e.attempt_id == result.attempt_id and e.acquired_for_gap_id == "g-pw" for e in items)
    view = await get_run(demo, run)
    [attempt] = view.attempts
    assert attempt.attempt_id == result.attempt_id and attempt.gap_id == "g-pw" and attempt.plan_reason == ""
    assert [(r.evidence_id, r.source_id, r.version) for r in attempt.evidence] == \
        [(e.evidence_id, e.source_id, e.version) for e in items]
    assert attempt.budget_before == result.budget_before and attempt.budget_after == result.budget_after
    assert {leg.kind for leg in attempt.legs} >= {OUT.LEG_KIND_BM25, OUT.LEG_KIND_KNN}
    assert view.budget.searches_used == 1 and [g.gap_id for g in view.gaps] == ["g-pw"]
    assert view.gaps[0].state == ledger_pb2.GAP_STATE_OPEN and view.open_critical_gaps == 1
    checks = await stub(demo).ValidateCitations(ledger_pb2.ValidateCitationsRequest(
        run_id=run, evidence_ids=[e.evidence_id for e in items]))
    assert checks.all_valid and all(c.attempt_ids == [result.attempt_id] for c in checks.citations)


async def test_no_gap_no_search_in_a_run_that_requires_gaps(demo: Live) -> None:
    run = rid()
    budget = retrieval_pb2.RunBudget(max_searches=3, require_gap=True)
    with engine_calls(demo) as calls:
        refused = result_of(await demo.retrieve(query="invoice", top_k=2, run_id=run, budget=budget))
    assert refused.outcome == OUT.ATTEMPT_OUTCOME_PERMISSION_DENIED and refused.stopping_reason == "no_gap_in_run"
    assert calls == []
    with engine_calls(demo) as calls:
        found = result_of(await demo.retrieve(query="invoice", top_k=2, run_id=run, gap=gap("g-inv")))
    assert found.outcome == OUT.ATTEMPT_OUTCOME_EVIDENCE_FOUND and sorted(calls) == ["bm25", "knn"]
    view = await get_run(demo, run)
    assert view.require_gap and view.budget.searches_used == 1 and len(view.attempts) == 2


async def test_a_user_information_gap_never_reaches_the_engine(demo: Live) -> None:
    run = rid()
    with engine_calls(demo) as calls:
        r = result_of(await demo.retrieve(**{**expect.USER_INFO_GAP_REQUEST, "run_id": run}))
    assert r.outcome == OUT.ATTEMPT_OUTCOME_PERMISSION_DENIED and calls == []
    view = await get_run(demo, run)
    assert view.attempts[0].outcome == OUT.ATTEMPT_OUTCOME_PERMISSION_DENIED and not view.attempts[0].legs


async def test_budget_reached_denies_later_attempts_and_their_gap_stays_unresolved(demo: Live) -> None:
    run = rid()
    budget = retrieval_pb2.RunBudget(max_searches=1)
    first = result_of(await demo.retrieve(query="invoice", top_k=2, run_id=run, budget=budget, gap=gap("g-a")))
    with engine_calls(demo) as calls:
        denied = result_of(await demo.retrieve(query="refund", top_k=2, run_id=run, gap=gap("g-b")))
    assert first.outcome == OUT.ATTEMPT_OUTCOME_EVIDENCE_FOUND and denied.outcome == OUT.ATTEMPT_OUTCOME_BUDGET_DENIED
    assert calls == []
    view = await get_run(demo, run)
    states = {g.gap_id: (g.state, g.reason) for g in view.gaps}
    assert states == {"g-a": (ledger_pb2.GAP_STATE_OPEN, ""),
                      "g-b": (ledger_pb2.GAP_STATE_UNRESOLVED, "budget_exhausted")}
    assert view.budget.searches_left == 0 and view.open_critical_gaps == 2
    assert [a.outcome for a in view.attempts] == [OUT.ATTEMPT_OUTCOME_EVIDENCE_FOUND, OUT.ATTEMPT_OUTCOME_BUDGET_DENIED]


async def test_citations_from_another_run_unknown_ids_and_wrong_versions_are_invalid(demo: Live) -> None:
    run_a, run_b = rid(), rid()
    a_ids = [e.evidence_id for e in evidence_of(await demo.retrieve(query="can I get a PDF invoice", top_k=2, run_id=run_a))]
    b_ids = [e.evidence_id for e in evidence_of(await demo.retrieve(query="how long are deleted files kept", top_k=2, run_id=run_b))]
    foreign = next(i for i in a_ids if i not in b_ids)
    wrong_version = b_ids[0].rsplit("@", 1)[0] + "@v0"
    checks = await stub(demo).ValidateCitations(ledger_pb2.ValidateCitationsRequest(
        run_id=run_b, evidence_ids=[b_ids[0], foreign, "nothing#0@v1", wrong_version]))
    assert [c.classification for c in checks.citations] == [
        ledger_pb2.CITATION_CLASS_OBSERVED_IN_RUN, ledger_pb2.CITATION_CLASS_OBSERVED_IN_OTHER_RUN,
        ledger_pb2.CITATION_CLASS_UNKNOWN, ledger_pb2.CITATION_CLASS_VERSION_MISMATCH]
    assert not checks.all_valid and checks.citations[3].observed_evidence_ids == [b_ids[0]]


async def test_retrieved_but_draft_evidence_leaves_the_gap_unresolved(demo: Live) -> None:
    run = rid()
    r = result_of(await demo.retrieve(**{**expect.DRAFT_ONLY_REQUEST, "run_id": run, "gap": gap("g-price")}))
    assert r.outcome == OUT.ATTEMPT_OUTCOME_INADMISSIBLE and r.retrieved_count > 0
    draft = "pricing-2027#0@v1"
    checks = await stub(demo).ValidateCitations(ledger_pb2.ValidateCitationsRequest(run_id=run, evidence_ids=[draft]))
    assert checks.citations[0].classification == ledger_pb2.CITATION_CLASS_NOT_ADMISSIBLE
    g = await stub(demo).ResolveGap(ledger_pb2.ResolveGapRequest(
        run_id=run, gap_id="g-price", resolution=ledger_pb2.GAP_STATE_RESOLVED, supporting_evidence_ids=[draft]))
    assert g.state == ledger_pb2.GAP_STATE_UNRESOLVED and g.reason.startswith("support_rejected")
    assert [c.classification for c in g.rejected] == [ledger_pb2.CITATION_CLASS_NOT_ADMISSIBLE]
    assert (await get_run(demo, run)).open_critical_gaps == 1


async def test_partial_keeps_a_critical_gap_open_and_conflicting_evidence_is_kept(demo: Live) -> None:
    run = rid()
    items = evidence_of(await demo.retrieve(query="how do I reset my password", top_k=3, run_id=run, gap=gap("g-1")))
    assert len(items) >= 2
    first, second = items[0].evidence_id, items[1].evidence_id
    led = stub(demo)
    partial = await led.ResolveGap(ledger_pb2.ResolveGapRequest(
        run_id=run, gap_id="g-1", resolution=ledger_pb2.GAP_STATE_PARTIAL, supporting_evidence_ids=[first],
        missing_subclaims=["how long the link stays valid"]))
    assert partial.state == ledger_pb2.GAP_STATE_PARTIAL and partial.critical and not partial.rejected
    assert (await get_run(demo, run)).open_critical_gaps == 1
    conflicting = await led.ResolveGap(ledger_pb2.ResolveGapRequest(
        run_id=run, gap_id="g-1", resolution=ledger_pb2.GAP_STATE_CONFLICTING, supporting_evidence_ids=[first],
        contradicting_evidence_ids=[second]))
    assert conflicting.state == ledger_pb2.GAP_STATE_CONFLICTING
    assert list(conflicting.supporting_evidence_ids) == [first] and list(conflicting.contradicting_evidence_ids) == [second]
    assert (await get_run(demo, run)).open_critical_gaps == 1
    resolved = await led.ResolveGap(ledger_pb2.ResolveGapRequest(
        run_id=run, gap_id="g-1", resolution=ledger_pb2.GAP_STATE_RESOLVED, supporting_evidence_ids=[first]))
    assert resolved.state == ledger_pb2.GAP_STATE_RESOLVED and resolved.resolved_by == "anonymous"
    assert (await get_run(demo, run)).open_critical_gaps == 0


async def test_bad_requests_name_the_field(demo: Live) -> None:
    run = rid()
    await demo.retrieve(query="invoice", top_k=1, run_id=run, gap=gap("g"))
    led = stub(demo)
    cases: list[tuple[Any, str]] = [
        (led.ResolveGap(ledger_pb2.ResolveGapRequest(run_id=run, gap_id="g", resolution=ledger_pb2.GAP_STATE_PARTIAL,
                                                     supporting_evidence_ids=["x#0@v1"])), "missing_subclaims"),
        (led.ResolveGap(ledger_pb2.ResolveGapRequest(run_id=run, gap_id="g")), "resolution"),
        (led.GetRun(ledger_pb2.GetRunRequest(run_id="")), "run_id"),
        (led.GetRun(ledger_pb2.GetRunRequest(run_id=run, page_token="garbage")), "page_token"),
        (led.ValidateCitations(ledger_pb2.ValidateCitationsRequest(run_id=run)), "evidence_ids"),
        (led.ReplayAttempt(ledger_pb2.ReplayAttemptRequest()), "attempt_id"),
    ]
    for call, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        status = rpc_status.from_call(err.value)
        assert status is not None
        bad = error_details_pb2.BadRequest()
        status.details[0].Unpack(bad)
        assert field in [v.field for v in bad.field_violations]
    for call in (led.GetRun(ledger_pb2.GetRunRequest(run_id=rid())),
                 led.ResolveGap(ledger_pb2.ResolveGapRequest(run_id=run, gap_id="nope",
                                                             resolution=ledger_pb2.GAP_STATE_UNRESOLVED)),
                 led.ReplayAttempt(ledger_pb2.ReplayAttemptRequest(attempt_id="nope"))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_engine_or_embedding_failure_is_never_a_successful_empty_attempt(demo: Live) -> None:
    run = rid()
    engine, runtime = demo.app.engine, demo.app.runtime

    async def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise EngineUnavailable("node down (test)")

    for target, name in ((engine, "bm25"), (engine, "knn")):
        setattr(target, name, unavailable)
    try:
        broken = result_of(await demo.retrieve(query="invoice", top_k=2, run_id=run, gap=gap("g-x")))
    finally:
        del engine.bm25, engine.knn
    setattr(runtime, "embed_query", unavailable)
    try:  # the lexical leg finds nothing here, the vector leg cannot embed: not EMPTY
        no_embed = result_of(await demo.retrieve(**{**expect.EMPTY_REQUEST, "run_id": run, "gap": gap("g-x")}))
    finally:
        del runtime.embed_query
    assert broken.outcome == OUT.ATTEMPT_OUTCOME_BACKEND_ERROR and no_embed.outcome == OUT.ATTEMPT_OUTCOME_BACKEND_ERROR
    view = await get_run(demo, run)
    assert [a.outcome for a in view.attempts] == [OUT.ATTEMPT_OUTCOME_BACKEND_ERROR] * 2
    assert all(not a.evidence for a in view.attempts) and view.gaps[0].state == ledger_pb2.GAP_STATE_OPEN


async def test_replay_is_exact_while_the_version_is_stored_and_degraded_after(demo: Live) -> None:
    source = f"replay-{uuid.uuid4().hex[:8]}"
    token = f"zqx{uuid.uuid4().hex[:6]}"

    def doc(version: str, text: str) -> corpus_pb2.Document:
        return corpus_pb2.Document(source_id=source, version=version, title=f"Replay {version}", text=text,
                                   collection=types_pb2.COLLECTION_DOC)

    v1_text = f"The {token} gateway accepts uploads up to 10 MB."
    assert (await demo.ingest([doc("v1", v1_text)])).documents_indexed == 1
    run = rid()
    request = {"query": f"{token} gateway uploads", "top_k": 3, "run_id": run,
               "filters": retrieval_pb2.Filters(source_ids=[source])}
    events = await demo.retrieve(**request)
    attempt_id = result_of(events).attempt_id
    assert [e.evidence_id for e in evidence_of(events)] == [f"{source}#0@v1"]
    assert (await demo.ingest([doc("v2", f"The {token} gateway accepts uploads up to 50 MB.")])).documents_indexed == 1
    led = stub(demo)
    replay = await led.ReplayAttempt(ledger_pb2.ReplayAttemptRequest(attempt_id=attempt_id))
    [item] = replay.evidence
    assert item.fidelity == corpus_pb2.FIDELITY_EXACT and item.evidence.excerpt == v1_text
    assert sorted(item.available_versions) == ["v1", "v2"]
    await demo.corpus.DeleteDocument(corpus_pb2.DeleteDocumentRequest(source_id=source, version="v1"))
    replay = await led.ReplayAttempt(ledger_pb2.ReplayAttemptRequest(attempt_id=attempt_id, rerun=True))
    [item] = replay.evidence
    assert item.fidelity == corpus_pb2.FIDELITY_DEGRADED and not item.HasField("evidence")
    assert list(item.available_versions) == ["v2"]  # never the newest substituted
    assert [(c.observed_evidence_id, c.current_evidence_id) for c in replay.rerun.new_versions] == \
        [(f"{source}#0@v1", f"{source}#0@v2")]
    assert not replay.rerun.added and not replay.rerun.dropped
    view = await get_run(demo, run)
    assert view.budget.searches_used == 1 and len(view.attempts) == 1  # the re-run touched nothing of the run


async def test_get_run_pages_through_attempts_in_order(demo: Live) -> None:
    run = rid()
    ids = [result_of(await demo.retrieve(query=q, top_k=1, run_id=run)).attempt_id
           for q in ("invoice", "refund", "password", "storage", "sso")]
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        view = await get_run(demo, run, page_size=2, page_token=token)
        seen += [a.attempt_id for a in view.attempts]
        pages += 1
        token = view.next_page_token
        if not token:
            break
    assert seen == ids and pages == 3


async def test_purge_deletes_a_run_and_is_recorded(demo: Live) -> None:
    run = rid()
    await demo.retrieve(query="invoice", top_k=2, run_id=run, gap=gap("g"))
    led = stub(demo)
    purge = (await led.PurgeRun(ledger_pb2.PurgeRunRequest(run_id=run, reason="user request"))).purge
    assert (purge.attempts_deleted, purge.gaps_deleted) == (1, 1) and purge.observations_deleted >= 1
    assert purge.principal == "anonymous" and purge.reason == "user request"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await get_run(demo, run)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "purged" in (err.value.details() or "")


async def test_retention_purges_runs_older_than_configured(start_server: StartServer) -> None:
    live = await start_server(demo=False)
    run = rid()
    await live.retrieve(query="anything", top_k=1, run_id=run)
    ops = live.app.ledger_ops
    assert await ops.purge_expired(days=1.0) == []  # young runs stay
    import time
    purged = await ops.purge_expired(days=1.0, now_ms=int(time.time() * 1000) + 2 * 86_400_000)
    assert [p.run_id for p in purged] == [run] and purged[0].principal == "retention"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await get_run(live, run)
    assert "retention" in (err.value.details() or "")


async def test_a_locked_ledger_never_turns_a_search_into_empty(start_server: StartServer) -> None:
    live = await start_server(ledger_timeout_s=0.3)
    holder = sqlite3.connect(live.app.cfg.data_dir / "ledger.sqlite3", isolation_level=None, timeout=5)
    holder.execute("BEGIN EXCLUSIVE")  # a stuck writer holds the ledger file
    try:
        in_run = result_of(await live.retrieve(query="can I get a PDF invoice", top_k=2, run_id=rid()))
        free = result_of(await live.retrieve(query="can I get a PDF invoice", top_k=2))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    # In a run the budget cannot be enforced: nothing searched, an infrastructure failure.
    assert in_run.outcome == OUT.ATTEMPT_OUTCOME_BACKEND_ERROR and in_run.stopping_reason == "ledger_unavailable"
    assert not in_run.legs
    # Without a run the search stands; its record waits in the writer and lands afterwards.
    assert free.outcome == OUT.ATTEMPT_OUTCOME_EVIDENCE_FOUND
    for _ in range(100):
        try:
            rec = await live.retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=free.attempt_id))
            break
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.1)
    else:
        raise AssertionError("the attempt was never recorded after the ledger came back")
    assert rec.attempt.outcome == OUT.ATTEMPT_OUTCOME_EVIDENCE_FOUND
    failed = await live.retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=in_run.attempt_id))
    assert failed.attempt.stopping_reason == "ledger_unavailable"


async def test_a_run_belongs_to_its_principal_another_learns_nothing_of_it(
        start_server: StartServer, tmp_path: Any) -> None:
    """Every ledger RPC on another principal's run (or attempt) answers exactly like an
    unknown id; an attempt naming it is refused (PERMISSION_DENIED, run_not_owned), spends
    nothing and writes nothing into that run."""
    keys = tmp_path / "keys.toml"
    keys.write_text('[[principals]]\nname = "alice"\napi_key = "k-alice"\ngroups = []\n\n'
                    '[[principals]]\nname = "mallory"\napi_key = "k-mallory"\ngroups = []\n')
    live = await start_server(api_keys_file=str(keys), demo=False)
    alice, mallory = (("x-api-key", "k-alice"),), (("x-api-key", "k-mallory"),)
    await live.ingest(demo_documents(), metadata=alice)
    run, unknown = rid(), rid("never")
    got = await live.retrieve(query="how do I reset my password", top_k=3, run_id=run, gap=gap("g1"),
                              budget=retrieval_pb2.RunBudget(max_searches=3), metadata=alice)
    mine = result_of(got)
    assert mine.outcome == OUT.ATTEMPT_OUTCOME_EVIDENCE_FOUND
    cited = [e.evidence_id for e in evidence_of(got)][:1]
    led = stub(live)

    async def status_of(call: Any, request: Any, md: Any) -> tuple[str, str]:
        try:
            await call(request, metadata=md)
            return "OK", ""
        except grpc.aio.AioRpcError as err:
            details = err.details() or ""
            for echoed in (unknown, run, "never-attempt", mine.attempt_id):  # each call echoes its own id
                details = details.replace(echoed, "ID")
            return err.code().name, details

    def calls(run_id: str, attempt_id: str) -> list[tuple[Any, Any]]:
        return [
            (led.GetRun, ledger_pb2.GetRunRequest(run_id=run_id)),
            (led.ValidateCitations, ledger_pb2.ValidateCitationsRequest(run_id=run_id, evidence_ids=cited)),
            (led.ResolveGap, ledger_pb2.ResolveGapRequest(run_id=run_id, gap_id="g1", resolution=ledger_pb2.GAP_STATE_RESOLVED,
                                                          supporting_evidence_ids=cited)),
            (led.ReplayAttempt, ledger_pb2.ReplayAttemptRequest(attempt_id=attempt_id)),
            (led.PurgeRun, ledger_pb2.PurgeRunRequest(run_id=run_id, reason="mine now")),
        ]

    for (call, theirs), (_, never) in zip(calls(run, mine.attempt_id), calls(unknown, "never-attempt")):
        seen = await status_of(call, theirs, mallory)
        assert seen[0] == "NOT_FOUND" and seen == await status_of(call, never, mallory), (call, seen)

    denied = result_of(await live.retrieve(query="password", top_k=3, run_id=run, gap=gap("g-m"), metadata=mallory))
    assert denied.outcome == OUT.ATTEMPT_OUTCOME_PERMISSION_DENIED and denied.stopping_reason == "run_not_owned"
    assert denied.budget_before == 0 == denied.budget_after
    view = await led.GetRun(ledger_pb2.GetRunRequest(run_id=run), metadata=alice)  # the owner's run is untouched
    assert view.budget.searches_used == 1 and [a.attempt_id for a in view.attempts] == [mine.attempt_id]
    assert [g.gap_id for g in view.gaps] == ["g1"]
    record = await live.retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=denied.attempt_id),
                                             metadata=mallory)
    assert record.attempt.stopping_reason == "run_not_owned" and not record.attempt.run_id  # still a fact, its own
    assert (await led.ValidateCitations(ledger_pb2.ValidateCitationsRequest(run_id=run, evidence_ids=cited),
                                        metadata=alice)).all_valid
