"""Engine parity: the same chunks in the embedded engine and in a real OpenSearch node,
the same queries to both, and how far their BM25 and kNN top-k agree.

    .venv/bin/python tests/bench/parity_engines.py --out /tmp/parity.json \\
        [--opensearch-url http://127.0.0.1:9200] [--queries 500] [--answers 5000] \\
        [--langs en,zh] [--k 10] [--churn 0.1]

Corpora, each loaded through the ``Engine`` interface only (``replace_document`` per source,
same order in both engines; OpenSearch: one shard, a fresh index prefix, refreshed, dropped
afterwards):

- ``demo``: ``service/demo/corpus.py`` chunked exactly as the service's ingest does
  (``chunk_document`` + the ``title\\nbreadcrumb\\ntext`` search text of
  ``service/ingest/ingestor.py``), queried with hand-written English and Chinese queries,
  titles and section headings, under three filters (no ACL, public only, collection=doc);
- ``iqa-<lang>``: a sample of InsuranceQA (train split only): the judged positives of
  ``--queries`` sampled train questions plus random answers up to ``--answers``, one chunk
  per answer (source_id = answer id, version v1, search_text = the answer), queried with
  those questions.

Measured per corpus:

- BM25 top-k: overlap@k (|A & B| / max(|A|, |B|)), top-1 agreement, common hits whose scores
  differ by more than 1e-4 relative, and every disagreeing query classified: ``tie_cutoff``
  (the differing hits score the same as the k-th hit: Lucene breaks ties by doc id, and
  OpenSearch's segment merges can reorder doc ids), ``tie_top``, ``score_mismatch`` (with the
  query's analysed terms compared against OpenSearch ``_analyze``), ``other``. Plus whole-
  corpus checks: every document's indexed terms (``_mtermvectors``) against the embedded
  analyzer, and the field statistics (doc count, sum of term frequencies) both engines use.
- kNN top-k: OpenSearch lucene HNSW (what the engine serves) against the embedded exact
  search; OpenSearch exact (``script_score`` with ``knn_score``) against the embedded exact
  search (vector and distance parity); and HNSW against OpenSearch exact (the HNSW recall
  measured inside OpenSearch). Parity holds when HNSW-vs-embedded equals that recall and
  exact-vs-exact is 1.0.
- ``--churn F`` (InsuranceQA en only): re-replace a fraction F of the documents with the same
  content in both engines, compare BM25 again (OpenSearch now counts the overwritten copies,
  deleted but not merged away, in docFreq/docCount; the embedded engine does not), then
  force-merge OpenSearch to one segment and compare once more.

Embeddings (e5-small int8) are cached under ``~/.cache/retrieval-service/parity/<model sha
prefix>-L<max length>/`` (npz shards keyed by sha256 of kind + text); vectors the evaluation
cache (``~/.cache/retrieval-service/embeddings``, same key scheme) already holds are reused
read-only. Nothing depends on the caches: misses are computed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import hashlib
import json
import os
import random
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from service.config import Config  # noqa: E402
from service.demo.corpus import DEMO_DOCUMENTS  # noqa: E402
from service.engines.base import ChunkRecord, Engine, SearchFilter, make_chunk_id  # noqa: E402
from service.engines.embedded.analyzer import analyze  # noqa: E402
from service.engines.embedded.engine import EmbeddedEngine  # noqa: E402
from service.engines.opensearch import mapping  # noqa: E402
from service.engines.opensearch.engine import OpenSearchEngine  # noqa: E402
from service.ingest.chunking import chunk_document, embedded_text  # noqa: E402
from service.ingest.documents import DocumentInput  # noqa: E402

E5_INT8 = "multilingual-e5-small-int8"
REL_TOL = 1e-4
TIMEOUT_S = 30.0
CACHE_ROOT = Path(os.environ.get("RETRIEVAL_PARITY_CACHE", "") or
                  Path.home() / ".cache" / "retrieval-service" / "parity")
EVAL_CACHE_ROOT = Path(os.environ.get("RETRIEVAL_EMBEDDINGS_CACHE", "") or
                       Path.home() / ".cache" / "retrieval-service" / "embeddings")

DEMO_QUERIES = [
    "how do I reset my password", "reset link expired", "account locked after failed sign-in",
    "download invoice pdf", "annual plan discount", "bank transfer payment",
    "how long are deleted files kept", "audit logs retention", "account deletion data erased",
    "what is new in v2.4", "offline sync desktop", "single sign-on SAML", "SSO",
    "crash renaming shared folders", "slow uploads of large folders", "quantum tier pricing",
    "fax gateway", "escalate outage on-call", "change email address",
    "cancel subscription any time", "refund policy", "password", "billing", "the", "v2.3",
    "如何开具发票", "退款需要多长时间", "两步验证", "异常登录提醒", "免费版有多少存储空间",
    "全额退款条件", "取消续订", "专业版多少空间", "账户安全", "发票 invoice", "密码 password",
]


class DataMissing(RuntimeError):
    """insuranceqa-data is not installed."""


# -- data ------------------------------------------------------------------------------------

_SPACES = re.compile(r"[ \t\u00a0\u3000]{2,}")


def _clean(text: str) -> str:
    text = text.strip().strip("\u00a0\u3000").strip()
    return _SPACES.sub(" ", text)


def _load_split(lang: str) -> tuple[dict[str, str], dict[str, str], dict[str, set[str]]]:
    """(answers, train questions, qrels) for ``lang``; prefers ``service.eval.datasets``."""
    try:
        from service.eval.datasets import EvalDataMissing, load_insuranceqa
    except ImportError:
        load_insuranceqa = None  # type: ignore[assignment]
    if load_insuranceqa is not None:
        try:
            j = load_insuranceqa("train", lang)  # type: ignore[arg-type]
        except EvalDataMissing as exc:
            raise DataMissing(str(exc)) from exc
        return j.corpus, j.queries, j.qrels
    try:
        import insuranceqa_data
    except ImportError as exc:
        raise DataMissing("insuranceqa-data is not installed (pip install insuranceqa-data==1.2)") from exc
    root = Path(insuranceqa_data.__file__).parent
    with gzip.open(root / "answers.json.gz", "rb") as fh:
        raw_answers = json.loads(fh.read())
    with gzip.open(root / "train.json.gz", "rb") as fh:  # never the test split
        raw_questions = json.loads(fh.read())
    answers = {str(a): _clean(v[lang]) for a, v in raw_answers.items()}
    queries, qrels = {}, {}
    for qid, q in raw_questions.items():
        text = _clean(q[lang])
        pos = {str(a) for a in q["answers"] if str(a) in answers}
        if text and pos:
            queries[str(qid)], qrels[str(qid)] = text, pos
    return answers, queries, qrels


@dataclasses.dataclass
class Sample:
    lang: str
    answers: dict[str, str]  # answer id -> text, in load order (ascending id)
    queries: dict[str, str]  # question id -> text
    qrels: dict[str, set[str]]


def insuranceqa_sample(lang: str, n_queries: int, n_answers: int, seed: int = 0) -> Sample:
    """Seeded sample of train questions, their positives, then random answers up to
    ``n_answers``. The same seed gives the same ids in every language."""
    answers, queries, qrels = _load_split(lang)
    qids = sorted(queries, key=int)
    qids = sorted(random.Random(seed).sample(qids, min(n_queries, len(qids))), key=int)
    keep = {a for q in qids for a in qrels[q] if answers.get(a)}
    rest = sorted((a for a in answers if a not in keep and answers[a]), key=int)
    keep |= set(random.Random(seed + 1).sample(rest, max(0, min(len(rest), n_answers - len(keep)))))
    return Sample(
        lang=lang,
        answers={a: answers[a] for a in sorted(keep, key=int)},
        queries={q: queries[q] for q in qids},
        qrels={q: qrels[q] for q in qids},
    )


# -- embeddings ------------------------------------------------------------------------------


def load_e5(threads: int = 1) -> Any:
    from service.offline.builder import build_all, default_models_dir
    from service.models.onnx_embedder import load_embedder

    models = default_models_dir()
    if not (models / E5_INT8 / "manifest.json").exists():
        build_all(models)
    return load_embedder(models / E5_INT8, threads=threads)


def _key(kind: str, text: str) -> bytes:
    return hashlib.sha256(f"{kind}\0{text}".encode()).digest()


class VectorCache:
    """Vectors by (model sha, max length, kind, text). Reads the parity cache and the eval
    cache; writes new vectors to the parity cache only (one atomic npz shard per call)."""

    def __init__(self, embedder: Any, root: Path = CACHE_ROOT, workers: int = 2) -> None:
        self.embedder = embedder
        sub = f"{embedder.info.sha256[:16]}-L{embedder.info.max_length}"
        self.dir = root / sub
        self.read_dirs = [self.dir, EVAL_CACHE_ROOT / sub]
        self.workers = workers
        self.hits = 0
        self.computed = 0
        self.embed_seconds = 0.0

    def _lookup(self, keys: set[bytes]) -> dict[bytes, np.ndarray]:
        found: dict[bytes, np.ndarray] = {}
        want = np.array(sorted(keys), dtype="S32")
        for d in self.read_dirs:
            for shard in sorted(d.glob("shard-*.npz")) if d.is_dir() else []:
                if len(found) == len(keys):
                    return found
                try:
                    with np.load(shard) as data:
                        skeys = data["keys"]
                        mask = np.isin(skeys, want)
                        if not mask.any():
                            continue
                        vecs = data["vectors"]
                except (OSError, ValueError, KeyError):
                    continue  # a torn shard from a killed writer
                if vecs.ndim != 2 or vecs.shape[1] != self.embedder.info.dimension:
                    continue
                for k, v in zip(skeys[mask], vecs[mask], strict=True):
                    found.setdefault(bytes(k), np.asarray(v, dtype=np.float32))
        return found

    def embed(self, texts: Sequence[str], kind: str, batch: int = 16) -> np.ndarray:
        keys = [_key(kind, t) for t in texts]
        found = self._lookup(set(keys))
        todo = sorted({t for t, k in zip(texts, keys, strict=True) if k not in found}, key=len)
        self.hits += len(texts) - sum(1 for k in keys if k not in found)
        if todo:
            started = time.perf_counter()
            batches = [todo[i : i + batch] for i in range(0, len(todo), batch)]

            def run(chunk: list[str]) -> np.ndarray:
                return np.asarray(self.embedder.infer(self.embedder.tokenize(chunk, kind)), np.float32)

            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                outs = list(pool.map(run, batches))
            vecs = np.concatenate(outs)
            new_keys = [_key(kind, t) for t in todo]
            for k, v in zip(new_keys, vecs, strict=True):
                found[k] = v
            self.computed += len(todo)
            self.embed_seconds += time.perf_counter() - started
            self._write(new_keys, vecs)
        return np.stack([found[k] for k in keys]).astype(np.float32)

    def _write(self, keys: list[bytes], vecs: np.ndarray) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = self.dir / f".tmp-{uuid.uuid4().hex}.npz"
            np.savez(tmp, keys=np.array(keys, dtype="S32"), vectors=vecs.astype(np.float32))
            tmp.rename(self.dir / f"shard-{int(time.time())}-{uuid.uuid4().hex[:8]}.npz")
        except OSError:
            pass  # a read-only home: the cache is an optimisation only


# -- records ---------------------------------------------------------------------------------


def demo_chunks(cfg: Config | None = None) -> list[tuple[ChunkRecord, str]]:
    """The demo corpus as the service's ingest builds it (vectors filled in later)."""
    cfg = cfg or Config()
    out = []
    for d in DEMO_DOCUMENTS:
        doc = DocumentInput(
            source_id=d["source_id"], version=d["version"], title=d["title"], text=d["text"],
            collection=d["collection"], status=d.get("status", "approved"),
            acl=tuple(d.get("acl", ())), breadcrumb=d.get("breadcrumb", ""),
            metadata=dict(d.get("metadata", {})),
        )
        content_hash = doc.content_hash("parity")
        for p in chunk_document(doc.text, doc.breadcrumb, doc.collection, cfg.chunk_chars, cfg.parent_chars):
            text = embedded_text(doc.title, p)
            out.append((ChunkRecord(
                chunk_id=make_chunk_id(doc.source_id, p.index, doc.version),
                source_id=doc.source_id, version=doc.version, chunk_index=p.index,
                collection=doc.collection, status=doc.status, title=doc.title,
                breadcrumb=p.breadcrumb, text=p.text, parent_text=p.parent_text,
                search_text=text, acl=doc.acl, metadata=dict(doc.metadata),
                content_hash=content_hash), text))
    return out


