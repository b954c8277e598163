"""The micro-batcher and the model runtime, with real threads and real deadlines."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from service.errors import DeadlineExceeded, Overloaded
from service.models.dummy import HashEmbedder, OverlapCrossEncoder
from service.models.runtime import MicroBatcher, ModelRuntime


def _identity_batches(log: list[int]):  # type: ignore[no-untyped-def]
    def run(items: list[int]) -> tuple[list[int], float, float]:
        log.append(len(items))
        time.sleep(0.02)
        return [i * 10 for i in items], 0.0, 0.02

    return run


async def test_concurrent_requests_are_batched_and_results_routed() -> None:
    import concurrent.futures

    log: list[int] = []
    ex = concurrent.futures.ThreadPoolExecutor(1)
    b: MicroBatcher[int, int] = MicroBatcher("t", _identity_batches(log), ex, max_batch=8,
                                             max_wait_s=0.01, max_queue=100, concurrency=1)
    b.start()
    deadline = time.monotonic() + 5
    results = await asyncio.gather(*(b.submit([i], deadline) for i in range(20)))
    assert [r[0] for r in results] == [[i * 10] for i in range(20)]
    assert max(log) > 1, "concurrent requests should share batches"
    assert all(n <= 8 for n in log)
    assert results[-1][1].batch_size >= 1
    await b.close()
    ex.shutdown()


async def test_full_queue_is_refused_with_retry_delay() -> None:
    import concurrent.futures

    ex = concurrent.futures.ThreadPoolExecutor(1)
    b: MicroBatcher[int, int] = MicroBatcher("t", _identity_batches([]), ex, max_batch=1,
                                             max_wait_s=0.0, max_queue=2, concurrency=1)
    # Not started: nothing drains the queue, so the third request overflows it.
    deadline = time.monotonic() + 5
    pending = [asyncio.ensure_future(b.submit([i], deadline)) for i in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as err:
        await b.submit([9], deadline)
    assert err.value.retry_after_s > 0
    for p in pending:
        p.cancel()
    ex.shutdown()


async def test_work_whose_deadline_passed_in_queue_is_dropped_not_run() -> None:
    import concurrent.futures

    log: list[int] = []
    ex = concurrent.futures.ThreadPoolExecutor(1)
    gate = threading.Event()
    ex.submit(gate.wait)  # the only worker is busy: real contention, not a mock
    b: MicroBatcher[int, int] = MicroBatcher("t", _identity_batches(log), ex, max_batch=4,
                                             max_wait_s=0.0, max_queue=10, concurrency=1)
    b.start()
    try:
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(b.submit([1], time.monotonic() + 0.1), 1.0)
    finally:
        gate.set()
    for _ in range(100):  # the worker skips the expired request once the gate opens
        if b.items_dropped:
            break
        await asyncio.sleep(0.05)
    assert log == [], "expired work must not reach the model"
    assert b.items_dropped == 1
    await b.close()
    ex.shutdown()


async def test_model_failure_fails_its_batch_not_the_batcher() -> None:
    import concurrent.futures

    calls = {"n": 0}

    def flaky(items: list[int]) -> tuple[list[int], float, float]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return items, 0.0, 0.0

    ex = concurrent.futures.ThreadPoolExecutor(1)
    b: MicroBatcher[int, int] = MicroBatcher("t", flaky, ex, max_batch=1, max_wait_s=0.0,
                                             max_queue=10, concurrency=1)
    b.start()
    with pytest.raises(RuntimeError, match="boom"):
        await b.submit([1], time.monotonic() + 5)
    assert (await b.submit([2], time.monotonic() + 5))[0] == [2]
    await b.close()
    ex.shutdown()


async def test_runtime_embeds_and_reranks_in_the_pool() -> None:
    rt = ModelRuntime(HashEmbedder(), OverlapCrossEncoder(), workers=2)
    await rt.start()
    deadline = time.monotonic() + 10
    vec, timing = await rt.embed_query("reset password", deadline)
    assert vec.shape == (384,) and abs(float(np.linalg.norm(vec)) - 1) < 1e-5
    assert timing.inference_ms >= 0 and timing.queue_ms >= 0
    mat, _ = await rt.embed_passages([f"text {i}" for i in range(37)], deadline, batch=8)
    assert mat.shape == (37, 384)
    scores, _ = await rt.rerank("reset password", ["how to reset a password", "invoice pdf"], deadline)
    assert scores[0] > scores[1]
    loop_thread = threading.get_ident()
    seen: list[int] = []
    orig = rt.embedder.infer
    rt.embedder.infer = lambda enc: (seen.append(threading.get_ident()), orig(enc))[1]  # type: ignore[method-assign]
    await rt.embed_query("another", deadline)
    assert seen and loop_thread not in seen, "model work must run in the executor pool"
    await rt.close()


async def test_the_latin_script_embedder_has_its_own_batchers_and_cache() -> None:
    latin = HashEmbedder(dimension=64)
    rt = ModelRuntime(HashEmbedder(), None, workers=2, query_cache_size=8, latin_embedder=latin)
    await rt.start()
    deadline = time.monotonic() + 10
    primary, _ = await rt.embed_query("reset password", deadline)
    second, _ = await rt.embed_query("reset password", deadline, latin=True)
    assert primary.shape == (384,) and second.shape == (64,)  # each model's own vector, not the other's cache
    again, timing = await rt.embed_query("reset password", deadline, latin=True)
    assert np.array_equal(again, second) and timing.inference_ms == 0  # answered by its own cache
    mat, _ = await rt.embed_passages(["a", "b", "c"], deadline, latin=True)
    assert mat.shape == (3, 64)
    assert [i.model_id for i in rt.model_infos] == [rt.embedder.info.model_id, latin.info.model_id]
    await rt.close()
    plain = ModelRuntime(HashEmbedder(), None, workers=1)
    with pytest.raises(RuntimeError, match="Latin-script"):
        await plain.embed_query("x", deadline, latin=True)
    await plain.close()


async def test_isolating_batcher_runs_each_request_alone_in_one_hop() -> None:
    """A batch-dependent model: requests still share an executor hop, never an inference call."""
    import concurrent.futures

    calls: list[list[int]] = []
    hops = 0
    gate = threading.Event()

    def run(items: list[int]) -> tuple[list[int], float, float]:
        calls.append(list(items))
        gate.wait(5)
        return [i * 10 for i in items], 0.0, 0.0

    ex = concurrent.futures.ThreadPoolExecutor(1)
    b: MicroBatcher[int, int] = MicroBatcher("t", run, ex, max_batch=32, max_wait_s=0.05, max_queue=100,
                                             concurrency=1, isolate_requests=True)
    b.start()
    deadline = time.monotonic() + 5
    requests = [[1], [2, 3], [4, 5, 6], [7]]
    pending = asyncio.gather(*(b.submit(r, deadline) for r in requests))
    await asyncio.sleep(0.1)
    gate.set()
    results = await pending
    hops = b.batches_run
    assert [r[0] for r in results] == [[i * 10 for i in r] for r in requests]
    assert sorted(map(tuple, calls)) == sorted(map(tuple, requests)), "one inference call per request"
    assert hops < len(requests), "the requests should still have shared executor hops"
    await b.close()
    ex.shutdown()


@pytest.mark.slow
async def test_int8_answers_do_not_depend_on_concurrent_requests(models_dir) -> None:  # type: ignore[no-untyped-def]
    """The int8 graphs quantize activations per tensor, over the whole batch: merged with a
    long concurrent request, a query's embedding and a pair's rerank logit used to shift
    (cosine ~0.997, ~0.1 logit). The runtime keeps requests apart, so they must not."""
    from service.models.onnx_cross_encoder import load_cross_encoder
    from service.models.onnx_embedder import load_embedder

    embedder = load_embedder(models_dir / "multilingual-e5-small-int8")
    reranker_dir = models_dir / "e5-small-split-reranker-int8"
    if not reranker_dir.is_dir():
        pytest.skip("the shipped reranker is not built here (`make models`)")
    reranker = load_cross_encoder(reranker_dir)
    assert not embedder.batch_invariant and not reranker.batch_invariant
    query, passage = "退款需要多长时间审核", "保险公司收到退保申请后，一般在30天内完成审核并退款。"
    other = "a much longer and entirely different question about something else " * 4
    runtime = ModelRuntime(embedder, reranker, workers=1, max_wait_ms=50)
    await runtime.start()
    try:
        deadline = time.monotonic() + 60
        alone_vec, _ = await runtime._embedding.queries.submit([query], deadline)
        (alone_logit,), _ = await runtime.rerank(query, [passage], deadline)
        together = await asyncio.gather(runtime._embedding.queries.submit([other], deadline),
                                        runtime._embedding.queries.submit([query], deadline),
                                        runtime.rerank(other, [other * 3, passage], deadline),
                                        runtime.rerank(query, [passage], deadline))
        assert together[1][1].batch_size > 1 or together[3][1].batch_size > 1, "nothing was merged"
        np.testing.assert_array_equal(together[1][0][0], alone_vec[0])
        assert together[3][0][0] == alone_logit
    finally:
        await runtime.close()


def test_runtime_confines_numpy_to_one_blas_thread() -> None:
    """OpenBLAS's spinning threads stole the cores from onnxruntime (README "Cached passage
    states": a stored-states rerank 52 -> 78 ms after a 5 ms numpy product)."""
    from threadpoolctl import threadpool_info, threadpool_limits  # type: ignore[import-untyped]

    blas = [p for p in threadpool_info() if p["user_api"] == "blas"]
    if not blas:
        pytest.skip("numpy has no BLAS threadpool threadpoolctl can see")
    threadpool_limits(limits=2, user_api="blas")  # as numpy starts on a multi-core machine
    ModelRuntime(HashEmbedder(), None, workers=1)
    assert {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"} == {1}


@pytest.mark.parametrize("isolate", [False, True])
async def test_only_batches_that_share_a_call_wait_for_company(isolate: bool) -> None:
    """A batch-invariant model waits up to ``max_wait_s`` for more items to merge into its
    call; an isolating one (each request its own call) takes what is queued and goes."""
    import concurrent.futures

    ex = concurrent.futures.ThreadPoolExecutor(2)
    b: MicroBatcher[int, int] = MicroBatcher("t", lambda items: ([i for i in items], 0.0, 0.0), ex, max_batch=32,
                                             max_wait_s=0.3, max_queue=100, concurrency=2, isolate_requests=isolate)
    b.start()
    deadline = time.monotonic() + 5
    first = asyncio.ensure_future(b.submit([1], deadline))
    await asyncio.sleep(0.05)  # well inside max_wait_s
    second = asyncio.ensure_future(b.submit([2], deadline))
    assert [r[0] for r in await asyncio.gather(first, second)] == [[1], [2]]
    assert b.batches_run == (2 if isolate else 1)
    await b.close()
    ex.shutdown()
