"""The fill of passage states (``service/ingest/states_fill.py``) on a real embedded engine and
a real model runtime (a dummy reranker whose states are its passage's hash): a scan fills
every chunk without current states and no other; nothing is computed while ingest is busy
or a query holds the models; chunks ingest hands over are filled, skipped when they got
states meanwhile, and counted stale when they changed; more than it keeps falls back to a
scan; a failed step loses nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from service.engines.base import ChunkRecord
from service.engines.embedded import EmbeddedEngine
from service.ingest import states_fill
from service.ingest.states_fill import StatesFill
from service.models.dummy import HashEmbedder, OverlapCrossEncoder
from service.models.runtime import ModelRuntime
from service.observability.metrics import ServiceMetrics
from tests.support.harness import fill_caught_up
from tests.support.scrape import parse
from tests.unit.engines.test_engine_contract import chunk, put

KEY = "overlap-states:v1"


class StatesReranker(OverlapCrossEncoder):
    """Stored states are the passage's SHA-256; every passage it computes is recorded."""

    states_key = KEY

    def __init__(self) -> None:
        super().__init__()
        self.computed: list[str] = []
        self._lock = threading.Lock()

    def passage_states(self, passages: list[str]) -> list[bytes]:
        with self._lock:
            self.computed += passages
        return [states_of(p) for p in passages]