def demo_queries() -> list[str]:
    queries = list(DEMO_QUERIES)
    for d in DEMO_DOCUMENTS:
        queries.append(d["title"])
        queries += [line[2:].strip() for line in d["text"].splitlines() if line.startswith("# ")]
    return list(dict.fromkeys(queries))


def answer_chunks(answers: dict[str, str]) -> list[tuple[ChunkRecord, str]]:
    return [(ChunkRecord(
        chunk_id=make_chunk_id(aid, 0, "v1"), source_id=aid, version="v1", chunk_index=0,
        collection="doc", status="approved", title="", breadcrumb="", text=text,
        parent_text=text, search_text=text, content_hash=hashlib.sha256(text.encode()).hexdigest()),
        text) for aid, text in answers.items()]


def with_vectors(chunks: list[tuple[ChunkRecord, str]], vectors: np.ndarray) -> list[ChunkRecord]:
    return [dataclasses.replace(c, vector=v) for (c, _), v in zip(chunks, vectors, strict=True)]


# -- engines ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Pair:
    embedded: EmbeddedEngine
    opensearch: OpenSearchEngine
    load_s: dict[str, float]


def _groups(records: list[ChunkRecord]) -> list[tuple[tuple[str, str], list[ChunkRecord]]]:
    groups: dict[tuple[str, str], list[ChunkRecord]] = {}
    for r in records:
        groups.setdefault((r.source_id, r.version), []).append(r)
    return list(groups.items())


