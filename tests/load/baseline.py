"""The baseline: the hybrid + rerank pipeline as a Python team would write it from the seed
tutorial, behind a plain ``grpc.aio`` servicer speaking the same retrieval.v1 RPCs (Retrieve
and Lookup, nothing else), so the load generator drives both servers the same way.

- BM25: ``rank_bm25.BM25Okapi`` over lower-cased ``\\w+`` tokens (Han characters one by one),
  ``get_scores`` over the whole corpus per query;
- dense: the same e5 ONNX model we serve (same weights, same tokenizer and prefixes), in an
  ``onnxruntime.InferenceSession`` with default options, the query embedded alone, then a
  numpy dot product against every passage vector;
- RRF with k = 60 over the top 100 of each list, equal weights;
- rerank: the same cross-encoder ONNX, in a default-options session, over the top 20 in one
  batch, ordered by its logit alone;
- the handler runs the whole pipeline in ``asyncio.to_thread`` (the default executor), one
  request per thread, no batching across requests.

It indexes the same passages our ingest produces (our chunker, ``title\\nbreadcrumb\\ntext``),
so both sides rank the same units with the same models, and passage vectors come from the
shared embedding cache (what our int8 model produced for that exact text) or are computed
at start: start-up cost is not what is compared.

    .venv/bin/python -m tests.load.baseline --corpus corpus.jsonl --listen 127.0.0.1:50061
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TOKEN = re.compile(r"[\u4e00-\u9fff]|[^\W\u4e00-\u9fff]+", re.UNICODE)
RRF_K = 60
DEPTH = 100
RERANK_TOP = 20


def tokenize(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


def default_session(backend: Any, path: Path) -> None:
    """What ``InferenceSession(path)`` gives a team that never tuned it."""
    import onnxruntime as ort

    backend._session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@dataclass
class Passage:
    source_id: str
    chunk_id: str
    text: str  # what is embedded and reranked


def passages_of(docs: Sequence[dict[str, Any]]) -> list[Passage]:
    from service.config import Config
    from service.engines.base import make_chunk_id
    from service.ingest.chunking import chunk_document, embedded_text

    cfg = Config()
    out = []
    for d in docs:
        title = str(d.get("title", ""))
        for p in chunk_document(str(d["text"]), str(d.get("breadcrumb", "")), str(d.get("collection", "doc")),
                                cfg.chunk_chars, cfg.parent_chars):
            out.append(Passage(d["source_id"], make_chunk_id(d["source_id"], p.index, d.get("version", "v1")),
                               embedded_text(title, p)))
    return out


class BaselinePipeline:
    def __init__(self, docs: Sequence[dict[str, Any]], models_dir: Path, *, embedding_model: str,
                 reranker_model: str) -> None:
        from rank_bm25 import BM25Okapi

        from service.eval.embedding_cache import CachedEmbedder
        from service.models.onnx_cross_encoder import load_cross_encoder
        from service.models.onnx_embedder import load_embedder

        # Only what a plain-Python corpus needs: approved documents (drafts are not indexed).
        self.passages = passages_of([d for d in docs if d.get("status", "approved") == "approved"])
        self.bm25 = BM25Okapi([tokenize(p.text) for p in self.passages])
        embedder = load_embedder(models_dir / embedding_model)
        default_session(embedder, models_dir / embedding_model / "model.onnx")
        self.embedder = embedder
        cached = CachedEmbedder(embedder)
        texts = [p.text for p in self.passages]
        self.matrix = np.concatenate([cached.infer(cached.tokenize(texts[i:i + 64], "passage"))
                                      for i in range(0, len(texts), 64)]) if texts else np.zeros((0, 384), np.float32)
        cached.flush()
        self.reranker = None
        if reranker_model:
            path = Path(reranker_model) if Path(reranker_model).is_absolute() else models_dir / reranker_model
            self.reranker = load_cross_encoder(path, max_length=256)
            default_session(self.reranker, path / "model.onnx")
        self.model_ids = [embedder.info.model_id] + ([self.reranker.info.model_id] if self.reranker else [])

    def search(self, query: str, top_k: int, rerank: bool) -> list[Passage]:
        bm = self.bm25.get_scores(tokenize(query))
        bm_top = np.argsort(-bm)[:DEPTH]
        bm_top = bm_top[bm[bm_top] > 0]
        qv = self.embedder.infer(self.embedder.tokenize([query], "query"))[0]
        dense = self.matrix @ qv
        dense_top = np.argsort(-dense)[:DEPTH]
        fused: dict[int, float] = {}
        for ranked in (bm_top, dense_top):
            for rank, i in enumerate(ranked, start=1):
                fused[int(i)] = fused.get(int(i), 0.0) + 1.0 / (RRF_K + rank)
        order = sorted(fused, key=lambda i: -fused[i])
        if rerank and self.reranker is not None and order:
            head = order[:RERANK_TOP]
            logits = self.reranker.infer(self.reranker.tokenize([(query, self.passages[i].text) for i in head]))
            head = [head[j] for j in np.argsort(-np.asarray(logits).reshape(-1))]
            order = head + order[RERANK_TOP:]
        seen: set[str] = set()
        out = []
        for i in order:
            p = self.passages[i]
            if p.source_id not in seen:
                seen.add(p.source_id)
                out.append(p)
            if len(out) == top_k:
                break
        return out


def build_server(pipeline: BaselinePipeline) -> Any:
    import grpc

    from service._gen.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc, types_pb2

    class Servicer(retrieval_pb2_grpc.RetrievalServiceServicer):
        async def _run(self, request: Any) -> list[Passage]:
            rerank = request.options.rerank != types_pb2.RERANK_MODE_OFF
            return await asyncio.to_thread(pipeline.search, request.query, request.top_k or 10, rerank)

        async def Retrieve(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
            t0 = time.perf_counter()
            found = await self._run(request)
            for rank, p in enumerate(found, start=1):
                yield retrieval_pb2.RetrieveEvent(evidence=retrieval_pb2.EvidenceItem(
                    evidence_id=p.chunk_id, source_id=p.source_id, rank=rank, excerpt=p.text[:300]))
            outcome = types_pb2.ATTEMPT_OUTCOME_EVIDENCE_FOUND if found else types_pb2.ATTEMPT_OUTCOME_EMPTY
            yield retrieval_pb2.RetrieveEvent(result=retrieval_pb2.AttemptResult(
                outcome=outcome, returned_count=len(found),
                timing=types_pb2.Timing(total_ms=(time.perf_counter() - t0) * 1000)))

        async def Lookup(self, request: Any, context: Any) -> Any:  # noqa: N802
            found = await self._run(request)
            status = types_pb2.EVIDENCE_STATUS_EVIDENCE_FOUND if found else types_pb2.EVIDENCE_STATUS_NO_EVIDENCE
            return retrieval_pb2.LookupResult(
                evidence_status=status, query=request.query, returned_count=len(found),
                evidence=[retrieval_pb2.LookupEvidence(document_id=p.chunk_id, source=p.source_id, excerpt=p.text[:300])
                          for p in found])

    server = grpc.aio.server()
    retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server(Servicer(), server)
    return server


def main(argv: list[str] | None = None) -> int:
    from service.config import default_models_dir

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="JSONL documents (the ingest format)")
    p.add_argument("--listen", default="127.0.0.1:50061")
    p.add_argument("--models-dir", default=str(default_models_dir()))
    p.add_argument("--embedding-model", default="multilingual-e5-small-int8")
    p.add_argument("--reranker-model", default="e5-small-split-reranker-int8")
    args = p.parse_args(argv)
    with open(args.corpus, encoding="utf-8") as fh:
        docs = [json.loads(line) for line in fh if line.strip()]
    t0 = time.monotonic()
    pipeline = BaselinePipeline(docs, Path(args.models_dir), embedding_model=args.embedding_model,
                                reranker_model=args.reranker_model)

    async def serve() -> None:
        server = build_server(pipeline)
        port = server.add_insecure_port(args.listen)
        await server.start()
        print(f"baseline serving on {args.listen.rsplit(':', 1)[0]}:{port} ({len(pipeline.passages)} passages, "
              f"models {pipeline.model_ids}, loaded in {time.monotonic() - t0:.1f}s)", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
