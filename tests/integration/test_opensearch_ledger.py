"""The ledger contract on a real OpenSearch node, and a ledger node that stops answering
(behind tests/support/tcp_proxy.py): unavailable, never "nothing there"."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from service.ledger.base import Ledger, LedgerUnavailable
from service.ledger.opensearch import OpenSearchLedger
from tests.support.opensearch import host_port, opensearch_url_or_skip, unique_prefix
from tests.support.service_live import http_json
from tests.support.tcp_proxy import TcpProxy
from tests.unit.ledger.contract import LedgerContract, OpenLedger, rid

pytestmark = pytest.mark.integration


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