async def _load(engine: Engine, records: list[ChunkRecord], concurrency: int = 1) -> float:
    """``replace_document`` per source version. With ``concurrency`` 1 both engines get the
    same insertion order, so Lucene's doc-id tie-break starts out the same; more in flight
    loads faster but lets OpenSearch order tied documents differently."""
    started = time.perf_counter()

    async def one(source: str, version: str, chunks: list[ChunkRecord]) -> None:
        report = await engine.replace_document(source, version, chunks)
        if report.errors:
            raise RuntimeError(f"{engine.name} refused {source}@{version}: {report.errors[:3]}")

    await _gather_limited(concurrency, [lambda s=s, v=v, c=c: one(s, v, c)
                                        for (s, v), c in _groups(records)])
    await engine.refresh()
    return time.perf_counter() - started


async def open_pair(url: str, records: list[ChunkRecord], data_dir: Path, tag: str,
                    os_concurrency: int = 1) -> Pair:
    dim = next(len(r.vector) for r in records if r.vector is not None)
    emb = EmbeddedEngine(data_dir / f"engine-{tag}")
    os_engine = OpenSearchEngine(url, index_prefix=f"parity-{tag}-{uuid.uuid4().hex[:10]}",
                                 dimension=dim, shards=1, replicas=0, request_timeout_s=60.0)
    await emb.start()
    await os_engine.start()
    try:
        load = {"embedded": await _load(emb, records), "opensearch": await _load(os_engine, records, os_concurrency)}
    except BaseException:
        await close_pair(Pair(emb, os_engine, {}))
        raise
    return Pair(emb, os_engine, load)


