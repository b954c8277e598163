"""The ledger contract on a real OpenSearch node, and a ledger node that stops answering
(behind tests/support/tcp_proxy.py): unavailable, never "nothing there"."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from service._gen.retrieval.v1 import retrieval_pb2, types_pb2
from service.config import Config
from service.ledger.base import Ledger, LedgerUnavailable
from service.ledger.opensearch import OpenSearchLedger
from service.models.base import EmbeddingBackend
from tests.support.harness import launch, result_of, shutdown
from tests.support.opensearch import host_port, opensearch_url_or_skip, unique_prefix
from tests.support.service_live import http_json
from tests.support.tcp_proxy import TcpProxy
from tests.unit.ledger.contract import LedgerContract, OpenLedger, rid

pytestmark = pytest.mark.integration
FOUND = types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND


def drop_ledger(url: str, prefix: str) -> None:
    http_json("DELETE", f"{url}/{prefix}-ledger-*?ignore_unavailable=true&allow_no_indices=true")


@pytest.fixture
async def open_ledger() -> AsyncIterator[OpenLedger]:
    url = opensearch_url_or_skip()
    prefix = unique_prefix("ledger")
    opened: list[Ledger] = []

    async def make() -> Ledger:
        ledger = OpenSearchLedger(url, index_prefix=prefix, timeout_s=5.0)
        await ledger.start()
        opened.append(ledger)
        return ledger

    yield make
    for ledger in opened:
        with contextlib.suppress(Exception):
            await ledger.close()
    drop_ledger(url, prefix)


class TestOpenSearchLedger(LedgerContract):
    pass


async def test_an_unreachable_ledger_is_unavailable_within_its_timeout() -> None:
    url = opensearch_url_or_skip()
    prefix = unique_prefix("ledger")
    host, port = host_port(url)
    proxy = TcpProxy(host, port)
    await proxy.start()
    ledger = OpenSearchLedger(proxy.url, index_prefix=prefix, timeout_s=0.5)
    try:
        await ledger.start()
        assert (await ledger.reserve_search(rid(), 3, 3)).allowed
        for fault in ("blackhole", "refuse"):
            if fault == "blackhole":
                proxy.blackhole()
            else:
                await proxy.refuse()
            started = time.monotonic()
            with pytest.raises(LedgerUnavailable):
                await ledger.reserve_search(rid(), 3, 3)
            assert time.monotonic() - started < 2.0
            await proxy.resume()
        assert (await ledger.reserve_search(rid(), 3, 3)).allowed
    finally:
        await ledger.close()
        await proxy.close()
        drop_ledger(url, prefix)


async def test_a_service_whose_ledger_node_is_down_never_reports_empty(e5_embedder: EmbeddingBackend, tmp_path: Path) -> None:
    """The embedded engine answers; only the OpenSearch ledger sits behind the proxy."""
    url = opensearch_url_or_skip()
    prefix = unique_prefix("ledger")
    host, port = host_port(url)
    proxy = TcpProxy(host, port)
    await proxy.start()
    cfg = dataclasses.replace(Config(), data_dir=tmp_path / "data", reranker_model="", ledger_backend="opensearch",
                              ledger_opensearch_url=proxy.url, opensearch_index_prefix=prefix, ledger_timeout_s=0.5)
    live = await launch(cfg, e5_embedder)
    try:
        assert result_of(await live.retrieve(query="invoice", top_k=1, run_id=rid())).outcome == FOUND
        for fault in ("blackhole", "refuse"):
            if fault == "blackhole":
                proxy.blackhole()
            else:
                await proxy.refuse()
            started = time.monotonic()
            in_run = result_of(await live.retrieve(query="can I get a PDF invoice", top_k=2, run_id=rid()))
            waited = time.monotonic() - started
            free = result_of(await live.retrieve(query="can I get a PDF invoice", top_k=2))
            await proxy.resume()
            # In a run: the budget cannot be enforced, so nothing is searched: BACKEND_ERROR.
            assert in_run.outcome == types_pb2.ATTEMPT_OUTCOME_BACKEND_ERROR, fault
            assert in_run.stopping_reason == "ledger_unavailable" and not in_run.legs and waited < 3.0
            # Without a run the search stands, and its record lands once the node is back.
            assert free.outcome == FOUND
            for _ in range(150):
                try:
                    await live.retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=free.attempt_id))
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"{fault}: the attempt was never recorded after the ledger came back")
    finally:
        await shutdown(live)
        await proxy.close()
        drop_ledger(url, prefix)
