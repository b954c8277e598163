"""Test helpers for a real OpenSearch node (never a mock).

``opensearch_url_or_skip()`` is the one gate every OpenSearch test goes through: it returns
``OPENSEARCH_URL`` when that node answers; otherwise it skips loudly, except under
``CI=true`` where a missing node is a failure (CI must run these tests).

Each test works under its own index prefix and drops its indices afterwards, so tests can
share one node (and run against a developer's node without touching its data).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from service.engines.base import Engine
from service.engines.opensearch.engine import OpenSearchEngine

START_HINT = (
    "start one with `deploy/opensearch/opensearch.sh start` (fetches OpenSearch + k-NN "
    "with Maven, binds 127.0.0.1:9200) and export OPENSEARCH_URL=http://127.0.0.1:9200"
)

K = TypeVar("K")


def _http(method: str, url: str, timeout: float = 5.0) -> tuple[int, Any]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if body else None
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body) if body else None
        except ValueError:
            return exc.code, body.decode(errors="replace")


def _probe(url: str) -> str | None:
    """Why ``url`` is not a usable node, or None when it is."""
    try:
        status, body = _http("GET", f"{url.rstrip('/')}/_cluster/health", timeout=3.0)
    except (OSError, ValueError) as exc:
        return f"{url} is not reachable ({exc})"
    if status != 200 or not isinstance(body, dict):
        return f"{url} answered HTTP {status}"
    if body.get("status") not in ("green", "yellow"):
        return f"{url} cluster health is {body.get('status')}"
    return None


def bench_node_or_none(url: str) -> str | None:
    """For the bench scripts: ``url`` without a trailing slash when it is a usable node,
    else None after saying why on stderr (the script then exits 2)."""
    problem = _probe(url)
    if problem:
        print(f"no OpenSearch: {problem}; start one with deploy/opensearch/opensearch.sh start", file=sys.stderr)
        return None
    return url.rstrip("/")


def opensearch_url_or_skip() -> str:
    """The URL of a healthy node; skip (or fail under CI=true) without one."""
    url = os.environ.get("OPENSEARCH_URL", "").strip()
    problem = _probe(url) if url else "OPENSEARCH_URL is not set"
    if problem is None:
        return url.rstrip("/")
    message = f"REAL OPENSEARCH NEEDED: {problem}; {START_HINT}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (CI=true: these tests must run, not skip)", pytrace=False)
    pytest.skip(message)


def unique_prefix(tag: str = "t") -> str:
    """A fresh index prefix (lower case, as OpenSearch index names must be)."""
    return f"test-{tag}-{uuid.uuid4().hex[:12]}"


def drop_prefix(url: str, prefix: str) -> None:
    """Delete every index and the template of ``prefix`` (synchronous: usable in any
    finalizer, even after the engine and its event loop are gone)."""
    base = url.rstrip("/")
    for pattern in (f"{prefix}-chunks-v*", f"{prefix}-ledger-*"):  # a service's ledger lives there too
        status, body = _http("GET", f"{base}/{pattern}?ignore_unavailable=true&allow_no_indices=true")
        if status == 200 and isinstance(body, dict) and body:
            _http("DELETE", f"{base}/{','.join(sorted(body))}")
    _http("DELETE", f"{base}/_index_template/{prefix}-chunks")


def engine_factory(
    request: pytest.FixtureRequest,
    dimension: int,
    request_timeout_s: float = 10.0,
    url: str | None = None,
) -> Callable[[], OpenSearchEngine]:
    """Build engines on one fresh prefix, dropped when ``request``'s scope ends."""
    url = url or opensearch_url_or_skip()
    prefix = unique_prefix()
    request.addfinalizer(lambda: drop_prefix(url, prefix))

    def make() -> OpenSearchEngine:
        return OpenSearchEngine(
            url, index_prefix=prefix, dimension=dimension, request_timeout_s=request_timeout_s
        )

    return make


def opensearch_kit(request: pytest.FixtureRequest, kit_cls: Callable[..., K], dimension: int) -> K:
    """The contract suite's ``EngineKit`` for OpenSearch: ``reopen`` = a new engine object
    on the same indices (what a service restart does); no ``saturate`` (a real node has no
    pool a test can fill; tests/fault covers timeouts with a proxy and SIGSTOP)."""
    make = engine_factory(request, dimension)
    kit: Any = kit_cls(kind="opensearch", engine=make())

    async def reopen() -> Engine:
        await kit.engine.close()
        kit.engine = make()
        await kit.engine.start()
        engine: Engine = kit.engine
        return engine

    kit.reopen = reopen
    return kit  # type: ignore[no-any-return]


def host_port(url: str) -> tuple[str, int]:
    """``http://host:port`` -> (host, port), for proxies placed in front of a node."""
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 9200
