"""The rerank stage with a real ONNX cross-encoder, API-key auth and ACLs, and ingest
error reporting and idempotency, all through real gRPC."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from service._gen.retrieval.v1 import corpus_pb2, retrieval_pb2, types_pb2
from service.offline.builder import default_models_dir
from service.offline.builder.tiny_cross_encoder import build_tiny_cross_encoder
from service.models.onnx_cross_encoder import load_cross_encoder
from tests.support.harness import DEFAULT_EMBEDDER, StartServer, demo_documents, evidence_of, result_of

pytestmark = pytest.mark.slow


async def test_rerank_leg_runs_a_real_onnx_cross_encoder(start_server: StartServer, tmp_path: Path) -> None:
    model = build_tiny_cross_encoder(tmp_path / "ce", default_models_dir() / DEFAULT_EMBEDDER / "tokenizer.json")
    live = await start_server(reranker=load_cross_encoder(model, threads=1))
    events = await live.retrieve(query="reset password", top_k=5)
    result = result_of(events)
    rerank = next(leg for leg in result.legs if leg.kind == types_pb2.LEG_KIND_RERANK)
    assert rerank.status == types_pb2.LEG_STATUS_OK and rerank.hit_count > 0
    assert rerank.timing.inference_ms > 0
    items = evidence_of(events)
    assert all(e.HasField("rerank_score") for e in items)
    assert [e.rerank_score for e in items] == sorted((e.rerank_score for e in items), reverse=True)
    assert result.quality_source == types_pb2.QUALITY_SOURCE_RERANKER_PROBABILITY
    assert len(result.model_ids) == 2
    off = result_of(await live.retrieve(query="reset password", top_k=5,
                                        options=retrieval_pb2.RetrievalOptions(rerank=types_pb2.RERANK_MODE_OFF)))
    leg = next(leg for leg in off.legs if leg.kind == types_pb2.LEG_KIND_RERANK)
    assert leg.status == types_pb2.LEG_STATUS_SKIPPED and leg.detail == "disabled by request"


async def test_api_keys_map_to_principals_and_their_groups(start_server: StartServer, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[[principals]]\nname = "support-bot"\napi_key = "s3cret"\ngroups = ["support"]\n\n'
                    '[[principals]]\nname = "public-bot"\napi_key = "pub"\ngroups = []\n')
    live = await start_server(api_keys_file=str(keys), demo=False)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await live.retrieve(query="x", top_k=1)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await live.retrieve(query="x", top_k=1, metadata=(("x-api-key", "wrong"),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    summary = await live.ingest(demo_documents(), metadata=(("x-api-key", "s3cret"),))
    assert not summary.errors
    support = (("x-api-key", "s3cret"),)
    public = (("x-api-key", "pub"),)
    q = dict(query="orion-pager escalation", top_k=3)
    assert evidence_of(await live.retrieve(metadata=support, **q))[0].source_id == "internal-escalation"
    assert all(e.source_id != "internal-escalation" for e in evidence_of(await live.retrieve(metadata=public, **q)))
    rid = result_of(await live.retrieve(metadata=support, **q)).attempt_id
    rec = await live.retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=rid), metadata=support)
    assert rec.attempt.principal == "support-bot"


async def test_ingest_reports_each_bad_document_and_keeps_the_rest(start_server: StartServer) -> None:
    live = await start_server()
    before = result_of(await live.retrieve(query="reset password", top_k=1))
    docs = [
        corpus_pb2.Document(source_id="ok-1", version="v1", title="Gardening", text="Water tomatoes every morning.",
                            collection=types_pb2.COLLECTION_DOC),
        corpus_pb2.Document(source_id="bad id", version="v1", text="x", collection=types_pb2.COLLECTION_DOC),
        corpus_pb2.Document(source_id="no-text", version="v1", text="  ", collection=types_pb2.COLLECTION_DOC),
        corpus_pb2.Document(source_id="no-coll", version="v1", text="text"),
    ]
    summary = await live.ingest(docs)
    assert summary.documents_received == 4 and summary.documents_indexed == 1
    assert [(e.index, e.field) for e in summary.errors] == [
        (1, "document.source_id"), (2, "document.text"), (3, "document.collection")]
    assert summary.chunks_per_second > 0
    after = result_of(await live.retrieve(query="reset password", top_k=1))
    assert after.outcome == before.outcome == types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND
    assert evidence_of(await live.retrieve(query="tomatoes watering", top_k=1))[0].source_id == "ok-1"


async def test_reingest_is_idempotent_and_new_content_replaces_only_that_version(start_server: StartServer) -> None:
    live = await start_server()
    again = await live.ingest(demo_documents())
    assert again.documents_unchanged == len(demo_documents()) and again.documents_indexed == 0
    changed = corpus_pb2.Document(source_id="release-notes", version="v2.4", title="Release notes v2.4",
                                  text="Version v2.4 adds passkeys.", collection=types_pb2.COLLECTION_DOC)
    summary = await live.ingest([changed])
    assert summary.documents_indexed == 1
    v23 = await live.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id="release-notes#0@v2.3"))
    assert v23.fidelity == corpus_pb2.FIDELITY_EXACT and "offline sync" in v23.evidence.excerpt
    v24 = await live.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id="release-notes#0@v2.4"))
    assert "passkeys" in v24.evidence.excerpt
    gone = await live.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id="release-notes#1@v2.4"))
    assert gone.fidelity == corpus_pb2.FIDELITY_DEGRADED


async def test_delete_document_removes_one_version(start_server: StartServer) -> None:
    live = await start_server()
    res = await live.corpus.DeleteDocument(corpus_pb2.DeleteDocumentRequest(source_id="release-notes", version="v2.3"))
    assert res.chunks_deleted == 2
    items = evidence_of(await live.retrieve(query="release notes", top_k=10))
    assert all(e.version != "v2.3" for e in items if e.source_id == "release-notes")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await live.corpus.DeleteDocument(corpus_pb2.DeleteDocumentRequest(source_id="release-notes", version="v2.3"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_the_reranker_reads_the_title_and_breadcrumb_the_first_stage_read(start_server: StartServer) -> None:
    """A chunk is reranked as it was embedded and searched: title, breadcrumb, text. The
    overlap reranker scores the share of query terms in the passage it is handed, so terms
    found only in the section path count only if the breadcrumb reached it."""
    from service.models.dummy import OverlapCrossEncoder

    live = await start_server(reranker=OverlapCrossEncoder(), demo=False)
    doc = corpus_pb2.Document(source_id="retention", version="v1", title="Storage",
                              breadcrumb="Compliance > Legal hold", text="Deleted files are kept for 30 days.",
                              collection=types_pb2.COLLECTION_DOC)
    assert not (await live.ingest([doc])).errors
    [item] = evidence_of(await live.retrieve(query="legal hold storage", top_k=1,
                                             options=retrieval_pb2.RetrievalOptions(min_quality=1e-9)))
    assert item.breadcrumb == "Compliance > Legal hold"
    assert item.rerank_score == pytest.approx(5.0)  # every query term: "legal", "hold" (breadcrumb), "storage" (title)
