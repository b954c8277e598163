"""The evaluation runner: ingest a judged corpus through the real service API, run every
query in every mode through ``Retrieve``, score the ranked evidence, and write a report.

    python -m service eval --split valid --lang en --modes bm25,knn,hybrid --models int8 --out eval-out

Per model (``--models``), an in-process server (``App`` + ``Server`` on a loopback port, the
same stack ``serve`` runs) is started on a fresh data dir, or ``--target`` points at a running
one. Corpus documents are streamed through ``CorpusService.Ingest`` as approved, public
``doc`` documents (one per answer: source_id = answer id, version ``v1``); queries go through
``RetrievalService.Retrieve`` with ``top_k`` 100 one at a time (so latency is single-query,
warm, client-side wall time), and the ranked evidence ``source_id``s are what is scored.

Modes map to request options: ``bm25`` = legs [BM25]; ``knn`` = legs [KNN]; ``hybrid`` =
both legs, rerank OFF; ``hybrid+rerank`` = both legs, rerank ON (only with ``--reranker``,
otherwise reported as skipped with the reason). BM25 does not depend on the embedding
model: it runs once, with the first model's server.

Passage embeddings are cached on disk (``service.eval.embedding_cache``): the first run per
language and model embeds the corpus (length-sorted batches, with progress and an ETA), every
later run ingests from the cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from service.eval.datasets import Judged
from service.eval.metrics import METRICS, evaluate, per_query, percentile

log = logging.getLogger(__name__)

# "plan": the retrieval plan the rule-based classifier builds for each question (FAQ and
# document collections, per-collection top_k, rerank as planned), with its context count
# and budget lifted to top_k so the ranking compares with the other modes at equal length.
MODES = ("bm25", "knn", "hybrid", "hybrid+rerank", "plan")
DEFAULT_MODES = ("bm25", "knn", "hybrid", "hybrid+rerank")  # "plan" only when asked for
MODELS = {"int8": "multilingual-e5-small-int8", "fp32": "multilingual-e5-small-fp32", "iqa": "multilingual-e5-small-iqa-int8"}
TOP_K = 100
# Requests ask for everything: no context budget cut (the default 6000 chars would return
# only a handful of answers).
NO_BUDGET = 50_000_000
# ... and no quality gate (0 would mean the server's default min_quality).
NO_QUALITY_GATE = 1e-12


@dataclasses.dataclass
class EvalSettings:
    out: Path
    modes: tuple[str, ...] = DEFAULT_MODES
    models: tuple[str, ...] = ("int8",)
    reranker: str = ""
    engine: str = "embedded"
    opensearch_url: str = ""
    target: str = ""
    top_k: int = TOP_K
    candidates_per_leg: int = 100
    rrf_k: int | None = None
    bm25_weight: float | None = None
    knn_weight: float | None = None
    rerank_top_n: int | None = None
    rerank_alpha: float | None = None
    # Write/refresh the reranker's valid gate file (service/app.py reads it for "auto").
    gate: bool = False
    full_split: bool = False  # all queries and the whole corpus of the split (set by the CLI)
    full_corpus: bool = False  # the whole corpus of the valid split (queries may be a sample)
    lang: str = ""
    chunk_chars: int | None = None  # None: the service default
    timeout_s: float = 60.0
    # Queries in flight at once. 1 = sequential single queries (the latency figures mean
    # single-query latency); more keeps every core busy on long rerank runs.
    concurrency: int = 1
    ingest_batch: int = 2000
    plots: bool = True
    save_runs: bool = True
    quiet: bool = False
    extra_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Train-split questions run on the same server after the modes (hybrid+rerank when a
    # reranker is given, else hybrid), their per-item signals saved for quality calibration.
    calibration: Judged | None = None
    # Unjudged off-domain questions run the same way (no metrics: every answer is wrong),
    # their item signals saved as the calibration's negatives.
    off_domain: Judged | None = None


@dataclasses.dataclass
class ModeResult:
    model: str
    mode: str
    status: str  # "ok" | "skipped"
    reason: str = ""
    queries: int = 0
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    latency_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    outcomes: dict[str, int] = dataclasses.field(default_factory=dict)
    degraded: int = 0
    leg_failures: dict[str, int] = dataclasses.field(default_factory=dict)
    wall_s: float = 0.0
    # hybrid+rerank only: nDCG@10 / MRR re-measured offline for each interpolation alpha
    # (exact: the same recorded scores re-ordered with the pipeline's own formula).
    alpha_sweep: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


def _say(settings: EvalSettings, msg: str) -> None:
    if not settings.quiet:
        print(msg, file=sys.stderr, flush=True)


class _Progress:
    def __init__(self, settings: EvalSettings, label: str, total: int) -> None:
        self.settings, self.label, self.total = settings, label, total
        self.t0 = time.monotonic()
        self.last = 0.0

    def __call__(self, done: int, total: int | None = None) -> None:
        total = total or self.total
        now = time.monotonic()
        if now - self.last < 10 and done < total:
            return
        self.last = now
        el = now - self.t0
        eta = el / done * (total - done) if done else 0.0
        _say(self.settings, f"  {self.label}: {done}/{total}  {el:.0f}s elapsed, ETA {eta:.0f}s")


# -- the server ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Live:
    target: str
    channel: Any
    retrieval: Any
    corpus: Any
    app: Any = None
    server: Any = None
    workdir: Path | None = None
    model_ids: list[str] = dataclasses.field(default_factory=list)
    embedders: list[Any] = dataclasses.field(default_factory=list)  # cached ones, flushed at the end


def passage_texts(judged: Judged, cfg: Any) -> list[str]:
    """The texts the ingestor embeds for every corpus document (same chunking, same
    ``title\\nbreadcrumb\\ntext`` layout), so the cache can be filled up front."""
    from service.ingest.chunking import chunk_document, embedded_text

    texts = []
    for doc_id in judged.corpus:
        d = judged.document(doc_id)
        title = str(d.get("title", ""))
        for p in chunk_document(str(d["text"]), str(d.get("breadcrumb", "")), str(d.get("collection", "doc")),
                                cfg.chunk_chars, cfg.parent_chars):
            texts.append(embedded_text(title, p))
    return texts


async def _start(settings: EvalSettings, model: str, judged: Judged) -> _Live:
    import grpc

    from service._gen.retrieval.v1 import corpus_pb2_grpc, retrieval_pb2_grpc

    if settings.target:
        channel = grpc.aio.insecure_channel(settings.target)
        return _Live(settings.target, channel, retrieval_pb2_grpc.RetrievalServiceStub(channel),
                     corpus_pb2_grpc.CorpusServiceStub(channel), model_ids=[f"server at {settings.target}"])

    from service.app import DUMMY_EMBEDDER, App, _model_dir, load_latin_embedder, resolve_latin_model
    from service.config import Config, load_config
    from service.eval.embedding_cache import CachedEmbedder
    from service.models.dummy import HashEmbedder
    from service.models.onnx_embedder import load_embedder

    base = load_config(None)
    workdir = Path(tempfile.mkdtemp(prefix="retrieval-eval-"))
    overrides: dict[str, Any] = {
        "data_dir": workdir, "embedding_model": MODELS.get(model, model),
        "max_top_k": max(base.max_top_k, settings.top_k),
        "candidates_per_leg": max(base.candidates_per_leg, settings.candidates_per_leg),
        "reranker_model": settings.reranker, "api_keys_file": "", "default_deadline_s": settings.timeout_s,
    }
    if settings.engine == "opensearch":
        if not settings.opensearch_url:
            raise ValueError("--engine opensearch needs --opensearch-url")
        overrides.update(opensearch_url=settings.opensearch_url,
                         opensearch_index_prefix=f"eval-{uuid.uuid4().hex[:8]}")
    else:
        overrides["opensearch_url"] = ""
    for name in ("rrf_k", "bm25_weight", "knn_weight", "rerank_top_n", "rerank_alpha", "chunk_chars"):
        value = getattr(settings, name)
        if value is not None:
            overrides[name] = value
    if settings.chunk_chars is not None:
        overrides["parent_chars"] = max(base.parent_chars, settings.chunk_chars)
    cfg: Config = dataclasses.replace(base, **overrides)
    cfg = dataclasses.replace(cfg, latin_embedding_model=resolve_latin_model(cfg))
    if cfg.embedding_model == DUMMY_EMBEDDER:  # BM25-only studies: skip the real model
        app = App.build(cfg, embedder=HashEmbedder())
        return await _serve(app, workdir, [])
    path = _model_dir(cfg, cfg.embedding_model)
    if not (path / "model.onnx").exists():
        raise FileNotFoundError(f"embedding model not found at {path}; build it with `python -m service models build`")
    embedder = CachedEmbedder(load_embedder(path, threads=cfg.model_threads))
    texts = passage_texts(judged, cfg)
    await _warm(settings, embedder, texts, f"{model}", len(judged.corpus), cfg.model_workers)
    latin = None
    latin_model = load_latin_embedder(cfg)
    if latin_model is not None:  # the Latin-script dense leg: its vectors for chunks without Han
        from service.script import has_han

        latin = CachedEmbedder(latin_model)
        await _warm(settings, latin, [t for t in texts if not has_han(t)], cfg.latin_embedding_model,
                    len(judged.corpus), cfg.model_workers)
    app = App.build(cfg, embedder=embedder, latin_embedder=latin)
    return await _serve(app, workdir, [e for e in (embedder, latin) if e is not None])


async def _warm(settings: Any, embedder: Any, texts: list[str], name: str, documents: int, workers: int) -> None:
    """Fill the embedding cache with what ingest will ask for, in parallel up front."""
    missing = sum(not embedder.contains(t) for t in set(texts))
    _say(settings, f"[{name}] {documents} documents -> {len(texts)} passages; "
                   f"{len(texts) - missing} cached, embedding {missing} (cache: {embedder.dir})")
    if missing:
        t0 = time.monotonic()
        await asyncio.to_thread(embedder.warm, texts, workers=workers,
                                progress=_Progress(settings, f"embed corpus [{name}]", missing))
        if missing > 5000:
            embedder.compact()
        _say(settings, f"[{name}] embedded {missing} passages in {time.monotonic() - t0:.0f}s")


async def _serve(app: Any, workdir: Path, embedders: list[Any]) -> _Live:
    import grpc

    from service._gen.retrieval.v1 import corpus_pb2_grpc, retrieval_pb2_grpc
    from service.api.server import Server

    server = Server(app)
    port = await server.start("127.0.0.1:0")
    target = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(target)
    return _Live(target, channel, retrieval_pb2_grpc.RetrievalServiceStub(channel),
                 corpus_pb2_grpc.CorpusServiceStub(channel), app, server, workdir,
                 model_ids=app.runner.model_ids, embedders=embedders)


async def _stop(live: _Live) -> None:
    await live.channel.close()
    if live.server is not None:
        if live.app is not None and live.app.cfg.opensearch_url:
            try:
                await live.app.engine.drop_indices()
            except Exception as exc:  # noqa: BLE001 - best-effort cleanup of throwaway indices
                log.warning("could not drop eval indices: %s", exc)
        await live.server.stop(1.0)
    for embedder in live.embedders:
        embedder.flush()
    if live.workdir is not None:
        shutil.rmtree(live.workdir, ignore_errors=True)


def _pb_document(d: dict[str, Any]) -> Any:
    from service._gen.retrieval.v1 import corpus_pb2, types_pb2

    coll = {"doc": types_pb2.COLLECTION_DOC, "faq": types_pb2.COLLECTION_FAQ}
    status = {"approved": types_pb2.SOURCE_STATUS_APPROVED, "draft": types_pb2.SOURCE_STATUS_DRAFT,
              "retired": types_pb2.SOURCE_STATUS_RETIRED}
    return corpus_pb2.Document(
        source_id=str(d["source_id"]), version=str(d.get("version", "v1")), title=str(d.get("title", "")),
        text=str(d["text"]), collection=coll[str(d.get("collection", "doc"))],
        status=status[str(d.get("status", "approved"))], acl=[str(g) for g in d.get("acl", []) or []],
        breadcrumb=str(d.get("breadcrumb", "")),
        metadata={str(k): str(v) for k, v in (d.get("metadata") or {}).items()})


async def _ingest(settings: EvalSettings, live: _Live, judged: Judged, label: str) -> dict[str, Any]:
    from service._gen.retrieval.v1 import corpus_pb2

    ids = list(judged.corpus)
    progress = _Progress(settings, f"ingest [{label}]", len(ids))
    t0 = time.monotonic()
    totals: Counter[str] = Counter()
    errors: list[str] = []
    for start in range(0, len(ids), settings.ingest_batch):
        batch = ids[start : start + settings.ingest_batch]

        async def stream(batch: list[str] = batch) -> AsyncIterator[Any]:
            for doc_id in batch:
                yield corpus_pb2.IngestRequest(document=_pb_document(judged.document(doc_id)))

        summary = await live.corpus.Ingest(stream(), timeout=3600)
        totals["indexed"] += summary.documents_indexed
        totals["unchanged"] += summary.documents_unchanged
        totals["chunks"] += summary.chunks_indexed
        errors += [f"{e.source_id}: {e.field} {e.message}" for e in summary.errors]
        progress(start + len(batch))
    elapsed = time.monotonic() - t0
    if errors:
        _say(settings, f"  ingest errors ({len(errors)}): {errors[:3]}")
    cache = {} if not live.embedders else {"embedding_cache_hits": sum(e.hits for e in live.embedders),
                                           "embedding_cache_misses": sum(e.misses for e in live.embedders)}
    return {"documents": len(ids), **totals, "errors": len(errors), "error_examples": errors[:10],
            "seconds": round(elapsed, 1), **cache}


_RULES: list[Any] = []


def _rules(load: Any) -> Any:
    if not _RULES:
        _RULES.append(load())
    return _RULES[0]


def _plan_request(query: str, top_k: int) -> Any:
    from service._gen.retrieval.v1 import retrieval_pb2
    from service.api.plan_convert import plan_to_pb
    from service.errors import InvalidArgument
    from service.planning.planner import IntentInput, build_plan
    from service.planning.rules import load_rules

    rules = _rules(load_rules)
    try:
        built = build_plan(query, [], IntentInput(), rules)
    except InvalidArgument:  # classified as greeting/hand-off: plan it as a knowledge question
        built = build_plan(query, [], IntentInput("knowledge_query"), rules)
    plan = dataclasses.replace(built.plan, final_context_top_n=top_k, max_context_chars=NO_BUDGET, max_context_doc_chars=0)
    return retrieval_pb2.RetrieveRequest(
        query=query, top_k=top_k, plan=plan_to_pb(plan),
        options=retrieval_pb2.RetrievalOptions(max_context_chars=NO_BUDGET, min_quality=NO_QUALITY_GATE))


def _request(query: str, mode: str, top_k: int) -> Any:
    from service._gen.retrieval.v1 import retrieval_pb2, types_pb2

    if mode == "plan":
        return _plan_request(query, top_k)
    legs = {"bm25": [types_pb2.LEG_KIND_BM25], "knn": [types_pb2.LEG_KIND_KNN]}.get(mode, [])
    rerank = types_pb2.RERANK_MODE_ON if mode == "hybrid+rerank" else types_pb2.RERANK_MODE_OFF
    return retrieval_pb2.RetrieveRequest(
        query=query, top_k=top_k,
        options=retrieval_pb2.RetrievalOptions(legs=legs, rerank=rerank, max_context_chars=NO_BUDGET,
                                               min_quality=NO_QUALITY_GATE))


def _fusion(live: _Live, query: str) -> dict[str, float]:
    """The server's fusion for ``query``: its RRF k and the best possible fused score with
    every leg the server runs for it by default (what the quality calibration normalises by:
    BM25 and kNN, and the Latin-script leg where it runs for this query)."""
    from service.config import load_config
    from service.pipeline.fusion import fusion_for, max_rrf_score

    cfg = live.app.cfg if live.app is not None else load_config(None)
    f = fusion_for(query, cfg)  # latin_knn_weight is 0 where the Latin-script leg does not run
    return {"max_fused": max_rrf_score([f.bm25_weight, f.knn_weight, f.latin_knn_weight], f.rrf_k), "rrf_k": f.rrf_k}


async def _run_mode(settings: EvalSettings, live: _Live, judged: Judged, model: str, mode: str
                    ) -> tuple[ModeResult, dict[str, list[str]], dict[str, list[float]]]:
    from service._gen.retrieval.v1 import types_pb2

    items: dict[str, dict[str, Any]] = {}  # per query: the result and its top items' signals
    run: dict[str, list[str]] = {}
    scores: dict[str, list[float]] = {}
    head_scores: dict[str, list[tuple[float, float]]] = {}  # (fused, rerank) of the reranked head
    rerank_skipped = 0
    latencies: list[float] = []
    outcomes: Counter[str] = Counter()
    leg_failures: Counter[str] = Counter()
    degraded = 0
    progress = _Progress(settings, f"{mode} [{model}]", len(judged.queries))
    t0 = time.monotonic()
    # Warm-up (not measured): the first call pays session and cache start-up.
    for q in list(judged.queries.values())[:3]:
        async for _ in live.retrieval.Retrieve(_request(q, mode, settings.top_k), timeout=settings.timeout_s):
            pass
    sem = asyncio.Semaphore(max(1, settings.concurrency))
    finished = 0

    async def one(qid: str, query: str) -> None:
        nonlocal rerank_skipped, degraded, finished
        async with sem:
            await _one(qid, query)
        finished += 1
        progress(finished)

    async def _one(qid: str, query: str) -> None:
        nonlocal rerank_skipped, degraded
        ranked: list[str] = []
        score: list[float] = []
        head: list[tuple[float, float]] = []
        rows: list[list[Any]] = []
        record: dict[str, Any] = {}
        t = time.perf_counter()
        async for ev in live.retrieval.Retrieve(_request(query, mode, settings.top_k), timeout=settings.timeout_s):
            kind = ev.WhichOneof("event")
            if kind == "evidence":
                e = ev.evidence
                # Every item, the whole reranked head included (head_order_fit --depth reads
                # shallower heads from a deep one). item_dump.ITEM_COLUMNS: [source_id, bm25,
                # dense, fused, rerank, quality, latin dense]; None = the leg missed it
                rows.append([e.source_id, e.bm25_score if e.HasField("bm25_score") else None,
                             e.dense_score if e.HasField("dense_score") else None, e.fused_score,
                             e.rerank_score if e.HasField("rerank_score") else None, e.quality,
                             e.latin_dense_score if e.HasField("latin_dense_score") else None])
                ranked.append(e.source_id)
                # The leg's own score for single-leg modes (for offline score-fusion studies).
                score.append(e.bm25_score if mode == "bm25" else e.dense_score if mode == "knn"
                             else e.rerank_score if e.HasField("rerank_score") else e.fused_score)
                if e.HasField("rerank_score"):
                    head.append((e.fused_score, e.rerank_score))
            elif kind == "result":
                record = {"outcome": types_pb2.AttemptOutcome.Name(ev.result.outcome),
                          "legs_ok": sorted(types_pb2.LegKind.Name(leg.kind)[len("LEG_KIND_"):] for leg in ev.result.legs
                                            if leg.status == types_pb2.LEG_STATUS_OK and leg.kind != types_pb2.LEG_KIND_RERANK),
                          "quality_source": types_pb2.QualitySource.Name(ev.result.quality_source),
                          "top_quality": ev.result.top_quality, "degraded": ev.result.degraded,
                          "relevance_level": types_pb2.RelevanceLevel.Name(ev.result.relevance_level)}
                outcomes[types_pb2.AttemptOutcome.Name(ev.result.outcome)] += 1
                degraded += ev.result.degraded
                for leg in ev.result.legs:
                    status = types_pb2.LegStatus.Name(leg.status)
                    if leg.kind == types_pb2.LEG_KIND_RERANK and mode == "hybrid+rerank" and status == "LEG_STATUS_SKIPPED":
                        rerank_skipped += 1
                    if status not in ("LEG_STATUS_OK", "LEG_STATUS_SKIPPED"):
                        leg_failures[f"{types_pb2.LegKind.Name(leg.kind)}:{status}"] += 1
        latencies.append((time.perf_counter() - t) * 1000)
        run[qid] = ranked
        scores[qid] = score
        head_scores[qid] = head
        # Calibration rows: every item in the final order (the fused order can be rebuilt from
        # them for the hybrid calibration, and a reranked head read at any shallower depth).
        # ``corpus_lang``: the language of the corpus the question was asked of, so the gate
        # fit can tell an off-domain question against a corpus of its own language (the hard
        # case) from one against the other (refused trivially; calibration.same_language).
        items[qid] = {**record, "query": query, **_fusion(live, query),
                      **({"corpus_lang": settings.lang} if settings.lang else {}),
                      "relevant": sorted(judged.qrels.get(qid, {})), "items": rows}

    await asyncio.gather(*(one(qid, query) for qid, query in judged.queries.items()))
    run = {qid: run[qid] for qid in judged.queries}  # query order, whatever finished first
    result = ModeResult(
        model=model, mode=mode, status="ok", queries=len(run), metrics=evaluate(run, judged.qrels),
        latency_ms={"p50": percentile(latencies, 50), "p95": percentile(latencies, 95),
                    "mean": statistics.fmean(latencies) if latencies else 0.0},
        outcomes=dict(outcomes), degraded=degraded, leg_failures=dict(leg_failures),
        wall_s=round(time.monotonic() - t0, 1))
    if rerank_skipped:
        result.reason = f"the rerank leg reported SKIPPED on {rerank_skipped} queries (no reranker on the server?)"
    if mode == "hybrid+rerank" and not rerank_skipped:
        result.alpha_sweep = alpha_sweep(run, head_scores, judged)
    if settings.save_runs:
        runs_dir = settings.out / "runs"
        runs_dir.mkdir(parents=True, exist_ok=True)
        tag = ("calibration-" if judged is settings.calibration else "offdomain-" if judged is settings.off_domain
               else "")
        (runs_dir / f"{model}-{tag}{mode}.items.json").write_text(json.dumps(items, ensure_ascii=False))
    return result, run, scores


def alpha_sweep(run: dict[str, list[str]], heads: dict[str, list[tuple[float, float]]], judged: Judged
                ) -> dict[str, dict[str, float]]:
    """Re-order each query's reranked head (its first ``len(head)`` results) for every alpha
    with ``service.pipeline.fusion.interpolate`` and score the runs."""
    from service.pipeline.fusion import INTERPOLATION_ALPHAS, interpolate

    out: dict[str, dict[str, float]] = {}
    for alpha in INTERPOLATION_ALPHAS:
        alt: dict[str, list[str]] = {}
        for qid, ranked in run.items():
            head = heads.get(qid, [])
            n = len(head)
            mixed = interpolate([r for _, r in head], [f for f, _ in head], alpha)
            order = sorted(range(n), key=lambda i: -mixed[i])
            alt[qid] = [ranked[i] for i in order] + ranked[n:]
        m = evaluate(alt, judged.qrels)
        out[f"{alpha:.1f}"] = {"ndcg@10": round(m["ndcg@10"], 4), "mrr@100": round(m["mrr@100"], 4)}
    return out


def _rerank_skip_reason(settings: EvalSettings, live: _Live) -> str:
    if settings.target:
        return ""
    if not settings.reranker:
        return "no reranker given (--reranker DIR): the rerank leg would report SKIPPED"
    return ""


async def evaluate_service(judged: Judged, settings: EvalSettings) -> dict[str, Any]:
    """Run the whole evaluation; writes the report into ``settings.out`` and returns it."""
    import grpc
    settings.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    unknown = [m for m in settings.modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    results: list[ModeResult] = []
    ingests: dict[str, Any] = {}
    model_ids: dict[str, list[str]] = {}
    _say(settings, f"evaluating {judged.name}: {len(judged.queries)} queries, {len(judged.corpus)} documents, "
                   f"modes {','.join(settings.modes)}, models {','.join(settings.models)}, engine {settings.engine}")
    if settings.target:
        settings.models = ("server",)  # the running server decides its models
    served: Any = None  # the eval server's own config (the gate records what it served)
    for mi, model in enumerate(settings.models):
        modes = [m for m in settings.modes if not (m == "bm25" and mi > 0)]  # BM25 is model-independent
        live = await _start(settings, model, judged)
        served = live.app.cfg if live.app is not None else served
        try:
            model_ids[model] = live.model_ids
            if judged.corpus:
                ingests[model] = await _ingest(settings, live, judged, model)
                _say(settings, f"[{model}] ingest: {ingests[model]}")
            for mode in modes:
                if mode in ("hybrid+rerank", "plan"):
                    reason = _rerank_skip_reason(settings, live)
                    if reason:
                        results.append(ModeResult(model, mode, "skipped", reason))
                        _say(settings, f"  {mode} [{model}]: skipped ({reason})")
                        continue
                try:
                    res, run, scores = await _run_mode(settings, live, judged, model, mode)
                except grpc.aio.AioRpcError as exc:
                    # A --target server without a reranker refuses RERANK_MODE_ON: report the skip.
                    if mode != "hybrid+rerank" or exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                        raise
                    results.append(ModeResult(model, mode, "skipped", f"server refused rerank: {exc.details()}"))
                    _say(settings, f"  {mode} [{model}]: skipped ({exc.details()})")
                    continue
                results.append(res)
                _say(settings, f"  {mode} [{model}]: " + ", ".join(f"{k} {v:.4f}" for k, v in res.metrics.items())
                     + f"; p50 {res.latency_ms['p50']:.1f} ms, p95 {res.latency_ms['p95']:.1f} ms")
                if settings.save_runs:
                    runs_dir = settings.out / "runs"
                    runs_dir.mkdir(exist_ok=True)
                    (runs_dir / f"{model}-{mode}.json").write_text(json.dumps(run))
                    (runs_dir / f"{model}-{mode}.scores.json").write_text(json.dumps(scores))
            if settings.calibration is not None and settings.calibration.queries:
                mode = "hybrid+rerank" if settings.reranker or settings.target else "hybrid"
                res, _, _ = await _run_mode(settings, live, settings.calibration, model, mode)
                res.mode = f"calibration:{mode}"
                results.append(res)
                _say(settings, f"  calibration sample ({settings.calibration.name}, {res.queries} queries) {mode} "
                               f"[{model}]: " + ", ".join(f"{k} {v:.4f}" for k, v in res.metrics.items()))
            if settings.off_domain is not None and settings.off_domain.queries:
                mode = "hybrid+rerank" if settings.reranker or settings.target else "hybrid"
                res, _, _ = await _run_mode(settings, live, settings.off_domain, model, mode)
                _say(settings, f"  off-domain questions ({res.queries}) {mode} [{model}]: outcomes {res.outcomes}")
        finally:
            await _stop(live)
    report = {
        "dataset": judged.stats(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(settings).items()
                     if k not in ("calibration", "off_domain")},
        "calibration_sample": (None if settings.calibration is None
                               else {"name": settings.calibration.name, "queries": len(settings.calibration.queries)}),
        "model_ids": model_ids,
        "ingest": ingests,
        "results": [dataclasses.asdict(r) for r in results],
        "metric_notes": {"mrr@100": "reciprocal rank of the first relevant answer within the top 100, else 0",
                         "ndcg@10": "binary gains", "latency": "client wall time of one Retrieve stream, "
                         "sequential single queries, warm"},
        "environment": {"python": platform.python_version(), "machine": platform.machine(),
                        "cpus": __import__("os").cpu_count()},
        "wall_s": round(time.monotonic() - started, 1),
        **settings.extra_meta,
    }
    if settings.gate:
        report["gate"] = _write_gate(settings, results, judged, served)
    write_report(report, settings.out, plots=settings.plots)
    return report


def _write_gate(settings: EvalSettings, results: list[ModeResult], judged: Judged, served: Any = None) -> dict[str, Any]:
    """The valid gate of ``settings.reranker`` from this run; ``served``: the config the
    eval's server ran (its depth and scoring are what the gate records)."""
    from service.config import load_config
    from service.eval.gate import update_gate
    from service.models.manifest import read_manifest
    from service.models.onnx_cross_encoder import passage_cap
    from service.models.towers import served_scoring
    from service.pipeline.head_order import order_sha256

    hybrid = [r for r in results if r.mode == "hybrid" and r.status == "ok"]
    reranked = [r for r in results if r.mode == "hybrid+rerank" and r.status == "ok" and r.alpha_sweep]
    if not settings.reranker or not hybrid or not reranked or not settings.lang:
        raise ValueError("--gate needs --reranker DIR, --lang and the modes hybrid,hybrid+rerank")
    # The server ordered the head by the reranker's rerank_order.json unless --rerank-alpha
    # overrode it (app.resolve_reranker): the gate records what was served.
    served_order = None if settings.rerank_alpha is not None else order_sha256(Path(settings.reranker).expanduser())
    # How the server scored pairs: the reranker's own choice unless rerank_scoring forced one.
    cfg = served if served is not None else load_config(None)
    manifest = read_manifest(Path(settings.reranker).expanduser(), "cross-encoder")
    scoring = served_scoring(manifest, cfg.rerank_scoring)
    gate = update_gate(Path(settings.reranker).expanduser(), settings.lang, hybrid[0].metrics["ndcg@10"],
                       reranked[0].alpha_sweep, full_split=settings.full_split, full_corpus=settings.full_corpus,
                       queries=len(judged.queries),
                       documents=len(judged.corpus), embedder=hybrid[0].model,
                       command=str(settings.extra_meta.get("command", "")),
                       head_order=(served_order, reranked[0].metrics["ndcg@10"]) if served_order else None,
                       scoring=scoring, rerank_top_n=cfg.rerank_top_n,
                       passage_tokens=passage_cap(manifest, cfg.rerank_max_length, cfg.rerank_passage_tokens))
    _say(settings, f"gate: {'order ' + served_order[:12] if served_order else 'alpha ' + str(gate['alpha'])}, "
                   f"passed={gate['passed']} {gate['reason']}")
    return gate


