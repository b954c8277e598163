"""One live server for the client tests in tests/e2e/clients (Python, Go, TypeScript), with
API keys on so an ACL-restricted caller exists, and helpers that run each language's own
tooling against it.

The server runs in process on pytest's event loop (tests/support/harness.py), so the Go and
Node processes are awaited as asyncio subprocesses while it keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from service.config import Config
from service.models.base import EmbeddingBackend
from service.models.dummy import HashEmbedder
from tests.support.harness import Live, demo_documents, launch, shutdown

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "tests" / "e2e" / "clients" / "golden_scenarios.json"
GO_CLIENT = ROOT / "clients" / "go"
TS_CLIENT = ROOT / "clients" / "ts"
API_KEYS: dict[str, str] = json.loads(SCENARIOS.read_text())["api_keys"]


@dataclasses.dataclass
class ClientServer:
    live: Live
    target: str
    support_key: str  # a principal in the "support" group (sees internal-escalation)
    public_key: str  # a principal in no group
    tls_target: str  # the same server behind a TLS terminator (ALPN h2) ...
    tls_ca: Path  # ... whose self-signed certificate (for 127.0.0.1) this is

    def env(self) -> dict[str, str]:
        """What the Go and Node test suites read to find the server."""
        return {**os.environ, "RETRIEVAL_TARGET": self.target, "RETRIEVAL_API_KEY": self.support_key,
                "RETRIEVAL_PUBLIC_API_KEY": self.public_key, "RETRIEVAL_TLS_TARGET": self.tls_target,
                "RETRIEVAL_TLS_CA": str(self.tls_ca)}


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def tls_terminator(tmp: Path, upstream: str) -> tuple[asyncio.Server, str, Path]:
    """The server has no TLS listener of its own yet, so the clients' TLS options are
    tested through this: TLS 1.2+ with ALPN h2 (what gRPC clients require) on a loopback
    port, plaintext HTTP/2 to the server. The certificate is made here with openssl."""
    cert, key = tmp / "tls-cert.pem", tmp / "tls-key.pem"
    subprocess.run([need("openssl"), "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    host, port = upstream.rsplit(":", 1)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}", cert


@pytest.fixture(scope="session")
async def client_server(tmp_path_factory: pytest.TempPathFactory,
                        e5_embedder: EmbeddingBackend) -> AsyncIterator[ClientServer]:
    tmp = tmp_path_factory.mktemp("clients")
    keys = tmp / "keys.toml"
    keys.write_text("".join(f'[[principals]]\nname = "{name}-bot"\napi_key = "{key}"\n'
                            f'groups = {json.dumps(["support"] if name == "support" else [])}\n\n'
                            for name, key in API_KEYS.items()))
    cfg = dataclasses.replace(Config(), data_dir=tmp / "data", reranker_model="", api_keys_file=str(keys))
    # The Latin-script leg served by the hashing stand-in: every client sees the default's
    # third leg (LEG_KIND_KNN_LATIN) whether or not this machine built bge-small-en.
    live = await launch(cfg, e5_embedder, demo=False, latin_embedder=HashEmbedder())
    summary = await live.ingest(demo_documents(), metadata=(("x-api-key", API_KEYS["support"]),))
    assert not summary.errors and summary.documents_indexed == len(demo_documents()), summary
    terminator, tls_target, ca = await tls_terminator(tmp, live.target)
    yield ClientServer(live, live.target, API_KEYS["support"], API_KEYS["public"], tls_target, ca)
    terminator.close()
    await shutdown(live)


@dataclasses.dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str

    def check(self, what: str) -> Ran:
        assert self.returncode == 0, f"{what} exited {self.returncode}\n--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-6000:]}"
        return self


async def run(*argv: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> Ran:
    """Run a command without blocking the event loop the server lives on."""
    proc = await asyncio.create_subprocess_exec(*argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"{' '.join(argv)} ran past {timeout}s") from None
    return Ran(proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))


def need(tool: str) -> str:
    """Go and Node are part of the toolchain `make test` needs; their absence is a failure."""
    path = shutil.which(tool)
    assert path, f"{tool} is not on PATH: the Go and TypeScript client tests need it (see README)"
    return path


_ts_lock: asyncio.Lock | None = None
_ts_built = False


async def ts_built() -> Path:
    """clients/ts installed exactly from its lock file (a clean clone has no node_modules)
    and compiled with tsc --strict into clients/ts/dist, once per session."""
    global _ts_lock, _ts_built
    _ts_lock = _ts_lock or asyncio.Lock()
    async with _ts_lock:
        if not _ts_built:
            need("node")
            lock = TS_CLIENT / "package-lock.json"
            installed = TS_CLIENT / "node_modules" / ".installed"  # the Makefile's ts-deps stamp
            if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
                (await run(need("npm"), "ci", "--no-audit", "--no-fund", "--loglevel=error", cwd=TS_CLIENT)).check("npm ci")
                installed.touch()
            shutil.rmtree(TS_CLIENT / "dist", ignore_errors=True)
            (await run(str(TS_CLIENT / "node_modules" / ".bin" / "tsc"), "-p", "tsconfig.json",
                       cwd=TS_CLIENT)).check("tsc --strict")
            _ts_built = True
    return TS_CLIENT / "dist"
