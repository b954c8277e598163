"""The real service against a real OpenSearch: in-process (``start_live``, the harness's
``Live``) or as ``python -m service serve`` processes (``ServiceProcess``), plus nodes and
clusters of our own started with deploy/opensearch/opensearch.sh (``ScriptNodes``).

Nothing here mocks anything: faults come from tests/support/tcp_proxy.py or from signals.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service._gen.retrieval.v1 import (
    corpus_pb2,
    corpus_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
)
from service.config import Config
from service.models.base import EmbeddingBackend
from tests.support.harness import Live, launch, shutdown
from tests.support.tcp_proxy import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "opensearch" / "opensearch.sh"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# -- in-process ------------------------------------------------------------------------------

async def start_live(cfg: Config, embedder: EmbeddingBackend, latin_embedder: EmbeddingBackend | None = None) -> Live:
    """Build and start the real App + Server on a loopback port, with an empty corpus."""
    return await launch(cfg, embedder, demo=False, latin_embedder=latin_embedder)


stop_live = shutdown


async def health_status(channel: grpc.aio.Channel, service: str = "", timeout: float = 2.0) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return int(resp.status)


async def wait_health(channel: grpc.aio.Channel, want: int, timeout_s: float, service: str = "") -> float:
    """Poll health until it reports ``want``; seconds it took. Fails after ``timeout_s``."""
    started = time.monotonic()
    last: int | None = None
    while True:
        try:
            last = await health_status(channel, service)
        except grpc.aio.AioRpcError:
            last = None
        if last == want:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name
            raise AssertionError(
                f"health did not turn {name(want)} within {timeout_s}s "
                f"(last: {name(last) if last is not None else 'unreachable'})")
        await asyncio.sleep(0.1)


# -- a service process -----------------------------------------------------------------------

@dataclasses.dataclass
class ServiceProcess:
    """``python -m service serve`` in its own process, with its own data dir."""

    proc: subprocess.Popen[bytes]
    target: str
    log_path: Path
    channel: grpc.aio.Channel
    retrieval: retrieval_pb2_grpc.RetrievalServiceStub
    corpus: corpus_pb2_grpc.CorpusServiceStub

    @classmethod
    def spawn(cls, opensearch_url: str, data_dir: Path, env: dict[str, str] | None = None) -> ServiceProcess:
        port = free_port()
        target = f"127.0.0.1:{port}"
        data_dir.mkdir(parents=True, exist_ok=True)
        log_path = data_dir / "serve.log"
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        # An empty opensearch_url serves the embedded engine (and the SQLite ledger).
        engine = ["--opensearch-url", opensearch_url] if opensearch_url else []
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "service", "serve", *engine, "--listen", target, "--data-dir", str(data_dir)],
                cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        channel = grpc.aio.insecure_channel(target)
        return cls(proc, target, log_path, channel, retrieval_pb2_grpc.RetrievalServiceStub(channel),
                   corpus_pb2_grpc.CorpusServiceStub(channel))

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    async def wait_serving(self, timeout_s: float = 120.0) -> float:
        """Seconds until health says SERVING (models loaded, engine ready)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise AssertionError(f"service exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if await health_status(self.channel) == SERVING:
                    return time.monotonic() - started
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.25)
        raise AssertionError(f"service not SERVING within {timeout_s}s:\n{self.log_tail()}")

    async def retrieve(self, timeout: float = 10.0, **fields: Any) -> list[retrieval_pb2.RetrieveEvent]:
        req = retrieval_pb2.RetrieveRequest(**fields)
        return [ev async for ev in self.retrieval.Retrieve(req, timeout=timeout)]

    async def ingest(self, docs: list[corpus_pb2.Document], timeout: float = 60.0) -> corpus_pb2.IngestSummary:
        async def gen() -> AsyncIterator[corpus_pb2.IngestRequest]:
            for d in docs:
                yield corpus_pb2.IngestRequest(document=d)

        summary: corpus_pb2.IngestSummary = await self.corpus.Ingest(gen(), timeout=timeout)
        return summary

    async def stop(self) -> None:
        await self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the server drains and exits
            try:
                await asyncio.to_thread(self.proc.wait, 15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait, 10)


# -- nodes of our own ------------------------------------------------------------------------

def _skip_or_fail(message: str) -> None:
    message = f"REAL OPENSEARCH NEEDED: {message}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (CI=true: these tests must run, not skip)", pytrace=False)
    pytest.skip(message)


@dataclasses.dataclass
class ScriptNodes:
    """1 or 2 OpenSearch nodes of our own on loopback (deploy/opensearch/opensearch.sh):
    SIGSTOP or stopping a node must never touch the node other tests share."""

    port: int
    nodes: int = 1
    heap: str = "512m"
    start_timeout_s: int = 360
    pids: list[int] = dataclasses.field(default_factory=list)
    start_s: float = 0.0
    run_dir: Path | None = None  # the launcher's state for this port (pid files, node configs)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(SCRIPT), *args, "--port", str(self.port)], capture_output=True,
                              text=True, timeout=timeout, check=True)

    def start(self) -> ScriptNodes:
        """Start the nodes (skip, or fail under CI=true, when that is impossible)."""
        started = time.monotonic()
        try:
            # A 2-core machine shared with other work can take minutes to bring nodes up.
            out = self._run("start", "--nodes", str(self.nodes), "--heap", self.heap,
                            "--timeout", str(self.start_timeout_s), timeout=self.start_timeout_s + 120)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            _skip_or_fail(f"could not start {self.nodes} node(s) on port {self.port}: {detail[-800:]}")
        self.start_s = time.monotonic() - started
        match = re.search(r"^pids: ([\d ]+)$", out.stdout, re.MULTILINE)
        assert match, out.stdout
        self.pids = [int(p) for p in match.group(1).split()]
        run_dir = re.search(r"^run-dir: (.+)$", out.stdout, re.MULTILINE)
        self.run_dir = Path(run_dir.group(1)) if run_dir else None
        return self

    def stop_node(self, index: int) -> None:
        self._run("stop", "--node", str(index), timeout=120)

    def start_node(self, index: int) -> None:
        self._run("start", "--node", str(index), "--timeout", str(self.start_timeout_s),
                  timeout=self.start_timeout_s + 120)

    def stop(self) -> None:
        subprocess.run([str(SCRIPT), "stop", "--port", str(self.port)], capture_output=True,
                       timeout=120, check=False)

    def health(self, query: str = "", timeout: float = 5.0) -> dict[str, Any]:
        status, body = http_json("GET", f"{self.url}/_cluster/health{query}", timeout=timeout)
        assert isinstance(body, dict), (status, body)
        return body


def http_json(method: str, url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
    """One JSON request to a node (for the few admin calls tests make directly)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def cat_shards(url: str, index_pattern: str) -> list[dict[str, Any]]:
    """``_cat/shards`` of the indices matching ``index_pattern`` (JSON rows)."""
    status, body = http_json("GET", f"{url}/_cat/shards/{index_pattern}?format=json")
    assert status == 200, (status, body)
    rows: list[dict[str, Any]] = body if isinstance(body, list) else json.loads(body)
    return rows