# -- report -------------------------------------------------------------------------------


def markdown_table(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| model | mode | Recall@10 | Recall@100 | MRR@100 | nDCG@10 | p50 ms | p95 ms | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['mode']} | - | - | - | - | - | - | skipped: {r['reason']} |")
            continue
        m, lat = r["metrics"], r["latency_ms"]
        notes = []
        bad = {k: v for k, v in r["outcomes"].items() if k != "ATTEMPT_OUTCOME_EVIDENCE_FOUND"}
        if bad:
            notes.append("outcomes " + ", ".join(f"{k.removeprefix('ATTEMPT_OUTCOME_')}={v}" for k, v in bad.items()))
        if r["leg_failures"]:
            notes.append("leg failures " + ", ".join(f"{k}={v}" for k, v in r["leg_failures"].items()))
        if r.get("reason"):
            notes.append(r["reason"])
        model = "(any)" if r["mode"] == "bm25" else r["model"]
        lines.append(f"| {model} | {r['mode']} | {m['recall@10']:.4f} | {m['recall@100']:.4f} | {m['mrr@100']:.4f} | "
                     f"{m['ndcg@10']:.4f} | {lat['p50']:.1f} | {lat['p95']:.1f} | {'; '.join(notes)} |")
    for r in results:
        if r.get("alpha_sweep"):
            lines.append("")
            lines.append(f"hybrid+rerank [{r['model']}] nDCG@10 by interpolation alpha (1.0 = reranker alone): "
                         + ", ".join(f"{a}: {v['ndcg@10']:.4f}" for a, v in r["alpha_sweep"].items()))
    return "\n".join(lines)


