"""TLS by configuration: server-only TLS (Python client and CLI with a CA), mutual TLS with
the client certificate's subject as the principal, certificates from another CA refused,
and the rule that a non-loopback listener needs auth (or an explicit --insecure-open)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from retrieval_client import RetrievalClient, TlsOptions, UnavailableError

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc, types_pb2
from service.models.dummy import HashEmbedder
from tests.support.certs import Certs, make_certs
from tests.support.harness import StartServer
from tests.support.tcp_proxy import free_port

ROOT = Path(__file__).resolve().parents[2]
DOC = {"source_id": "tls-doc", "version": "v1", "title": "Kayaks", "collection": "doc",
       "text": "Kayaks can be rented at the north pier for 20 euros per hour.", "acl": ["support"]}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"), clients=("tls-agent", "stranger"))


async def test_server_tls_with_python_client_and_cli(start_server: StartServer, certs: Certs) -> None:
    live = await start_server(embedder=HashEmbedder(), demo=False,
                              tls_cert_file=certs.server_cert, tls_key_file=certs.server_key)
    tls = TlsOptions(ca_file=certs.ca)
    async with RetrievalClient(live.target, tls=tls) as client:
        summary = await client.ingest([{**DOC, "acl": []}])
        assert summary.documents_indexed == 1
        attempt = await client.retrieve("kayak rental pier", top_k=1)
        assert attempt.found and attempt.evidence[0].source_id == "tls-doc"
    async with RetrievalClient(live.target, timeout=3) as plaintext:  # the server speaks TLS only
        with pytest.raises(UnavailableError):
            await plaintext.retrieve("kayak", top_k=1)

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service", "query", "kayak rental pier", "--target", live.target, "--tls-ca", certs.ca,
        "--top-k", "1", cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert "tls-doc" in out.decode() and "outcome EVIDENCE_FOUND" in out.decode()


async def test_mutual_tls_client_subject_is_the_principal(start_server: StartServer, certs: Certs, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[[principals]]\nname = "support-agent"\nclient_subject = "tls-agent"\ngroups = ["support"]\n\n'
                    '[[principals]]\nname = "keyed"\napi_key = "k1"\n')
    live = await start_server(embedder=HashEmbedder(), demo=False, api_keys_file=str(keys),
                              tls_cert_file=certs.server_cert, tls_key_file=certs.server_key,
                              tls_client_ca_file=certs.ca)
    cert, key = certs.client("tls-agent")
    async with RetrievalClient(live.target, tls=TlsOptions(ca_file=certs.ca, cert_file=cert, key_file=key)) as agent:
        assert (await agent.ingest([DOC])).documents_indexed == 1
        attempt = await agent.retrieve("kayak rental pier", top_k=1)
        assert attempt.found and attempt.evidence[0].source_id == "tls-doc"  # its groups see the support doc
        record = await agent.get_attempt(attempt.attempt_id)
        assert record.principal == "support-agent"

    # A valid certificate of an unknown subject needs an API key; with one it is that principal.
    cert, key = certs.client("stranger")
    creds = grpc.ssl_channel_credentials(Path(certs.ca).read_bytes(), Path(key).read_bytes(), Path(cert).read_bytes())
    async with grpc.aio.secure_channel(live.target, creds) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        req = retrieval_pb2.RetrieveRequest(query="kayak rental pier", top_k=1)
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await stub.Lookup(req, timeout=5)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED and "stranger" in (denied.value.details() or "")
        keyed = await stub.Lookup(req, timeout=5, metadata=(("x-api-key", "k1"),))
        assert keyed.evidence_status != types_pb2.EVIDENCE_STATUS_EVIDENCE_FOUND  # 'keyed' has no support group

    # No client certificate, or one from another CA: the handshake fails.
    for options in (TlsOptions(ca_file=certs.ca), TlsOptions(ca_file=certs.ca, cert_file=str(certs.dir / "rogue.pem"),
                                                            key_file=str(certs.dir / "rogue.key"))):
        async with RetrievalClient(live.target, tls=options, timeout=3) as refused:
            with pytest.raises(UnavailableError):
                await refused.retrieve("kayak", top_k=1)


async def test_mutual_tls_without_keys_file_names_the_principal_by_common_name(
        start_server: StartServer, certs: Certs) -> None:
    live = await start_server(embedder=HashEmbedder(), demo=False, tls_cert_file=certs.server_cert,
                              tls_key_file=certs.server_key, tls_client_ca_file=certs.ca)
    cert, key = certs.client("stranger")
    creds = grpc.ssl_channel_credentials(Path(certs.ca).read_bytes(), Path(key).read_bytes(), Path(cert).read_bytes())
    async with grpc.aio.secure_channel(live.target, creds) as channel:
        corpus = corpus_pb2_grpc.CorpusServiceStub(channel)

        async def one() -> object:
            yield corpus_pb2.IngestRequest(document=corpus_pb2.Document(
                source_id="cn-doc", version="v1", text="Piers and kayaks.", collection=types_pb2.COLLECTION_DOC))

        await corpus.Ingest(one(), timeout=10)
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        events = [ev async for ev in stub.Retrieve(retrieval_pb2.RetrieveRequest(query="kayaks", top_k=1), timeout=10)]
        record = await stub.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=events[-1].result.attempt_id))
        assert record.attempt.principal == "stranger"


def _serve(*args: str, tmp: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "RETRIEVAL_EMBEDDING_MODEL": "dummy-hash", "RETRIEVAL_RERANKER_MODEL": "", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "service", "serve", "--data-dir", str(tmp / "data"), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_non_loopback_without_auth_refuses_unless_insecure_open(tmp_path: Path) -> None:
    port = free_port()
    refused = _serve("--listen", f"0.0.0.0:{port}", tmp=tmp_path)
    out, _ = refused.communicate(timeout=60)
    assert refused.returncode == 2, out
    assert "refusing to listen on 0.0.0.0" in out and "--insecure-open" in out

    opened = _serve("--listen", f"0.0.0.0:{port}", "--insecure-open", tmp=tmp_path)
    try:
        assert opened.stdout is not None
        first = opened.stdout.readline()
        assert "auth OFF on non-loopback" in first, first
    finally:
        opened.terminate()
        opened.wait(30)

    loopback = _serve("--listen", f"127.0.0.1:{port}", tmp=tmp_path)
    try:
        assert loopback.stdout is not None
        first = loopback.stdout.readline()
        assert "auth OFF: listening on loopback" in first, first
    finally:
        loopback.terminate()
        loopback.wait(30)
