"""Cached passage states benchmark: rerank with stored states against recomputing them, in
one run on the same machine (absolute times drift on a shared machine; ratios do not).

    RETRIEVAL_MODELS_DIR=... .venv/bin/python tests/bench/bench_rerank_states.py [--docs 200] [--queries 40]

In-process servers (embedded engine, real gRPC, e5-small int8 + the shipped split
reranker) over the same corpus: the baseline on the one graph (``model.onnx``: every pass
recomputed in one call, what every rerank ran before the two graphs), then the served two
towers (``rerank_scoring`` "auto": the shipped card's "towers", README "Two towers") without
stored vectors (each rerank computes them), storing them at ingest (``rerank_states``), and
in write-back mode (``rerank_states_write_back``: ingest stores nothing, each query is asked
twice, the first rerank computes and stores its head's vectors, the second reads them); then
the same with the joint layers (``rerank_scoring = "joint"``: the query and passage through
the upper layers together, as served before the towers), with full-width and compact
(``rerank_states_compact``) stored states: InsuranceQA answers, en and zh (``--docs`` each; the eval extra), else the synthetic
bench corpus. Prints, per language, the rerank stage's p50 for ``rerank_top_n`` pairs (the
config's; ``--rerank-top-n N`` sets it for every server)
as the pipeline timed it (stored states read + model) and its ratio to recomputation,
hybrid+rerank Retrieve p50; ingest chunks/s with states against without; and the stored
bytes per chunk (mean, p95). ``--passage-caps 192`` adds a stored-states server per cap
(``rerank_passage_tokens``; the other rows run at the config's: the trained cap, 192, by default).
``--one-pass-only`` adds one storing only what the embedding pass gives
(``rerank_states_second_pass`` off, write-back on): each query asked twice, the first rerank
computes the head chunks ingest left without states, the second reads them all.
``--joint-weight-bits 8`` adds the stored-states and write-back rows once more with the joint
layers' weights at that width (a scratch models dir beside the installed one, the same
artifact, ``reranker.write_joint``; the shipped joint is 7-bit, which serving runs
on the fast int8 kernels even where they saturate on 8-bit weights,
``_ort.int8_weights_cannot_saturate``): on an AVX2 CPU (or under
``tests/support/avx2_cpu.py``) the 8-bit rows take the exact kernels, as served before.
``--opensearch URL`` adds two towers servers on that OpenSearch node (each its own fresh
indices, deleted after): every vector stored at ingest (``rerank_states`` "auto" there since
2026-12-07, here with the second pass for chunks past the cap) and nothing stored with
write-back off (its default before); with ``--one-pass-only`` too, a third: its default
now (the one pass only, write-back on; 1st and 2nd ask).
``--exact-kernels`` adds the stored-states and write-back rows once more with onnxruntime's
exact int8 kernels forced (``session.x64quantprecision`` on every session, as serving ran
before ``_ort.u8s8_saturates`` asked the CPU): on a CPU whose fast kernels are exact (VNNI)
that is what the probe saves, for the same logits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc  # noqa: E402

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc, types_pb2  # noqa: E402
from service.api.server import Server  # noqa: E402
from service.app import App  # noqa: E402
from service.config import load_config  # noqa: E402
from service.engines.base import make_chunk_id  # noqa: E402
from service.eval.metrics import percentile  # noqa: E402
from service.models import _ort  # noqa: E402
from tests.support.harness import fill_caught_up  # noqa: E402
from tests.support.opensearch import drop_prefix, unique_prefix  # noqa: E402

RERANKER = "e5-small-split-reranker-int8"
RERANK_TOP_N = 0  # --rerank-top-n; 0: the config's


def corpus(lang: str, n_docs: int, n_queries: int) -> tuple[list[corpus_pb2.Document], list[str]]:
    """Valid answers (their questions' judged answers first, then others) and questions."""
    try:
        from service.eval.datasets import load_insuranceqa

        data = load_insuranceqa("valid", lang)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - any reason the data is missing: synthetic corpus
        print(f"InsuranceQA unavailable ({exc}); synthetic corpus", file=sys.stderr)
        from tests.bench.bench_service import QUERIES, synthetic_docs

        return synthetic_docs(n_docs), [q for q in QUERIES if (ord(q[0]) > 0x2e80) == (lang == "zh")] * n_queries
    qids = sorted(data.queries)[:n_queries]
    ids = list(dict.fromkeys([a for q in qids for a in sorted(data.qrels[q])] + sorted(data.corpus)))[:n_docs]
    docs = [corpus_pb2.Document(source_id=f"{lang}-{i}", version="v1", text=data.corpus[i],
                                collection=types_pb2.COLLECTION_DOC) for i in ids]
    return docs, [data.queries[q] for q in qids]


async def timed_ingest(corpus_stub: corpus_pb2_grpc.CorpusServiceStub, docs: list[corpus_pb2.Document]
                       ) -> tuple[float, int]:
    """Ingest ``docs`` in one stream: (seconds until every one was acknowledged, chunks indexed)."""
    async def stream() -> AsyncIterator[corpus_pb2.IngestRequest]:
        for d in docs:
            yield corpus_pb2.IngestRequest(document=d)

    t0 = time.perf_counter()
    summary = await corpus_stub.Ingest(stream())
    return time.perf_counter() - t0, summary.chunks_indexed


@dataclasses.dataclass
class Run:
    ingest_s: float = 0.0
    chunks: int = 0
    rerank_ms: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    total_ms: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    bytes_per_chunk: list[int] = dataclasses.field(default_factory=list)
    first_rerank_ms: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # write-back: pass 1
    fill_s: float = 0.0  # with the fill: from the last ingest ack until it caught up
    filled: int = 0  # chunks the fill gave states
    scan_s: float = 0.0  # with the fill: one scan of the caught-up store (what each start reads)


def models_with_joint_bits(out: Path, bits: int) -> Path:
    """A models dir like the installed one (links), whose reranker's ``joint.onnx`` is the
    same artifact's joint layers with ``bits``-bit weights."""
    from service.offline.builder.reranker import write_joint

    installed = load_config(None).models_dir
    out.mkdir(parents=True)
    for d in installed.iterdir():
        if d.is_dir() and d.name != RERANKER:
            (out / d.name).symlink_to(d.resolve())
    shutil.copytree(installed / RERANKER, out / RERANKER)
    write_joint(out / RERANKER / "joint.onnx", bits)
    return out


async def serve(states: bool, data_dir: Path, docs: list[corpus_pb2.Document],
                queries: dict[str, list[str]], compact: bool = False, one_graph: bool = False,
                write_back: bool = False, passage_cap: int | None = None, second_pass: bool = True,
                models_dir: Path | None = None, scoring: str = "auto", opensearch_url: str = "",
                fill: bool = False) -> Run:
    """One fresh server, every setting spelled out. ``fill``: the fill of passage states on
    (``ingest/states_fill.py``), and the questions wait until it caught up after ingest."""
    cfg = load_config(None)
    cfg = dataclasses.replace(cfg, rerank_top_n=RERANK_TOP_N or cfg.rerank_top_n, data_dir=data_dir,
                              reranker_model=RERANKER, rerank_states=states,
                              rerank_states_compact=compact, rerank_states_write_back=write_back,
                              rerank_states_second_pass=second_pass, api_keys_file="",
                              opensearch_url=opensearch_url, rerank_scoring=scoring, rerank_states_fill=fill)
    if opensearch_url:
        cfg = dataclasses.replace(cfg, opensearch_index_prefix=unique_prefix("bench-states"))
    if models_dir is not None:
        cfg = dataclasses.replace(cfg, models_dir=models_dir)
    if passage_cap:
        cfg = dataclasses.replace(cfg, rerank_passage_tokens=passage_cap)
    app = App.build(cfg)
    if app.runtime.reranker is None:
        raise SystemExit(f"no reranker {RERANKER} under {cfg.models_dir}: run `make models`")
    if one_graph:  # what every rerank ran before the two graphs did: one call through model.onnx
        app.runtime.reranker.states_key = None
    server = Server(app)
    port = await server.start("127.0.0.1:0")
    run = Run()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            corpus_stub = corpus_pb2_grpc.CorpusServiceStub(ch)
            retrieval = retrieval_pb2_grpc.RetrievalServiceStub(ch)

            run.ingest_s, run.chunks = await timed_ingest(corpus_stub, docs)
            if fill:
                t0 = time.perf_counter()
                states_fill = app.ingestor.states_fill
                assert states_fill is not None
                await fill_caught_up(states_fill, None)
                run.fill_s, run.filled = time.perf_counter() - t0, states_fill.progress.written
                t0, after = time.perf_counter(), ""  # what a restart's scan reads of a caught-up store
                while after is not None:
                    _, after = await app.engine.chunks_without_states(states_fill.states_key, after, states_fill.page)
                run.scan_s = time.perf_counter() - t0
            options = retrieval_pb2.RetrievalOptions(rerank=types_pb2.RERANK_MODE_ON, min_quality=1e-9)
            for lang, qs in queries.items():
                for q in qs[:2]:  # warm up (not timed): sessions, caches, first-query paths
                    # (write-back: an unrelated question, so no timed head is stored early)
                    warm = "warm up the sessions" if write_back else q + " ?"
                    async for _ in retrieval.Retrieve(retrieval_pb2.RetrieveRequest(query=warm, top_k=10, options=options)):
                        pass
                await app.runner.rerank.states_write_back.drain()
                for attempt in range(2 if write_back else 1):
                    rerank = (run.first_rerank_ms if attempt == 0 and write_back else run.rerank_ms).setdefault(lang, [])
                    total = run.total_ms.setdefault(lang, []) if attempt == (1 if write_back else 0) else []
                    for q in qs:
                        t0 = time.perf_counter()
                        async for event in retrieval.Retrieve(retrieval_pb2.RetrieveRequest(query=q, top_k=10, options=options)):
                            if event.WhichOneof("event") == "result":
                                leg = next(x for x in event.result.legs if x.kind == types_pb2.LEG_KIND_RERANK)
                                if leg.status != types_pb2.LEG_STATUS_OK:
                                    raise SystemExit(f"rerank leg {leg.status}: {leg.detail}")
                                rerank.append(leg.latency_ms)
                        total.append((time.perf_counter() - t0) * 1000)
                        await app.runner.rerank.states_write_back.drain()  # pass 1: stored before the next query
        if app.runtime.states_key is not None:
            ids = [make_chunk_id(d.source_id, i, d.version) for d in docs for i in range(32)]
            refs = [(c.chunk_id, c.content_hash) for c in await app.engine.get_chunks(ids)]
            found = await app.engine.passage_states(refs, app.runtime.states_key)
            run.bytes_per_chunk = sorted(len(b) for b in found.values())
    finally:
        await server.stop(0.5)
        if opensearch_url:
            drop_prefix(opensearch_url, cfg.opensearch_index_prefix)
    return run


async def main(n_docs: int, n_queries: int, caps: list[int], one_pass_only: bool = False,
               exact_kernels: bool = False, joint_bits: int = 0, opensearch_url: str = "") -> None:
    docs: list[corpus_pb2.Document] = []
    queries: dict[str, list[str]] = {}
    for lang in ("en", "zh"):
        d, q = corpus(lang, n_docs, n_queries)
        docs += d
        queries[lang] = q
    with tempfile.TemporaryDirectory() as tmp:
        one_graph = await serve(False, Path(tmp) / "one-graph", docs, queries, one_graph=True)
        recompute = await serve(False, Path(tmp) / "recompute", docs, queries)
        runs = {"towers, recompute": recompute,
                "towers, stored": await serve(True, Path(tmp) / "full", docs, queries),
                "towers, write-back, 2nd ask": await serve(False, Path(tmp) / "write-back", docs, queries, write_back=True),
                "joint, recompute": await serve(False, Path(tmp) / "j-recompute", docs, queries, scoring="joint"),
                "joint, stored, full width": await serve(True, Path(tmp) / "j-full", docs, queries, scoring="joint"),
                "joint, stored, compact": await serve(True, Path(tmp) / "j-compact", docs, queries, compact=True,
                                                      scoring="joint"),
                "joint, write-back, 2nd ask": await serve(False, Path(tmp) / "j-write-back", docs, queries,
                                                          write_back=True, scoring="joint")}
        for cap in caps:
            runs[f"stored, passage cap {cap}"] = await serve(True, Path(tmp) / f"cap{cap}", docs, queries, passage_cap=cap)
        if joint_bits:
            other = models_with_joint_bits(Path(tmp) / "models-joint", joint_bits)
            runs[f"{joint_bits}-bit joint: stored, full"] = await serve(True, Path(tmp) / "joint-full", docs, queries,
                                                                      models_dir=other, scoring="joint")
            runs[f"{joint_bits}-bit joint: write-back, 2nd ask"] = await serve(
                False, Path(tmp) / "joint-write-back", docs, queries, write_back=True, models_dir=other, scoring="joint")
        if exact_kernels:  # every session these servers build takes the exact kernels
            with mock.patch.object(_ort, "u8s8_saturates", lambda: True):
                runs["exact kernels: stored, full"] = await serve(True, Path(tmp) / "exact-full", docs, queries)
                runs["exact kernels: write-back, 2nd ask"] = await serve(False, Path(tmp) / "exact-write-back", docs,
                                                                        queries, write_back=True)
        if opensearch_url:  # its default now (stored at ingest) and before (nothing stored, no write-back)
            runs["OpenSearch, stored"] = await serve(True, Path(tmp) / "os-stored", docs, queries,
                                                     opensearch_url=opensearch_url)
            runs["OpenSearch, recompute"] = await serve(False, Path(tmp) / "os-recompute", docs, queries,
                                                        opensearch_url=opensearch_url)
        if one_pass_only:
            runs["one pass only, 2nd ask"] = await serve(True, Path(tmp) / "one-pass-only", docs, queries,
                                                         write_back=True, second_pass=False)
            if opensearch_url:  # the OpenSearch default since 2026-12-07 (evening)
                runs["OpenSearch, one pass only, 2nd ask"] = await serve(
                    True, Path(tmp) / "os-one-pass-only", docs, queries, write_back=True, second_pass=False,
                    opensearch_url=opensearch_url)

    p50 = lambda xs: percentile(xs, 50)  # noqa: E731
    some = next(iter(runs.values()))
    print(f"corpus: {len(docs)} documents -> {some.chunks} chunks; {n_queries} queries per language; "
          f"rerank head = rerank_top_n {RERANK_TOP_N or load_config(None).rerank_top_n} pairs")
    print(f"{'p50, ms':<28} {'rerank stage':>13} {'vs one graph':>13} {'hybrid+rerank':>14}")
    for lang in queries:
        r = p50(one_graph.rerank_ms[lang])
        print(f"{lang + ' recompute, one graph':<28} {r:>13.1f} {'1.00x':>13} {p50(one_graph.total_ms[lang]):>14.1f}")
        for name, run in runs.items():
            s_ = p50(run.rerank_ms[lang])
            print(f"{lang + ' ' + name:<28} {s_:>13.1f} {r / s_:>12.2f}x {p50(run.total_ms[lang]):>14.1f}")
            if run.first_rerank_ms:
                f_ = p50(run.first_rerank_ms[lang])
                first = name.replace("2nd ask", "1st ask")
                print(f"{lang + ' ' + first:<28} {f_:>13.1f} {r / f_:>12.2f}x {'':>14}")
    cps_off = recompute.chunks / recompute.ingest_s
    for name, run in runs.items():
        if run is recompute:
            continue
        cps_on = run.chunks / run.ingest_s
        print(f"ingest, {name}: {cps_on:.1f} chunks/s vs {cps_off:.1f} without states (ratio {cps_on / cps_off:.2f})")
        b = run.bytes_per_chunk
        if b:
            print(f"  stored states: {len(b)} chunks, {sum(b) / len(b):.0f} bytes a chunk on average "
                  f"(p50 {percentile([float(x) for x in b], 50):.0f}, p95 {percentile([float(x) for x in b], 95):.0f}, "
                  f"max {b[-1]})")

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=200, help="documents per language")
    ap.add_argument("--queries", type=int, default=40, help="queries per language")
    ap.add_argument("--passage-caps", default="",
                    help="comma-separated: also store full-width states with rerank_passage_tokens at each "
                         "(the other rows run at the config's: the trained cap, 192, by default)")
    ap.add_argument("--one-pass-only", action="store_true",
                    help="also a server with rerank_states_second_pass off and write-back on (1st and 2nd ask)")
    ap.add_argument("--exact-kernels", action="store_true",
                    help="also the stored-states and write-back rows with the exact int8 kernels forced")
    ap.add_argument("--joint-weight-bits", type=int, default=0, choices=[0, 7, 8],
                    help="also the stored-states and write-back rows with the joint layers' weights at this width "
                         "(the shipped joint: 7)")
    ap.add_argument("--rerank-top-n", type=int, default=0,
                    help="candidates every server reranks (default: the config's rerank_top_n)")
    ap.add_argument("--opensearch", default="", metavar="URL",
                    help="also two towers servers on this OpenSearch node (fresh indices, deleted after): vectors "
                         "stored at ingest (its default) and nothing stored without write-back (its default before)")
    a = ap.parse_args()
    RERANK_TOP_N = a.rerank_top_n
    asyncio.run(main(a.docs, a.queries, [int(c) for c in a.passage_caps.split(",") if c], a.one_pass_only,
                     a.exact_kernels, a.joint_weight_bits, a.opensearch))
