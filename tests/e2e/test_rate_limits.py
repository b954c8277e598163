"""Per-principal limits through the real server: over the rate -> RESOURCE_EXHAUSTED with
google.rpc.RetryInfo and a retry-after-ms trailer, other principals untouched; the
concurrency quota; the principal's ceiling on a run's max_searches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from service._gen.retrieval.v1 import corpus_pb2, plan_pb2, retrieval_pb2, types_pb2
from service.models.dummy import HashEmbedder
from tests.support.harness import StartServer, result_of

KEYS = '''
[[principals]]
name = "flood"
api_key = "k-flood"
requests_per_second = 5
burst = 5
max_concurrent = 1
max_searches_per_run = 2

[[principals]]
name = "calm"
api_key = "k-calm"
'''
FLOOD = (("x-api-key", "k-flood"),)
CALM = (("x-api-key", "k-calm"),)


def retry_delay_ms(err: grpc.aio.AioRpcError) -> tuple[int, int]:
    """(RetryInfo delay, retry-after-ms trailer) of a RESOURCE_EXHAUSTED."""
    status = rpc_status.from_call(err)
    assert status is not None, err
    info = error_details_pb2.RetryInfo()
    assert any(d.Unpack(info) for d in status.details), status
    trailer = dict(err.trailing_metadata() or ())["retry-after-ms"]
    return info.retry_delay.ToMilliseconds(), int(trailer)


@pytest.fixture
async def live(start_server: StartServer, tmp_path: Path):  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    return await start_server(embedder=HashEmbedder(), api_keys_file=str(keys), demo=False)


async def test_flooding_principal_is_refused_with_a_retry_delay_and_others_are_not(live) -> None:  # type: ignore[no-untyped-def]
    req = retrieval_pb2.RetrieveRequest(query="kayak rental", top_k=2)

    async def one(md: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
        try:
            await live.retrieval.BuildPlan(plan_pb2.BuildPlanRequest(query=req.query), metadata=md, timeout=10)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                delay, trailer = retry_delay_ms(err)
                assert 0 < delay == trailer <= 1000, (delay, trailer)
            return err.code()

    flood = await asyncio.gather(*(one(FLOOD) for _ in range(50)))
    calm = await asyncio.gather(*(one(CALM) for _ in range(50)))
    assert flood.count(grpc.StatusCode.OK) <= 6, flood  # the burst (plus refill while it ran)
    assert flood.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 44, flood
    assert calm == [grpc.StatusCode.OK] * 50, calm


async def test_concurrency_quota_and_run_budget_ceiling(live) -> None:  # type: ignore[no-untyped-def]
    hold: asyncio.Queue[corpus_pb2.IngestRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[corpus_pb2.IngestRequest]:
        while (item := await hold.get()) is not None:
            yield item

    doc = corpus_pb2.Document(source_id="q-1", version="v1", text="Kayaks are rented at the pier.",
                              collection=types_pb2.COLLECTION_DOC)
    await hold.put(corpus_pb2.IngestRequest(document=doc))
    stream = asyncio.ensure_future(live.corpus.Ingest(requests(), metadata=FLOOD, timeout=30))
    await asyncio.sleep(0.3)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # flood's one slot is the open stream
        await live.retrieval.Lookup(retrieval_pb2.RetrieveRequest(query="kayak", top_k=1), metadata=FLOOD)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in (err.value.details() or "")
    retry_delay_ms(err.value)
    await live.retrieval.Lookup(retrieval_pb2.RetrieveRequest(query="kayak", top_k=1), metadata=CALM)
    await hold.put(None)
    assert (await stream).documents_indexed == 1
    await asyncio.sleep(1.2)  # refill flood's bucket

    # The run asks for 10 searches; flood's ceiling is 2: the third attempt is BUDGET_DENIED.
    outcomes = []
    for _ in range(3):
        req = retrieval_pb2.RetrieveRequest(query="kayak", top_k=1, run_id="capped-run",
                                            budget=retrieval_pb2.RunBudget(max_searches=10))
        events = [ev async for ev in live.retrieval.Retrieve(req, metadata=FLOOD, timeout=10)]
        outcomes.append(result_of(events).outcome)
        await asyncio.sleep(0.25)
    assert outcomes[:2] != [types_pb2.ATTEMPT_OUTCOME_BUDGET_DENIED] * 2
    assert outcomes[2] == types_pb2.ATTEMPT_OUTCOME_BUDGET_DENIED, outcomes