def states_of(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class Quiet:
    """The ingest idleness the fill reads, set by the test."""

    def __init__(self) -> None:
        self.seconds = 1e9

    def __call__(self) -> float:
        return self.seconds


@dataclasses.dataclass
class Kit:
    engine: EmbeddedEngine
    runtime: ModelRuntime
    reranker: StatesReranker
    quiet: Quiet
    metrics: ServiceMetrics
    make: Callable[..., StatesFill]


@pytest.fixture
async def kit(tmp_path: Path) -> AsyncIterator[Kit]:
    engine = EmbeddedEngine(tmp_path / "engine")
    await engine.start()
    reranker = StatesReranker()
    metrics = ServiceMetrics()
    runtime = ModelRuntime(HashEmbedder(8), reranker, workers=1, metrics=metrics)
    await runtime.start()
    reranker.computed.clear()  # the warm-up's
    quiet = Quiet()
    tasks: list[asyncio.Task[None]] = []

    def make(**kwargs: object) -> StatesFill:
        fill = StatesFill(engine, runtime, KEY, ingest_idle_for=quiet, metrics=metrics,
                          **{"idle_s": 0.2, **kwargs})  # type: ignore[arg-type]
        tasks.append(asyncio.get_running_loop().create_task(fill.run()))
        return fill

    try:
        yield Kit(engine, runtime, reranker, quiet, metrics, make)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runtime.close()
        await engine.close()


async def caught_up(fill: StatesFill) -> None:
    await fill_caught_up(fill, 10.0, poll_s=0.01)


def with_states(c: ChunkRecord, blob: bytes, key: str = KEY) -> ChunkRecord:
    return dataclasses.replace(c, rerank_states=blob, rerank_states_key=key)


async def stored(engine: EmbeddedEngine, *chunks: ChunkRecord) -> dict[str, bytes]:
    return await engine.passage_states([(c.chunk_id, c.content_hash) for c in chunks], KEY)


def fill_counts(metrics: ServiceMetrics) -> dict[str, float]:
    scraped = parse(metrics.exposition().decode())
    return {r: scraped.get(("retrieval_passage_states_fill_total", (("result", r),)), 0.0)
            for r in ("written", "had", "stale")}


def fill_gauges(metrics: ServiceMetrics) -> tuple[float, float]:
    """(chunks handed over and not yet filled, 1 while a scan is due or running)."""
    scraped = parse(metrics.exposition().decode())
    return (scraped[("retrieval_passage_states_fill_pending", ())],
            scraped[("retrieval_passage_states_fill_scanning", ())])


async def test_a_scan_fills_every_chunk_without_current_states_and_no_other(kit: Kit) -> None:
    has = with_states(chunk("S1", 0, "alpha policy"), b"kept as stored")
    bare = [chunk("S2", i, f"beta clause {i}") for i in range(5)]  # stored without states
    other = with_states(chunk("S3", 0, "gamma policy"), b"another reranker's", key="other:v1")
    await put(kit.engine, has, *bare, other)
    fill = kit.make(page=2)  # several pages, some with nothing to fill
    await caught_up(fill)
    assert await stored(kit.engine, has, *bare, other) == {
        has.chunk_id: b"kept as stored", **{c.chunk_id: states_of(c.search_text) for c in (*bare, other)}}
    assert sorted(kit.reranker.computed) == sorted(c.search_text for c in (*bare, other)), \
        "a chunk with current states is never computed again"
    assert fill.progress.scans == 1 and fill.progress.written == len(bare) + 1
    assert fill_counts(kit.metrics) == {"written": len(bare) + 1, "had": 0, "stale": 0}


async def test_nothing_is_computed_while_ingest_is_busy_or_a_query_holds_the_models(kit: Kit) -> None:
    bare = chunk("S1", 0, "alpha policy")
    await put(kit.engine, bare)
    kit.quiet.seconds = 0.0  # a document is being ingested
    fill = kit.make()
    await asyncio.sleep(0.4)
    assert kit.reranker.computed == [] and not fill.caught_up
    kit.quiet.seconds = 0.1  # ingest stopped a moment ago: not yet quiet for idle_s
    await asyncio.sleep(0.3)
    assert kit.reranker.computed == []
    kit.quiet.seconds = 1e9
    with kit.runtime.foreground.foreground():  # a query is using the models
        await asyncio.sleep(0.4)
        assert kit.reranker.computed == []
    await caught_up(fill)
    assert kit.reranker.computed == [bare.search_text]
    assert await stored(kit.engine, bare) == {bare.chunk_id: states_of(bare.search_text)}


async def test_handed_over_chunks_are_filled_skipped_when_stored_meanwhile_and_stale_when_changed(kit: Kit) -> None:
    fill = kit.make()
    await caught_up(fill)  # the start's scan of an empty store
    left, written_back, changed = (chunk("S1", i, f"clause {i}") for i in range(3))
    await put(kit.engine, left, written_back, changed)
    assert await kit.engine.put_passage_states([(written_back.chunk_id, written_back.content_hash, b"a rerank's")], KEY)
    fill.left([(c.chunk_id, c.content_hash, c.search_text) for c in (left, written_back)]
              + [(changed.chunk_id, "the hash before a re-ingest", changed.search_text)])
    await caught_up(fill)
    assert await stored(kit.engine, left, written_back, changed) == {
        left.chunk_id: states_of(left.search_text), written_back.chunk_id: b"a rerank's"}
    assert kit.reranker.computed == [left.search_text, changed.search_text]
    assert fill_counts(kit.metrics) == {"written": 1, "had": 1, "stale": 1}


async def test_more_handed_over_than_it_keeps_falls_back_to_a_scan(kit: Kit) -> None:
    kit.quiet.seconds = 0.0  # hold the fill until everything is handed over
    fill = kit.make(max_pending=2)
    bare = [chunk("S1", i, f"clause {i}") for i in range(3)]
    await put(kit.engine, *bare)
    fill.left([(c.chunk_id, c.content_hash, c.search_text) for c in bare[:1]])
    assert fill_gauges(kit.metrics) == (1, 1)  # one handed over; the start's scan is due
    fill.left([(c.chunk_id, c.content_hash, c.search_text) for c in bare[1:]])
    assert fill_gauges(kit.metrics) == (1, 1)  # the two more were not kept: the scan finds them
    kit.quiet.seconds = 1e9
    await caught_up(fill)
    assert await stored(kit.engine, *bare) == {c.chunk_id: states_of(c.search_text) for c in bare}
    assert fill.progress.scans == 1 and fill_gauges(kit.metrics) == (0, 0)


async def test_a_failed_step_loses_nothing_and_retries_back_off(kit: Kit, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(states_fill, "RETRY_S", 0.02)
    monkeypatch.setattr(states_fill, "RETRY_MAX_S", 0.05)
    fill = kit.make()
    await caught_up(fill)
    bare = chunk("S1", 0, "alpha policy")
    await put(kit.engine, bare)
    real = kit.engine.put_passage_states
    failures = [RuntimeError("the engine is down")] * 4

    async def flaky(states: object, key: str) -> int:
        if failures:
            raise failures.pop()
        return await real(states, key)  # type: ignore[arg-type]

    monkeypatch.setattr(kit.engine, "put_passage_states", flaky)
    fill.left([(bare.chunk_id, bare.content_hash, bare.search_text)])
    await caught_up(fill)
    assert not failures and await stored(kit.engine, bare) == {bare.chunk_id: states_of(bare.search_text)}
    waits = [r.args[1] for r in caplog.records if "retrying in" in r.msg]  # type: ignore[index]
    assert waits == pytest.approx([0.02, 0.04, 0.05, 0.05])  # doubling, capped at RETRY_MAX_S


async def test_ingest_is_busy_while_a_document_is_ingested_and_quiet_after(kit: Kit,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The clock the fill waits on (``Ingestor.idle_for``), and that an ingest with states
    at ingest builds its fill."""
    from service.config import Config
    from service.ingest.documents import DocumentInput
    from service.ingest.ingestor import Ingestor

    ingestor = Ingestor(Config(rerank_states_fill_idle_s=0.5), kit.engine, kit.runtime)
    assert ingestor.states_fill is not None and ingestor.states_fill.idle_s == 0.5
    assert Ingestor(Config(rerank_states_fill=False), kit.engine, kit.runtime).states_fill is None
    writing, release = asyncio.Event(), asyncio.Event()
    real = kit.engine.replace_document

    async def held(*args: object) -> object:
        writing.set()
        await release.wait()
        return await real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(kit.engine, "replace_document", held)
    task = asyncio.get_running_loop().create_task(ingestor.ingest(DocumentInput(
        source_id="d1", version="v1", title="", text="alpha policy", collection="doc")))
    await writing.wait()
    assert ingestor.idle_for() == 0.0
    await asyncio.sleep(0.1)
    assert ingestor.idle_for() == 0.0, "busy for as long as the document is being ingested"
    release.set()
    assert (await task).status == "indexed"
    first = ingestor.idle_for()
    await asyncio.sleep(0.1)
    assert 0.0 <= first < ingestor.idle_for()


async def test_a_scan_asked_for_while_a_page_is_read_starts_over(kit: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page read before a hand-over overflowed may miss the chunks handed over: the scan
    starts again from the first chunk instead of finishing on that page."""
    early = chunk("S1", 0, "alpha policy")
    await put(kit.engine, early)
    real = kit.engine.chunks_without_states
    read, release = asyncio.Event(), asyncio.Event()

    async def slow_first_page(key: str, after: str, limit: int) -> object:
        page = await real(key, after, limit)
        if not read.is_set():  # the first page, read before ``late`` was stored
            read.set()
            await release.wait()
        return page

    monkeypatch.setattr(kit.engine, "chunks_without_states", slow_first_page)
    fill = kit.make(max_pending=1)
    await read.wait()
    late = chunk("S2", 0, "beta policy")
    await put(kit.engine, late)
    fill.left([(c.chunk_id, c.content_hash, c.search_text) for c in (early, late)])  # more than it keeps
    release.set()
    await caught_up(fill)
    assert await stored(kit.engine, early, late) == {c.chunk_id: states_of(c.search_text) for c in (early, late)}