async def close_pair(pair: Pair) -> None:
    try:
        await pair.opensearch.drop_indices()
    finally:
        await pair.opensearch.close()
        await pair.embedded.close()


# -- comparisons -----------------------------------------------------------------------------


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def _same(a: float, b: float) -> bool:
    return _rel(a, b) <= REL_TOL


def overlap(a: Sequence[str], b: Sequence[str]) -> float:
    if not a and not b:
        return 1.0
    return len(set(a) & set(b)) / max(len(a), len(b))


async def _gather_limited(n: int, calls: list[Callable[[], Any]]) -> list[Any]:
    sem = asyncio.Semaphore(n)

    async def one(call: Callable[[], Any]) -> Any:
        async with sem:
            return await call()

    return await asyncio.gather(*(one(c) for c in calls))


def _ranked(resp: Any) -> list[tuple[str, float]]:
    return [(h.chunk.chunk_id, float(h.score)) for h in resp.hits]


def classify(emb: list[tuple[str, float]], os_: list[tuple[str, float]]) -> str:
    """Why two top-k lists differ ("" when they agree in ids and order).

    ``score_mismatch``: a hit both returned scores differently. Otherwise, when the score at
    every rank is the same in both lists, the lists differ only in how equal scores were
    ordered (Lucene breaks ties by doc id): ``tie_cutoff`` when a tie group straddles the
    k-th place (so the sets differ), ``tie_top`` when the tie is at rank 1, ``tie_order``
    below it. Anything else is ``other`` (a hit one engine matched and the other did not)."""
    if [i for i, _ in emb] == [i for i, _ in os_]:
        return ""
    es, oss = dict(emb), dict(os_)
    if any(not _same(es[d], oss[d]) for d in set(es) & set(oss)):
        return "score_mismatch"
    if len(emb) != len(os_) or any(not _same(a, b) for (_, a), (_, b) in zip(emb, os_, strict=True)):
        return "other"
    if set(es) != set(oss):
        return "tie_cutoff"
    return "tie_top" if emb[0][0] != os_[0][0] else "tie_order"


