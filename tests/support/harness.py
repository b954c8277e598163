"""End-to-end harness (fixtures registered in tests/conftest.py): the real server (grpc.aio, servicers, pipeline, embedded engine,
onnxruntime models) on a loopback port, driven through generated stubs."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc, types_pb2
from service.api.server import Server
from service.app import App
from service.config import Config
from service.demo.corpus import DEMO_DOCUMENTS
from service.ingest.states_fill import StatesFill
from service.models.base import CrossEncoderBackend, EmbeddingBackend
from service.offline.builder import build_all, default_models_dir
from service.models.onnx_embedder import load_embedder

# The default embedder: what a fresh install serves.
DEFAULT_EMBEDDER = Config().embedding_model


@pytest.fixture(scope="session")
def e5_embedder() -> EmbeddingBackend:
    models = default_models_dir()
    build_all(models)  # no-op when current; `make test` builds them first
    return load_embedder(models / DEFAULT_EMBEDDER, threads=1)


@pytest.fixture(scope="session")
def bge_embedder() -> EmbeddingBackend:
    """The default's Latin-script embedder (what ``latin_embedding_model = "auto"`` serves),
    for tests of the default's quality; `make test` builds it (it needs mvn or the jar)."""
    import os

    from service.app import DEFAULT_LATIN_EMBEDDER

    models = default_models_dir()
    build_all(models)
    path = models / DEFAULT_LATIN_EMBEDDER
    if not (path / "model.onnx").exists():
        msg = f"{DEFAULT_LATIN_EMBEDDER} is not built (`python -m service models build` needs mvn or its jar)"
        if os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}:
            pytest.fail(msg + " (CI=true: make test builds it)")
        pytest.skip(msg)
    return load_embedder(path, threads=1)


def demo_documents() -> list[corpus_pb2.Document]:
    coll = {"doc": types_pb2.COLLECTION_DOC, "faq": types_pb2.COLLECTION_FAQ}
    status = {"approved": types_pb2.SOURCE_STATUS_APPROVED, "draft": types_pb2.SOURCE_STATUS_DRAFT,
              "retired": types_pb2.SOURCE_STATUS_RETIRED}
    return [
        corpus_pb2.Document(
            source_id=d["source_id"], version=d["version"], title=d["title"], text=d["text"],
            collection=coll[d["collection"]], status=status[d.get("status", "approved")],
            acl=d.get("acl", []), breadcrumb=d.get("breadcrumb", ""), metadata=d.get("metadata", {}))
        for d in DEMO_DOCUMENTS
    ]


@dataclasses.dataclass
class Live:
    server: Server
    app: App
    channel: grpc.aio.Channel
    retrieval: retrieval_pb2_grpc.RetrievalServiceStub
    corpus: corpus_pb2_grpc.CorpusServiceStub
    target: str

    async def retrieve(self, timeout: float = 10.0, metadata: Any = None, **fields: Any) -> list[retrieval_pb2.RetrieveEvent]:
        req = fields.pop("request", None) or retrieval_pb2.RetrieveRequest(**fields)
        return [ev async for ev in self.retrieval.Retrieve(req, timeout=timeout, metadata=metadata)]

    async def ingest(self, docs: list[corpus_pb2.Document], metadata: Any = None) -> corpus_pb2.IngestSummary:
        async def gen() -> AsyncIterator[corpus_pb2.IngestRequest]:
            for d in docs:
                yield corpus_pb2.IngestRequest(document=d)

        summary: corpus_pb2.IngestSummary = await self.corpus.Ingest(gen(), metadata=metadata)
        return summary


StartServer = Callable[..., Awaitable[Live]]


async def launch(cfg: Config, embedder: EmbeddingBackend, reranker: CrossEncoderBackend | None = None,
                 demo: bool = True, latin_embedder: EmbeddingBackend | None = None) -> Live:
    """Start a real server on a loopback port (optionally with the demo corpus ingested)."""
    app = App.build(cfg, embedder=embedder, reranker=reranker, latin_embedder=latin_embedder)
    server = Server(app)
    port = await server.start("127.0.0.1:0")
    target = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(target)
    live = Live(server, app, channel, retrieval_pb2_grpc.RetrievalServiceStub(channel),
                corpus_pb2_grpc.CorpusServiceStub(channel), target)
    if demo:
        summary = await live.ingest(demo_documents())
        assert not summary.errors and summary.documents_indexed == len(DEMO_DOCUMENTS), summary
    return live


async def shutdown(live: Live) -> None:
    await live.channel.close()
    await live.server.stop(0.5)


@pytest.fixture
async def start_server(tmp_path: Path, e5_embedder: EmbeddingBackend) -> AsyncIterator[StartServer]:
    """Factory: start a fresh server with config overrides (and optional backends)."""
    started: list[Live] = []

    async def start(embedder: EmbeddingBackend | None = None, reranker: CrossEncoderBackend | None = None,
                    demo: bool = True, latin_embedder: EmbeddingBackend | None = None, **overrides: Any) -> Live:
        # Hermetic: no "auto" reranker or Latin-script embedder picked up from this machine's
        # model cache (a test that wants the leg passes its embedder).
        cfg = dataclasses.replace(Config(), data_dir=tmp_path / f"data{len(started)}",
                                  **{"reranker_model": "", "latin_embedding_model": "", **overrides})
        live = await launch(cfg, embedder or e5_embedder, reranker, demo, latin_embedder)
        started.append(live)
        return live

    yield start
    for live in started:
        await shutdown(live)


@pytest.fixture(scope="session")
async def demo(tmp_path_factory: pytest.TempPathFactory, e5_embedder: EmbeddingBackend) -> AsyncIterator[Live]:
    """One shared server with the demo corpus, for read-only tests."""
    live = await launch(dataclasses.replace(Config(), data_dir=tmp_path_factory.mktemp("demo"), reranker_model="",
                                            latin_embedding_model=""), e5_embedder)
    yield live
    await shutdown(live)


def result_of(events: list[retrieval_pb2.RetrieveEvent]) -> retrieval_pb2.AttemptResult:
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds.count("result") == 1 and kinds[-1] == "result", kinds
    return events[-1].result


def evidence_of(events: list[retrieval_pb2.RetrieveEvent]) -> list[retrieval_pb2.EvidenceItem]:
    return [e.evidence for e in events if e.WhichOneof("event") == "evidence"]


def legs_of(result: retrieval_pb2.AttemptResult) -> dict[str, str]:
    return {types_pb2.LegKind.Name(leg.kind): types_pb2.LegStatus.Name(leg.status) for leg in result.legs}


def passages_computed(monkeypatch: pytest.MonkeyPatch, app: App) -> list[int]:
    """From now on, per rerank of ``app``: how many of its passages had no stored states
    (the rerank computed them). The list fills as reranks run."""
    computed: list[int] = []
    rerank = app.runtime.rerank

    async def counting(query, passages, deadline, states=None, computed_states=None):  # type: ignore[no-untyped-def]
        computed.append(sum(s is None for s in states or [None] * len(passages)))
        return await rerank(query, passages, deadline, states, computed_states)

    monkeypatch.setattr(app.runtime, "rerank", counting)
    return computed


async def fill_caught_up(fill: StatesFill, timeout_s: float | None, poll_s: float = 0.05) -> None:
    """Until the fill of passage states has caught up (``StatesFill.caught_up``); past
    ``timeout_s`` (None: no limit) TimeoutError."""
    async with asyncio.timeout(timeout_s):
        while not fill.caught_up:
            await asyncio.sleep(poll_s)
