"""IngestStream through the real server: per-document acks with errors, every acknowledged
document searchable; the connection cut mid-stream by a proxy (tests/support/tcp_proxy.py):
what was acknowledged is there, and re-sending the same documents indexes only what is
missing; the CLI counts acknowledged documents and says what committed when the stream broke."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from service._gen.retrieval.v1 import corpus_pb2, types_pb2
from service.models.dummy import HashEmbedder
from tests.support.harness import Live, StartServer
from tests.support.ingest_stream import Acks, stream_documents
from tests.support.tcp_proxy import TcpProxy

ROOT = Path(__file__).resolve().parents[2]
N_DOCS = 400


def _doc(i: int) -> corpus_pb2.Document:
    body = " ".join(f"Section {i}.{k}: kayak rental rules, pier hours and safety notes." for k in range(20))
    return corpus_pb2.Document(source_id=f"s-{i}", version="v1", title=f"Doc {i}", text=body,
                               collection=types_pb2.COLLECTION_DOC)


async def _visible(live: Live, ack: corpus_pb2.DocumentAck) -> bool:
    got = await live.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id=f"{ack.source_id}#0@{ack.version}"))
    return got.fidelity == corpus_pb2.FIDELITY_EXACT


@pytest.fixture
async def live(start_server: StartServer) -> Live:
    return await start_server(embedder=HashEmbedder(), demo=False, ingest_max_in_flight=8)


async def test_acks_per_document_with_errors(live: Live) -> None:
    docs = [_doc(i) for i in range(10)] + [corpus_pb2.Document(source_id="bad id", version="v1", text="x",
                                                               collection=types_pb2.COLLECTION_DOC)]

    async def requests() -> AsyncIterator[corpus_pb2.IngestStreamRequest]:
        for i, d in enumerate(docs):
            yield corpus_pb2.IngestStreamRequest(document=d, sequence=100 + i)

    acks: dict[int, corpus_pb2.DocumentAck] = {}
    async for response in live.corpus.IngestStream(requests(), timeout=60):
        assert response.max_in_flight == 8
        for ack in response.acks:
            assert ack.sequence not in acks, "acknowledged twice"
            acks[ack.sequence] = ack
            if ack.status == corpus_pb2.DOCUMENT_STATUS_INDEXED:
                assert await _visible(live, ack), "acknowledged but not searchable"
        assert response.acknowledged_total == len(acks)
    assert sorted(acks) == list(range(100, 111))
    assert acks[110].status == corpus_pb2.DOCUMENT_STATUS_INVALID and acks[110].field == "document.source_id"
    assert all(acks[s].status == corpus_pb2.DOCUMENT_STATUS_INDEXED and acks[s].chunks > 0 for s in range(100, 110))


async def _stream_through(target: str, docs: list[corpus_pb2.Document], cut: TcpProxy | None = None,
                          cut_after: int = 0) -> tuple[Acks, grpc.aio.AioRpcError | None]:
    async def maybe_cut(acks: Acks) -> None:
        if cut is not None and len(acks) >= cut_after:
            await cut.refuse()  # the connection drops mid-stream

    return await stream_documents(target, docs, timeout=120, on_response=maybe_cut)


async def test_connection_cut_mid_stream_then_rerun_indexes_only_what_is_missing(live: Live) -> None:
    host, port = live.target.rsplit(":", 1)
    proxy = await TcpProxy(host, int(port)).start()
    docs = [_doc(i) for i in range(N_DOCS)]
    try:
        first, err = await _stream_through(f"127.0.0.1:{proxy.port}", docs, cut=proxy, cut_after=20)
        # UNAVAILABLE when the client was reading; grpc's client reports a write into the
        # dropped connection as INTERNAL "Internal error from Core" (client side, not the server).
        assert err is not None and err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL), err
        assert 20 <= len(first) < N_DOCS, len(first)
        for ack in first.values():  # every acknowledged document is searchable
            assert ack.status == corpus_pb2.DOCUMENT_STATUS_INDEXED and await _visible(live, ack), ack

        await proxy.resume()
        second, err = await _stream_through(f"127.0.0.1:{proxy.port}", docs)
        assert err is None, err
        assert sorted(second) == list(range(1, N_DOCS + 1))
        unchanged = {s for s, a in second.items() if a.status == corpus_pb2.DOCUMENT_STATUS_UNCHANGED}
        indexed = {s for s, a in second.items() if a.status == corpus_pb2.DOCUMENT_STATUS_INDEXED}
        assert set(first) <= unchanged, "a document acknowledged before the cut was written again"
        assert unchanged | indexed == set(second)
        # What was written by the second run is exactly what the first did not commit
        # (sent-but-unacknowledged documents may have committed before the server saw the cut).
        assert len(indexed) <= N_DOCS - len(first)
    finally:
        await proxy.close()


async def test_cli_progress_counts_acks_and_reports_a_broken_stream(live: Live, tmp_path: Path) -> None:
    host, port = live.target.rsplit(":", 1)
    proxy = await TcpProxy(host, int(port)).start()
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"source_id": f"c-{i}", "version": "v1", "title": f"Doc {i}",
                                        "text": _doc(i).text, "collection": "doc"}) + "\n" for i in range(N_DOCS)))
    cmd = [sys.executable, "-m", "service", "ingest", str(path), "--target", f"127.0.0.1:{proxy.port}", "--window", "16"]
    try:
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        seen = b""
        while True:  # cut once the progress bar shows acknowledged documents
            chunk = await asyncio.wait_for(proc.stderr.read(256), 60)
            assert chunk, f"CLI ended before the cut: {seen.decode(errors='replace')}"
            seen += chunk
            counts = [int(n) for n in re.findall(rb"(\d+)/%d" % N_DOCS, seen)]
            if counts and max(counts) >= 10:
                break
        await proxy.refuse()
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        text = out.decode()
        assert proc.returncode == 3, text
        assert "stream broke (" in text and "re-run the same file" in text, text
        committed = int(re.search(r"(\d+) documents committed", text).group(1))  # type: ignore[union-attr]
        assert 10 <= committed < N_DOCS, text

        await proxy.resume()
        rerun = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(rerun.communicate(), 120)
        text = out.decode()
        assert rerun.returncode == 0, text + err.decode()
        indexed = int(re.search(r"indexed (\d+)", text).group(1))  # type: ignore[union-attr]
        unchanged = int(re.search(r"unchanged (\d+)", text).group(1))  # type: ignore[union-attr]
        assert indexed + unchanged == N_DOCS and unchanged >= committed, text
    finally:
        await proxy.close()