async def compare_bm25(pair: Pair, queries: list[str], flt: SearchFilter, k: int,
                       examples: int = 5) -> dict[str, Any]:
    calls_e = [lambda q=q: pair.embedded.bm25(q, k, flt, TIMEOUT_S) for q in queries]
    calls_o = [lambda q=q: pair.opensearch.bm25(q, k, flt, TIMEOUT_S) for q in queries]
    started = time.perf_counter()
    res_e = await _gather_limited(4, calls_e)
    res_o = await _gather_limited(4, calls_o)
    elapsed = time.perf_counter() - started
    overlaps, top1, classes = [], 0, Counter[str]()
    pairs = diffs = q_with_diff = 0
    max_rel = 0.0
    details = []
    incomplete = sum(1 for r in res_o if not r.complete)
    for q, re_, ro in zip(queries, res_e, res_o, strict=True):
        e, o = _ranked(re_), _ranked(ro)
        overlaps.append(overlap([d for d, _ in e], [d for d, _ in o]))
        top1 += int([d for d, _ in e[:1]] == [d for d, _ in o[:1]])
        es, oss = dict(e), dict(o)
        n_diff = 0
        for d in set(es) & set(oss):
            pairs += 1
            r = _rel(es[d], oss[d])
            max_rel = max(max_rel, r)
            n_diff += int(r > REL_TOL)
        diffs += n_diff
        q_with_diff += int(n_diff > 0)
        cls = classify(e, o)
        if cls:
            classes[cls] += 1
            if len(details) < 200:
                details.append({"query": q, "class": cls, "embedded": e, "opensearch": o})
    n = len(queries)
    return {
        "queries": n, "k": k,
        "overlap_at_k": sum(overlaps) / n, "min_overlap": min(overlaps),
        "top1_agreement": top1 / n,
        "common_hits": pairs, "score_diffs_gt_1e-4": diffs, "queries_with_score_diff": q_with_diff,
        "max_rel_score_diff": max_rel,
        "disagreements": dict(classes), "opensearch_incomplete": incomplete,
        "seconds": elapsed,
        "examples": details[:examples], "_details": details,
    }


async def _os_exact_knn(engine: OpenSearchEngine, vector: np.ndarray, k: int,
                        flt: SearchFilter) -> list[tuple[str, float]]:
    """Brute-force kNN inside OpenSearch (k-NN plugin ``knn_score`` script, l2: 1/(1+d^2))."""
    clauses = mapping.filter_clauses(flt)
    inner: dict[str, Any] = {"bool": {"filter": clauses}} if clauses else {"match_all": {}}
    body = {
        "size": k, "_source": ["chunk_id"],
        "query": {"script_score": {"query": inner, "script": {
            "source": "knn_score", "lang": "knn",
            "params": {"field": "vector", "query_value": mapping.vector_json(vector),
                       "space_type": "l2"}}}},
    }
    resp = await engine._client.search(index=engine.alias, body=body, request_timeout=TIMEOUT_S)
    return [(h["_source"]["chunk_id"], float(h["_score"])) for h in resp["hits"]["hits"]]


async def compare_knn(pair: Pair, vectors: np.ndarray, flt: SearchFilter, k: int,
                      examples: int = 5) -> dict[str, Any]:
    started = time.perf_counter()
    res_e = await _gather_limited(4, [lambda v=v: pair.embedded.knn(v, k, flt, TIMEOUT_S) for v in vectors])
    res_h = await _gather_limited(4, [lambda v=v: pair.opensearch.knn(v, k, flt, TIMEOUT_S) for v in vectors])
    res_x = await _gather_limited(4, [lambda v=v: _os_exact_knn(pair.opensearch, v, k, flt) for v in vectors])
    elapsed = time.perf_counter() - started
    n = len(vectors)
    ov_he = ov_xe = ov_hx = 0.0
    top_he = top_xe = 0
    pairs = diffs = 0
    max_rel = 0.0
    details = []
    for i, (re_, rh, x) in enumerate(zip(res_e, res_h, res_x, strict=True)):
        e, h = _ranked(re_), _ranked(rh)
        ids_e, ids_h, ids_x = [d for d, _ in e], [d for d, _ in h], [d for d, _ in x]
        ov_he += overlap(ids_e, ids_h)
        ov_xe += overlap(ids_e, ids_x)
        ov_hx += overlap(ids_x, ids_h)
        top_he += int(ids_e[:1] == ids_h[:1])
        top_xe += int(ids_e[:1] == ids_x[:1])
        es = dict(e)
        for d, s in x + h:
            if d in es:
                pairs += 1
                r = _rel(es[d], s)
                max_rel = max(max_rel, r)
                diffs += int(r > REL_TOL)
        if ids_e != ids_h and len(details) < 200:
            details.append({"query_index": i, "embedded": e, "opensearch_hnsw": h, "opensearch_exact": x})
    return {
        "queries": n, "k": k,
        "hnsw_vs_embedded_overlap": ov_he / n, "hnsw_vs_embedded_top1": top_he / n,
        "os_exact_vs_embedded_overlap": ov_xe / n, "os_exact_vs_embedded_top1": top_xe / n,
        "hnsw_recall_vs_os_exact": ov_hx / n,
        "common_hits": pairs, "score_diffs_gt_1e-4": diffs, "max_rel_score_diff": max_rel,
        "seconds": elapsed, "examples": details[:examples],
    }


