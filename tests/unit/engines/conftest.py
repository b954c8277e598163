"""The engine under test for the shared contract suite (test_engine_contract.py).

Add an engine by adding its name to ENGINE_KINDS and a branch in ``engine_kit``; the suite
itself only talks to ``service.engines.base.Engine``. Optional abilities an engine may lack
(restart on the same store, a pool the test can saturate) are ``None`` in its kit, and the
tests needing them skip.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from service.engines.base import Engine
from service.engines.embedded import EmbeddedEngine

ENGINE_KINDS = ["embedded", pytest.param("opensearch", marks=pytest.mark.integration)]


@dataclass
class EngineKit:
    kind: str
    engine: Engine
    # Close the engine and open a new one on the same store (persistence checks).
    reopen: Callable[[], Awaitable[Engine]] | None = None
    # Occupy every worker of the engine until the context exits (real timeout checks).
    saturate: Callable[[], contextlib.AbstractContextManager[None]] | None = None


def _embedded_kit(data_dir: Path) -> EngineKit:
    kit = EngineKit(kind="embedded", engine=EmbeddedEngine(data_dir))

    async def reopen() -> Engine:
        await kit.engine.close()
        kit.engine = EmbeddedEngine(data_dir)
        await kit.engine.start()
        return kit.engine

    @contextlib.contextmanager
    def saturate() -> Iterator[None]:
        engine = kit.engine
        assert isinstance(engine, EmbeddedEngine)
        release = threading.Event()
        blockers = [
            engine.executor.submit(release.wait, 30) for _ in range(engine.workers)
        ]
        try:
            yield
        finally:
            release.set()
            for blocker in blockers:
                blocker.result()

    kit.reopen, kit.saturate = reopen, saturate
    return kit


@pytest.fixture(params=ENGINE_KINDS)
async def engine_kit(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[EngineKit]:
    if request.param == "embedded":
        kit = _embedded_kit(tmp_path / "engine")
    elif request.param == "opensearch":  # a real node: skips loudly without OPENSEARCH_URL
        from tests.support.opensearch import opensearch_kit

        kit = opensearch_kit(request, EngineKit, dimension=8)  # the suite's DIM
    else:
        raise AssertionError(f"unknown engine kind {request.param}")
    await kit.engine.start()
    assert await kit.engine.ready()
    try:
        yield kit
    finally:
        await kit.engine.close()


@pytest.fixture
def engine(engine_kit: EngineKit) -> Engine:
    """A started engine over an empty store."""
    return engine_kit.engine