def write_report(report: dict[str, Any], out: Path, *, plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
    ds = report["dataset"]
    s = report["settings"]
    md = [f"# Evaluation: {ds['name']}", "",
          f"{ds['queries']} queries, {ds['corpus']} documents, engine {s['engine']}, top_k {s['top_k']}, "
          f"candidates per leg {s['candidates_per_leg']}; models: "
          + "; ".join(f"{k}: {', '.join(v)}" for k, v in report["model_ids"].items()), "",
          markdown_table(report["results"]), "",
          ("MRR is MRR@100 (first relevant answer within the top 100). nDCG@10 uses binary gains. "
           "Latency: client wall time of one Retrieve stream (top_k 100), sequential warm single queries. "
           "BM25 does not depend on the embedding model (run once)."), ""]
    if int(s["top_k"]) < 100:
        md.append(f"Note: top_k is {s['top_k']}, so Recall@100 and MRR@100 only see the top {s['top_k']}.")
    for model, ing in report.get("ingest", {}).items():
        md.append(f"- ingest [{model}]: {ing}")
    md.append(f"- total wall time: {report['wall_s']} s")
    if plots:
        try:
            _plots(report, out)
            md += ["", "![quality per mode](quality.png)", "", "![latency vs quality](latency_quality.png)"]
        except ImportError:
            md += ["", "(plots skipped: matplotlib is not installed; `pip install '.[eval]'`)"]
    (out / "report.md").write_text("\n".join(md) + "\n")


def _plots(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["status"] == "ok"]
    if not rows:
        return
    labels = [r["mode"] if r["mode"] == "bm25" else f"{r['mode']}\n{r['model']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.5))
    width = 0.8 / len(METRICS)
    for j, metric in enumerate(METRICS):
        xs = [i + (j - (len(METRICS) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [r["metrics"][metric] for r in rows], width, label=metric)
        if metric == "ndcg@10":
            for x, r in zip(xs, rows):
                ax.annotate(f"{r['metrics'][metric]:.3f}", (x, r["metrics"][metric]), ha="center",
                            textcoords="offset points", xytext=(0, 2), fontsize=7)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylim(0, 1.12)
    ax.set_ylabel("score")
    ax.set_title(f"Quality per mode\n{report['dataset']['name']}", fontsize=9)
    ax.legend(ncol=4, fontsize=8, loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "quality.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r, label in zip(rows, labels):
        ax.errorbar(r["latency_ms"]["p50"], r["metrics"]["ndcg@10"],
                    xerr=[[0], [max(0.0, r["latency_ms"]["p95"] - r["latency_ms"]["p50"])]], fmt="o", capsize=3)
        ax.annotate(label.replace("\n", " "), (r["latency_ms"]["p50"], r["metrics"]["ndcg@10"]),
                    textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("latency p50 ms (bar to p95)")
    ax.set_ylabel("nDCG@10")
    ax.set_title(f"Latency vs quality\n{report['dataset']['name']}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "latency_quality.png", dpi=110)
    plt.close(fig)


def per_query_rows(run: dict[str, list[str]], judged: Judged) -> list[dict[str, Any]]:
    return [{"qid": q, **per_query(run.get(q, []), rel)} for q, rel in judged.qrels.items()]