async def analyzer_check(pair: Pair, records: list[ChunkRecord], queries: list[str]) -> dict[str, Any]:
    """Analysed terms: queries via ``_analyze`` on the field, documents via ``_mtermvectors``
    (the terms OpenSearch indexed), against the embedded analyzer; plus field statistics."""
    client, alias = pair.opensearch._client, pair.opensearch.alias

    async def analyse(q: str) -> list[str]:
        resp = await client.indices.analyze(index=alias, body={"field": "search_text", "text": q})
        return [t["token"] for t in resp.get("tokens", [])]

    os_terms = await _gather_limited(8, [lambda q=q: analyse(q) for q in queries])
    q_diff = [(q, t, analyze(q)) for q, t in zip(queries, os_terms, strict=True) if t != analyze(q)]
    doc_diff: list[dict[str, Any]] = []
    field_stats: dict[str, Any] = {}
    for i in range(0, len(records), 200):
        batch = records[i : i + 200]
        resp = await client.mtermvectors(index=alias, body={
            "ids": [r.chunk_id for r in batch],
            "parameters": {"fields": ["search_text"], "positions": False, "offsets": False,
                           "payloads": False, "term_statistics": False, "field_statistics": True}})
        by_id = {doc["_id"]: doc for doc in resp["docs"]}
        for r in batch:
            tv = by_id.get(r.chunk_id, {}).get("term_vectors", {}).get("search_text", {})
            got = {t: v["term_freq"] for t, v in tv.get("terms", {}).items()}
            want = dict(Counter(analyze(r.search_text)))
            if got != want:
                extra = sorted(set(got.items()) - set(want.items()))[:5]
                missing = sorted(set(want.items()) - set(got.items()))[:5]
                doc_diff.append({"chunk_id": r.chunk_id, "os_only": extra, "embedded_only": missing})
            if tv.get("field_statistics"):
                field_stats = tv["field_statistics"]
    bm25 = pair.embedded._index.bm25
    return {
        "queries_checked": len(queries), "queries_terms_differ": len(q_diff),
        "query_examples": [{"query": q, "opensearch": o, "embedded": e} for q, o, e in q_diff[:5]],
        "docs_checked": len(records), "docs_terms_differ": len(doc_diff), "doc_examples": doc_diff[:5],
        "opensearch_field_stats": field_stats,
        "embedded_field_stats": {"doc_count": bm25.doc_count, "sum_ttf": bm25.sum_total_term_freq},
    }


async def segments(pair: Pair) -> dict[str, int]:
    resp = await pair.opensearch._client.cat.segments(index=pair.opensearch.alias, params={"format": "json"})
    return {"segments": len(resp), "docs_count": sum(int(s["docs.count"]) for s in resp),
            "docs_deleted": sum(int(s["docs.deleted"]) for s in resp)}


def _strip(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not k.startswith("_")}


async def _wait_retention_lease(engine: OpenSearchEngine, limit_s: float = 120.0) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        stats = await engine._client.indices.stats(index=engine.alias, params={"level": "shards"})
        shard = next(iter(stats["indices"].values()))["shards"]["0"][0]
        max_seq = int(shard["seq_no"]["max_seq_no"])
        leases = shard["retention_leases"]["leases"]
        if leases and min(int(x["retaining_seq_no"]) for x in leases) > max_seq:
            break
        await asyncio.sleep(2.0)
    return time.perf_counter() - started


