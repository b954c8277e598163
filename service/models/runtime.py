"""The model runtime: one executor pool for tokenizers and onnxruntime, and a dynamic
micro-batcher per task in front of it.

Why a batcher: onnxruntime amortises per-call overhead over a batch, so concurrent
requests that arrive while the workers are busy are grouped into one batch. Why bounded
queues and deadlines: under overload the queue must not grow without bound, and work
whose caller has already given up must not burn CPU. A request is refused up front with
``Overloaded`` when its queue is full, and dropped with ``DeadlineExceeded`` when its
deadline passes before a worker picks it up (checked again inside the worker).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np

from service.errors import DeadlineExceeded, Overloaded
from service.models.base import CrossEncoderBackend, EmbeddingBackend, FloatArray, ModelInfo, PassagesWithStates
from service.models.foreground import ForegroundGate
from service.models.query_cache import QueryEmbeddingCache
from service.threads import niced_pool

if TYPE_CHECKING:
    from service.observability.metrics import ServiceMetrics

In = TypeVar("In")
Out = TypeVar("Out")


def confine_numpy_blas() -> None:
    """One BLAS thread for numpy in this process. OpenBLAS starts a thread per core and
    keeps them spinning after every matrix product, so a small numpy product on the request
    path (the compact states' expansion, a kNN scan) left them burning the cores the
    onnxruntime calls right after it needed: a stored-states rerank ran 52 -> 78 ms after a
    5 ms expansion (README "Cached passage states"). Process-wide, idempotent."""
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    threadpool_limits(limits=1, user_api="blas")


@dataclass
class Timing:
    queue_ms: float = 0.0
    tokenize_ms: float = 0.0
    inference_ms: float = 0.0
    batch_size: int = 0

    def add(self, other: Timing) -> Timing:
        return Timing(
            self.queue_ms + other.queue_ms,
            self.tokenize_ms + other.tokenize_ms,
            self.inference_ms + other.inference_ms,
            max(self.batch_size, other.batch_size),
        )


# A batch function runs in a worker thread: items -> (outputs, tokenize_s, inference_s).
BatchFn = Callable[[list[In]], tuple[list[Out], float, float]]


@dataclass
class _Request(Generic[In, Out]):
    items: list[In]
    deadline: float  # time.monotonic() seconds
    enqueued: float
    future: asyncio.Future[tuple[list[Out], Timing]] = field(repr=False)


class MicroBatcher(Generic[In, Out]):
    """Groups concurrent requests into batches of at most ``max_batch`` items."""

    def __init__(
        self,
        name: str,
        fn: BatchFn[In, Out],
        executor: concurrent.futures.Executor,
        *,
        max_batch: int,
        max_wait_s: float,
        max_queue: int,
        concurrency: int,
        metrics: ServiceMetrics | None = None,
        isolate_requests: bool = False,
        gate: ForegroundGate | None = None,
    ) -> None:
        self.name = name
        # Background (ingest) batchers: each executor hop takes one of the gate's slots.
        self._gate = gate
        # True for a model whose outputs depend on batch composition: the batch still takes
        # one executor hop, but each request's items run as their own inference call, so
        # an answer never depends on which other requests happened to be in flight.
        self._isolate = isolate_requests
        self._metrics = metrics
        self._fn = fn
        self._executor = executor
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._queue: asyncio.Queue[_Request[In, Out]] = asyncio.Queue(maxsize=max_queue)
        self._slots = asyncio.Semaphore(concurrency)
        self._carry: _Request[In, Out] | None = None
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self.batches_run = 0
        self.items_dropped = 0
        if metrics is not None:
            metrics.watch_queue(name, lambda: float(self._queue.qsize()))

    def _dropped(self, reason: str, items: int) -> None:
        self.items_dropped += items
        if self._metrics is not None:
            self._metrics.dropped(self.name, reason, items)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.name)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    @property
    def capacity(self) -> int:
        return self._queue.maxsize

    async def submit(self, items: Sequence[In], deadline: float) -> tuple[list[Out], Timing]:
        """Run ``items`` as part of some batch; raises Overloaded or DeadlineExceeded."""
        if not items:
            return [], Timing()
        now = time.monotonic()
        if deadline <= now:
            raise DeadlineExceeded(f"{self.name}: deadline already passed")
        loop = asyncio.get_running_loop()
        request: _Request[In, Out] = _Request(list(items), deadline, now, loop.create_future())
        try:
            self._queue.put_nowait(request)
        except asyncio.QueueFull:
            if self._metrics is not None:
                self._metrics.dropped(self.name, "queue_full", len(items))
            raise Overloaded(f"{self.name} queue is full ({self.capacity})", retry_after_s=0.2)
        try:
            # On timeout wait_for cancels the future, so a worker that picks the request
            # up later sees it done and skips it.
            return await asyncio.wait_for(request.future, deadline - now)
        except TimeoutError:
            raise DeadlineExceeded(f"{self.name}: deadline passed before the model answered")

    async def _next(self, timeout: float | None) -> _Request[In, Out] | None:
        if self._carry is not None:
            request, self._carry = self._carry, None
            return request
        if timeout is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    def _next_queued(self) -> _Request[In, Out] | None:
        if self._carry is not None:
            request, self._carry = self._carry, None
            return request
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    async def _loop(self) -> None:
        while True:
            await self._slots.acquire()
            first = await self._next(None)
            assert first is not None
            batch = [first]
            size = len(first.items)
            # Waiting for company only pays when it shares an inference call. Isolated
            # requests never do, so they take what is queued already and go: a lone query
            # embedding or rerank no longer waits out ``max_wait_s`` (README "Performance").
            wait_s = 0.0 if self._isolate else self._max_wait_s
            until = time.monotonic() + wait_s
            while size < self._max_batch:
                nxt = self._next_queued() if wait_s == 0.0 else await self._next(max(0.0, until - time.monotonic()))
                if nxt is None:
                    break
                if size + len(nxt.items) > self._max_batch:
                    self._carry = nxt
                    break
                batch.append(nxt)
                size += len(nxt.items)
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    def _admit(self, batch: list[_Request[In, Out]]) -> list[_Request[In, Out]]:
        now = time.monotonic()
        live = []
        for request in batch:
            if request.future.done():  # caller cancelled or timed out
                self._dropped("abandoned", len(request.items))
            elif request.deadline <= now:
                self._dropped("deadline", len(request.items))
                request.future.set_exception(
                    DeadlineExceeded(f"{self.name}: dropped from queue, deadline passed")
                )
            else:
                live.append(request)
        return live

    async def _run(self, batch: list[_Request[In, Out]]) -> None:
        try:
            live = self._admit(batch)
            if not live:
                return
            loop = asyncio.get_running_loop()

            def work() -> tuple[list[_Request[In, Out]], list[Out], float, float, float]:
                # Deadline-aware admission again: the executor may have been busy.
                started = time.monotonic()
                admitted = [r for r in live if r.deadline > started and not r.future.done()]
                if not admitted:
                    return [], [], started, 0.0, 0.0
                if not self._isolate:
                    items = [item for r in admitted for item in r.items]
                    outputs, tok_s, inf_s = self._fn(items)
                    return admitted, outputs, started, tok_s, inf_s
                outputs, tok_s, inf_s = [], 0.0, 0.0
                for r in admitted:
                    part, t, i = self._fn(r.items)
                    outputs.extend(part)
                    tok_s, inf_s = tok_s + t, inf_s + i
                return admitted, outputs, started, tok_s, inf_s

            async with self._gate.background() if self._gate is not None else contextlib.nullcontext():
                admitted, outputs, started, tok_s, inf_s = await loop.run_in_executor(self._executor, work)
            self.batches_run += 1
            offset = 0
            n = sum(len(r.items) for r in admitted)
            if self._metrics is not None and admitted:
                self._metrics.batch_ran(self.name, n, [started - r.enqueued for r in admitted], tok_s, inf_s)
            for request in live:
                if request not in admitted:
                    self._dropped("abandoned" if request.future.done() else "deadline", len(request.items))
                    if not request.future.done():
                        request.future.set_exception(
                            DeadlineExceeded(f"{self.name}: deadline passed while queued")
                        )
                    continue
                part = outputs[offset : offset + len(request.items)]
                offset += len(request.items)
                if not request.future.done():
                    timing = Timing(
                        queue_ms=(started - request.enqueued) * 1000,
                        tokenize_ms=tok_s * 1000,
                        inference_ms=inf_s * 1000,
                        batch_size=n,
                    )
                    request.future.set_result((part, timing))
        except BaseException as exc:  # a model failure fails its batch, not the loop
            for request in batch:
                if not request.future.done():
                    if isinstance(exc, asyncio.CancelledError):
                        request.future.cancel()
                    else:
                        request.future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._slots.release()


def _timed_embed(
    backend: EmbeddingBackend, kind: str
) -> BatchFn[str, FloatArray]:
    def run(texts: list[str]) -> tuple[list[FloatArray], float, float]:
        t0 = time.perf_counter()
        encoded = backend.tokenize(texts, "query" if kind == "query" else "passage")
        t1 = time.perf_counter()
        vectors = backend.infer(encoded)
        t2 = time.perf_counter()
        return [np.asarray(v, dtype=np.float32) for v in vectors], t1 - t0, t2 - t1

    return run


# A rerank item: query, passage, and the passage's stored states (None: compute them).
RerankItem = tuple[str, str, bytes | None]


# A rerank result: the logit, and the passage states the call computed (None: it had them,
# or the model keeps none), which the caller may write back.
RerankOut = tuple[float, bytes | None]


def _timed_rerank(backend: CrossEncoderBackend) -> BatchFn[RerankItem, RerankOut]:
    def run(items: list[RerankItem]) -> tuple[list[RerankOut], float, float]:
        t0 = time.perf_counter()
        encoded = backend.tokenize_with_states([(q, p) for q, p, _ in items], [s for _, _, s in items])
        t1 = time.perf_counter()
        logits = backend.infer(encoded)
        t2 = time.perf_counter()
        computed: dict[int, bytes] = encoded.extra.get("computed_states", {})
        return [(float(x), computed.get(i)) for i, x in enumerate(np.asarray(logits).reshape(-1))], t1 - t0, t2 - t1

    return run


def _timed_states(backend: CrossEncoderBackend) -> BatchFn[str, bytes]:
    def run(passages: list[str]) -> tuple[list[bytes], float, float]:
        t0 = time.perf_counter()
        states = backend.passage_states(passages)
        return states, 0.0, time.perf_counter() - t0

    return run


# A one-pass result for a chunk's text: the vector, the stored-states blob (None: left to the
# chunk's first rerank), and whether one pass gave both.
OnePassOut = tuple[FloatArray, bytes | None, bool]


def _stacked(vectors: list[FloatArray], dimension: int) -> FloatArray:
    return np.stack(vectors).astype(np.float32) if vectors else np.zeros((0, dimension), np.float32)


async def _submit_in_requests(batcher: MicroBatcher[In, Out], items: Sequence[In], deadline: float,
                              batch: int) -> tuple[list[Out], Timing]:
    """``items`` as requests of ``batch`` each, all at once: every output in order, and the
    timings added. Ingest's embeddings with or without states split them alike, so the
    one-pass vectors come from the very calls ``embed_passages`` makes."""
    parts = await asyncio.gather(*(batcher.submit(list(items[i : i + batch]), deadline)
                                   for i in range(0, len(items), batch)))
    total = Timing()
    for _, timing in parts:
        total = total.add(timing)
    return [out for outs, _ in parts for out in outs], total


@dataclass
class _EmbeddingLane:
    """One embedder's way through the runtime: its query cache and its two batchers."""

    model: EmbeddingBackend
    cache: QueryEmbeddingCache
    queries: MicroBatcher[str, FloatArray]
    passages: MicroBatcher[str, FloatArray]


class ModelRuntime:
    """Embedding and rerank entry points for the pipeline, all async, all pooled."""

    def __init__(
        self,
        embedder: EmbeddingBackend,
        reranker: CrossEncoderBackend | None,
        *,
        workers: int = 2,
        max_batch: int = 16,
        max_wait_ms: float = 2.0,
        max_queue: int = 256,
        metrics: ServiceMetrics | None = None,
        query_cache_size: int = 0,
        ingest_workers: int = 0,
        ingest_nice: int = 0,
        worker_nice: int = 0,
        ingest_workers_while_querying: int = 1,
        passage_states: bool = True,
        ingest_states: bool = True,
        latin_embedder: EmbeddingBackend | None = None,
        one_pass: PassagesWithStates | None = None,
    ) -> None:
        self.embedder = embedder
        self.reranker = reranker
        self._metrics = metrics
        confine_numpy_blas()  # the pool's threads are the process's compute threads
        # Query-time model work (query embeddings, rerank) has its own pool, and ingest's
        # passage batches another (``ingest_workers`` threads; 0 = share the query pool): a
        # query batch never waits in an executor queue behind a passage batch, and the
        # ingest threads run ``ingest_nice`` steps below normal priority, so when both want
        # the cores the scheduler gives them to queries (service/threads.py). The query pool
        # itself runs ``worker_nice`` steps below the event loop.
        self.executor = niced_pool(workers, "model", worker_nice)
        self.ingest_executor = self.executor if ingest_workers <= 0 else niced_pool(
            ingest_workers, "ingest-model", ingest_nice)
        # Ingest batches run on every ingest thread only while no query needs the models.
        ingest_threads = ingest_workers or workers
        self.foreground = ForegroundGate(ingest_threads, ingest_workers_while_querying, on_held_back=(
            metrics.ingest_held_back.inc if metrics is not None else None))
        common = dict(max_wait_s=max_wait_ms / 1000, max_queue=max_queue, concurrency=workers, metrics=metrics)

        def make_lane(model: EmbeddingBackend, suffix: str) -> _EmbeddingLane:
            """An embedder's query batcher (query pool), passage batcher (ingest pool) and query cache."""
            return _EmbeddingLane(
                model, QueryEmbeddingCache(query_cache_size, model.info.sha256),
                MicroBatcher(f"embed-query{suffix}", _timed_embed(model, "query"), self.executor,
                             max_batch=max(max_batch, 32), isolate_requests=not model.batch_invariant,
                             **common),  # type: ignore[arg-type]
                MicroBatcher(f"embed-passage{suffix}", _timed_embed(model, "passage"), self.ingest_executor,
                             max_batch=max_batch, isolate_requests=not model.batch_invariant, gate=self.foreground,
                             **{**common, "concurrency": ingest_threads}),  # type: ignore[arg-type]
            )

        self._embedding = make_lane(embedder, "")
        # The Latin-script embedder (``latin_embedding_model``): a second dense leg for
        # queries and chunks without Han characters; None = no such leg.
        self._latin = make_lane(latin_embedder, "-latin") if latin_embedder is not None else None
        self._rerank: MicroBatcher[RerankItem, RerankOut] | None = None
        self._states: MicroBatcher[str, bytes] | None = None
        if reranker is not None:
            self._rerank = MicroBatcher(
                "rerank", _timed_rerank(reranker), self.executor,
                max_batch=max(max_batch, 32), isolate_requests=not reranker.batch_invariant, **common,  # type: ignore[arg-type]
            )
        # ``passage_states`` off: no states are stored or read (every rerank computes them);
        # ``states_key`` is None. On: reranks read stored states, and ingest computes them
        # too unless ``ingest_states`` is False (write-back only: reranks store what they
        # computed, README "Cached passage states").
        self._states_key = reranker.states_key if reranker is not None and passage_states else None
        self.ingest_states = self._states_key is not None and ingest_states
        if reranker is not None and self._states_key is not None:
            # Ingest-time work: the ingest pool, like passage embeddings.
            self._states = MicroBatcher(
                "rerank-states", _timed_states(reranker), self.ingest_executor,
                max_batch=max_batch, isolate_requests=not reranker.batch_invariant, gate=self.foreground,
                **{**common, "concurrency": ingest_threads},  # type: ignore[arg-type]
            )
        # Ingest's vectors and states from one pass where the embedder's pass is the
        # reranker's lower layers (``one_pass.py``); only for the states this runtime stores.
        self._one_pass: MicroBatcher[str, OnePassOut] | None = None
        if one_pass is not None and self.ingest_states and one_pass.states_key == self._states_key:
            # A request (a document's chunks, ``embed_passages_with_states``) runs alone, as
            # in ``embed_passages``: the same calls, so the same vectors, bit for bit.
            self._one_pass = MicroBatcher(
                "embed-passage-states", one_pass.embed_with_states, self.ingest_executor,
                max_batch=max_batch, isolate_requests=True, gate=self.foreground,
                **{**common, "concurrency": ingest_threads},  # type: ignore[arg-type]
            )
        self._batchers: list[MicroBatcher[str, FloatArray] | MicroBatcher[RerankItem, RerankOut]
                             | MicroBatcher[str, bytes] | MicroBatcher[str, OnePassOut]] = [
            b for lane in self._lanes for b in (lane.queries, lane.passages)]
        self._batchers += [b for b in (self._rerank, self._states, self._one_pass) if b is not None]

    @property
    def _lanes(self) -> list[_EmbeddingLane]:
        return [lane for lane in (self._embedding, self._latin) if lane is not None]

    @property
    def latin_embedder(self) -> EmbeddingBackend | None:
        return self._latin.model if self._latin is not None else None

    @property
    def model_infos(self) -> list[ModelInfo]:
        infos = [self.embedder.info]
        if self.latin_embedder is not None:
            infos.append(self.latin_embedder.info)
        if self.reranker is not None:
            infos.append(self.reranker.info)
        return infos

    async def start(self) -> None:
        for batcher in self._batchers:
            batcher.start()
        # Warm up inside the pool so the first caller does not pay session start-up.
        deadline = time.monotonic() + 120
        for lane in self._lanes:  # not via the cache: no query asked it
            await lane.queries.submit(["warm up"], deadline)
        if self._rerank is not None:
            await self.rerank("warm up", ["warm up"], deadline)
        if self._states is not None:  # and the two-graph path stored states take
            await self.rerank("warm up", ["warm up"], deadline, await self.passage_states(["warm up"], deadline))

    async def close(self) -> None:
        for batcher in self._batchers:
            await batcher.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.ingest_executor is not self.executor:
            self.ingest_executor.shutdown(wait=False, cancel_futures=True)

    def overloaded(self) -> bool:
        """Explicit overload check: any queue past 90% of its bound."""
        return any(b.depth >= 0.9 * b.capacity for b in self._batchers)

    def _lane(self, latin: bool) -> _EmbeddingLane:
        if not latin:
            return self._embedding
        if self._latin is None:
            raise RuntimeError("no Latin-script embedder configured")
        return self._latin

    async def embed_query(self, text: str, deadline: float, *, latin: bool = False) -> tuple[FloatArray, Timing]:
        """The query's vector by the embedder, or with ``latin`` by the Latin-script one."""
        lane = self._lane(latin)
        cached = lane.cache.get(text)
        if self._metrics is not None and lane.cache.size:
            self._metrics.query_cache.labels("hit" if cached is not None else "miss").inc()
        if cached is not None:
            self.foreground.touch()
            return cached, Timing()
        with self.foreground.foreground():
            vectors, timing = await lane.queries.submit([text], deadline)
        lane.cache.put(text, vectors[0])
        return vectors[0], timing

    async def embed_passages(
        self, texts: Sequence[str], deadline: float, batch: int = 16, *, latin: bool = False
    ) -> tuple[FloatArray, Timing]:
        """Passage vectors (ingest; the ingest pool), by the Latin-script embedder with ``latin``."""
        lane = self._lane(latin)
        vectors, total = await _submit_in_requests(lane.passages, texts, deadline, batch)
        return _stacked(vectors, lane.model.dimension), total

    @property
    def states_key(self) -> str | None:
        """The key of the passage states the reranker can reuse; None when it cannot or
        stored states are off."""
        return self._states_key

    @property
    def one_pass_states(self) -> bool:
        """Whether ingest gets vectors and states from ``embed_passages_with_states``."""
        return self._one_pass is not None

    async def embed_passages_with_states(
        self, texts: Sequence[str], deadline: float, batch: int = 16
    ) -> tuple[FloatArray, list[bytes | None], Timing]:
        """Passage vectors and the reranker's states for the chunk ``texts`` (what ingest
        embeds is what a rerank reads, ``rerank_passage_text``), from one pass where the
        two models' rows are the same tokens (ingest; the ingest pool); None where a chunk's
        states are left to its first rerank (``rerank_states_second_pass`` off). The texts go
        in the requests ``embed_passages`` makes of them, so the vectors are its own."""
        if self._one_pass is None:
            raise RuntimeError("no one-pass passage states (one_pass_states)")
        outs, total = await _submit_in_requests(self._one_pass, list(texts), deadline, batch)
        if self._metrics is not None:
            one = sum(1 for _, _, single in outs if single)
            left = sum(1 for _, blob, _ in outs if blob is None)
            self._metrics.ingest_states_passes.labels("one").inc(one)
            self._metrics.ingest_states_passes.labels("two").inc(len(outs) - one - left)
            self._metrics.ingest_states_passes.labels("left").inc(left)
        return _stacked([v for v, _, _ in outs], self.embedder.dimension), [blob for _, blob, _ in outs], total

    async def passage_states(self, passages: Sequence[str], deadline: float, batch: int = 16) -> list[bytes]:
        """The reranker's passage states for ``passages`` (ingest; the ingest pool)."""
        if self._states is None:
            raise RuntimeError("the reranker has no cached passage states")
        blobs, _ = await _submit_in_requests(self._states, passages, deadline, batch)
        return blobs

    async def rerank(
        self, query: str, passages: Sequence[str], deadline: float,
        states: Sequence[bytes | None] | None = None, computed: dict[int, bytes] | None = None,
    ) -> tuple[list[float], Timing]:
        """Logits for ``passages``; ``states`` (row-aligned, None = compute) are stored
        passage states for ``states_key``. ``computed``, when given, receives by row the
        states this call computed for passages that had none (for a write-back)."""
        if self._rerank is None:
            raise RuntimeError("no reranker configured")
        row_states = list(states) if states is not None else [None] * len(passages)
        if len(row_states) != len(passages):
            raise ValueError("one states entry per passage")
        with self.foreground.foreground():
            out, timing = await self._rerank.submit([(query, p, s) for p, s in zip(passages, row_states)], deadline)
        if computed is not None:
            computed.update((i, blob) for i, (_, blob) in enumerate(out) if blob is not None)
        return [logit for logit, _ in out], timing
