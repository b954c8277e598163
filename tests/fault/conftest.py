"""Fixtures for the OpenSearch fault tests: the real node, and a TCP proxy in front of it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.opensearch import host_port, opensearch_url_or_skip
from tests.support.tcp_proxy import TcpProxy


@pytest.fixture
async def node_url() -> str:
    return opensearch_url_or_skip()


@pytest.fixture
async def proxy(node_url: str) -> AsyncIterator[TcpProxy]:
    p = await TcpProxy(*host_port(node_url)).start()
    try:
        yield p
    finally:
        await p.close()