async def churn(pair: Pair, records: list[ChunkRecord], queries: list[str], k: int,
                fraction: float, seed: int) -> dict[str, Any]:
    """Deleted-document statistics: re-replace ``fraction`` of the documents (same content)."""
    groups = _groups(records)
    picked = sorted(random.Random(seed).sample(range(len(groups)), int(len(groups) * fraction)))
    for engine in (pair.embedded, pair.opensearch):
        for i in picked:
            (source, version), chunks = groups[i]
            await engine.replace_document(source, version, chunks)
        await engine.refresh()
    out: dict[str, Any] = {"reindexed_docs": len(picked)}
    out["after_reindex"] = {"segments": await segments(pair),
                            "bm25": _strip(await compare_bm25(pair, queries, SearchFilter(), k)),
                            "field_stats": (await analyzer_check(pair, records[:1], []))}
    # Soft-deleted copies survive merges while the shard's peer-recovery retention lease still
    # retains their sequence numbers; the lease advances on a background sync (~30s).
    # The merge policy reads the retained seq no as of the last commit: flush first, and
    # expunge what the first merge still kept.
    out["lease_wait_seconds"] = await _wait_retention_lease(pair.opensearch)
    client, alias = pair.opensearch._client, pair.opensearch.alias
    await client.indices.flush(index=alias, request_timeout=600)
    await client.indices.forcemerge(index=alias, params={"max_num_segments": "1"}, request_timeout=600)
    await client.indices.forcemerge(index=alias, params={"only_expunge_deletes": "true"}, request_timeout=600)
    await pair.opensearch.refresh()
    out["after_forcemerge"] = {"segments": await segments(pair),
                               "bm25": _strip(await compare_bm25(pair, queries, SearchFilter(), k)),
                               "field_stats": (await analyzer_check(pair, records[:1], []))}
    for phase in ("after_reindex", "after_forcemerge"):
        fs = out[phase]["field_stats"]
        out[phase]["field_stats"] = {"opensearch": fs["opensearch_field_stats"],
                                     "embedded": fs["embedded_field_stats"]}
    return out


# -- runs ------------------------------------------------------------------------------------


async def run_corpus(name: str, url: str, records: list[ChunkRecord], queries: list[str],
                     qvecs: np.ndarray, filters: dict[str, SearchFilter], k: int,
                     data_dir: Path, churn_fraction: float = 0.0, seed: int = 0,
                     check_analyzer: bool = True, os_concurrency: int = 1) -> dict[str, Any]:
    pair = await open_pair(url, records, data_dir, name, os_concurrency)
    try:
        out: dict[str, Any] = {
            "corpus": name, "chunks": len(records), "documents": len(_groups(records)),
            "queries": len(queries), "load_seconds": pair.load_s, "segments": await segments(pair),
            "bm25": {}, "knn": {},
        }
        for fname, flt in filters.items():
            out["bm25"][fname] = await compare_bm25(pair, queries, flt, k)
            out["knn"][fname] = await compare_knn(pair, qvecs, flt, k)
        if check_analyzer:
            out["analyzer"] = await analyzer_check(pair, records, queries)
        if churn_fraction > 0:
            out["churn"] = await churn(pair, records, queries, k, churn_fraction, seed)
        return out
    finally:
        await close_pair(pair)


async def demo_run(url: str, cache: VectorCache, k: int, data_dir: Path) -> dict[str, Any]:
    chunks = demo_chunks()
    records = with_vectors(chunks, cache.embed([t for _, t in chunks], "passage"))
    queries = demo_queries()
    qvecs = cache.embed(queries, "query")
    filters = {"no_acl": SearchFilter(acl_groups=None), "public": SearchFilter(),
               "collection_doc": SearchFilter(collections=("doc",), acl_groups=None)}
    return await run_corpus("demo", url, records, queries, qvecs, filters, k, data_dir)


async def iqa_run(url: str, cache: VectorCache, lang: str, n_queries: int, n_answers: int,
                  k: int, data_dir: Path, seed: int = 0, churn_fraction: float = 0.0,
                  check_analyzer: bool = True, os_concurrency: int = 1) -> dict[str, Any]:
    sample = insuranceqa_sample(lang, n_queries, n_answers, seed)
    chunks = answer_chunks(sample.answers)
    t0 = time.perf_counter()
    records = with_vectors(chunks, cache.embed([t for _, t in chunks], "passage"))
    queries = list(sample.queries.values())
    qvecs = cache.embed(queries, "query")
    embed_s = time.perf_counter() - t0
    out = await run_corpus(f"iqa-{lang}", url, records, queries, qvecs, {"public": SearchFilter()},
                           k, data_dir, churn_fraction, seed, check_analyzer, os_concurrency)
    out["embed_seconds"] = embed_s
    out["sample"] = {"lang": lang, "answers": len(sample.answers), "questions": len(sample.queries),
                     "seed": seed, "positives": len({a for s in sample.qrels.values() for a in s})}
    return out


def print_tables(results: list[dict[str, Any]]) -> None:
    print()
    print(f"{'corpus':<10} {'filter':<15} {'chunks':>6} {'q':>4} | {'BM25 ov@k':>9} {'top1':>6} "
          f"{'sdiff':>5} {'maxrel':>8} | {'kNN ov@k':>8} {'top1':>6} {'exact':>6} {'recall':>6} {'sdiff':>5}")
    for r in results:
        for f, b in r["bm25"].items():
            kn = r["knn"][f]
            print(f"{r['corpus']:<10} {f:<15} {r['chunks']:>6} {r['queries']:>4} | "
                  f"{b['overlap_at_k']:>9.4f} {b['top1_agreement']:>6.3f} {b['score_diffs_gt_1e-4']:>5} "
                  f"{b['max_rel_score_diff']:>8.1e} | {kn['hnsw_vs_embedded_overlap']:>8.4f} "
                  f"{kn['hnsw_vs_embedded_top1']:>6.3f} {kn['os_exact_vs_embedded_overlap']:>6.3f} "
                  f"{kn['hnsw_recall_vs_os_exact']:>6.3f} {kn['score_diffs_gt_1e-4']:>5}")
    print("  BM25 ov@k/top1: OpenSearch vs embedded; sdiff: common hits with score rel diff > 1e-4;")
    print("  kNN ov@k/top1: OpenSearch HNSW vs embedded exact; exact: OpenSearch script_score exact vs")
    print("  embedded exact; recall: OpenSearch HNSW vs OpenSearch exact (HNSW recall@k)")
    print()
    for r in results:
        for f, b in r["bm25"].items():
            if b["disagreements"]:
                print(f"{r['corpus']}/{f} BM25 disagreeing queries by class: {b['disagreements']}")
        a = r.get("analyzer")
        if a:
            print(f"{r['corpus']} analyzer: query terms differ {a['queries_terms_differ']}/{a['queries_checked']}, "
                  f"doc terms differ {a['docs_terms_differ']}/{a['docs_checked']}; field stats OS "
                  f"{a['opensearch_field_stats']} vs embedded {a['embedded_field_stats']}")
        c = r.get("churn")
        if c:
            for phase in ("after_reindex", "after_forcemerge"):
                p = c[phase]
                b = p["bm25"]
                print(f"{r['corpus']} churn {c['reindexed_docs']} docs, {phase}: segments {p['segments']}, "
                      f"BM25 ov@k {b['overlap_at_k']:.4f} top1 {b['top1_agreement']:.3f} sdiff "
                      f"{b['score_diffs_gt_1e-4']} max rel {b['max_rel_score_diff']:.1e} classes "
                      f"{b['disagreements']}; field stats OS {p['field_stats']['opensearch']} vs "
                      f"embedded {p['field_stats']['embedded']}")


async def main(args: argparse.Namespace) -> int:
    from tests.support.opensearch import bench_node_or_none

    url = bench_node_or_none(args.opensearch_url)
    if url is None:
        return 2
    started = time.perf_counter()
    cache = VectorCache(load_e5(threads=1))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_demo:
            results.append(await demo_run(url, cache, args.k, Path(tmp)))
            print(f"demo done ({time.perf_counter() - started:.0f}s)", flush=True)
        for lang in [x for x in args.langs.split(",") if x]:
            results.append(await iqa_run(url, cache, lang, args.queries, args.answers, args.k, Path(tmp),
                                         args.seed, args.churn if lang == "en" else 0.0,
                                         os_concurrency=args.os_load_concurrency))
            print(f"iqa-{lang} done ({time.perf_counter() - started:.0f}s)", flush=True)
    print_tables(results)
    total = time.perf_counter() - started
    print(f"\nembeddings: {cache.hits} cached, {cache.computed} computed in {cache.embed_seconds:.1f}s; "
          f"total {total:.0f}s")
    if args.out:
        for r in results:
            for b in r["bm25"].values():
                b.pop("_details", None)
        meta = {"opensearch_url": url, "k": args.k, "seed": args.seed, "seconds": total,
                "embeddings": {"cached": cache.hits, "computed": cache.computed}, "argv": sys.argv[1:]}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1, ensure_ascii=False))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--opensearch-url", default=os.environ.get("OPENSEARCH_URL") or "http://127.0.0.1:9200")
    p.add_argument("--out", default="")
    p.add_argument("--queries", type=int, default=500)
    p.add_argument("--answers", type=int, default=5000)
    p.add_argument("--langs", default="en,zh")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--churn", type=float, default=0.1, help="re-replace this fraction (en sample)")
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--os-load-concurrency", type=int, default=1,
                   help="replace_document calls in flight on OpenSearch (1 = same doc order as embedded)")
    sys.exit(asyncio.run(main(p.parse_args())))
