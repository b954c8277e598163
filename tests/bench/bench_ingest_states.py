"""Ingest throughput with passage states stored against ingest without, in one run (absolute
times drift on a shared machine; ratios measured side by side do not).

    .venv/bin/python tests/bench/bench_ingest_states.py [--docs 300] [--rounds 3] [--langs en,zh]

Per language (InsuranceQA valid answers, the eval extra; else the synthetic bench corpus),
``--rounds`` rounds of fresh in-process servers (embedded engine, real gRPC, the
default models and the shipped split reranker), each ingesting the same documents in one
stream: without states (``rerank_states`` off, write-back off); with states from the one
pass only (the default with ``rerank_states``: tapped from the embedding pass where a
chunk's embedder input is its rerank row, service/models/one_pass.py; the chunks it cannot
serve, past the passage cap, are left to the fill once ingest is quiet), with the fill
(the default) and without it; with the one
pass and a second pass for those chunks (``rerank_states_second_pass`` on, the default
until 2026-12-07); and with two passes (``rerank_states_one_pass`` off: the reranker's
lower layers run again on every chunk). The order rotates each round. Prints chunks/s per server, the median ratio to the round's
ingest without states, and how many chunks took one pass.

``--opensearch URL`` ingests into that OpenSearch node instead (each server its own fresh
indices, deleted after it), where the engine's own indexing is part of every server's time.

``--sectioned`` gives every document a title and a breadcrumb, as a help-center article
has (InsuranceQA answers have neither): the reranker reads both, as the embedder does, so
such chunks still take one pass within the cap.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc  # noqa: E402

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc  # noqa: E402
from service.api.server import Server  # noqa: E402
from service.app import App  # noqa: E402
from service.config import load_config  # noqa: E402
from tests.bench.bench_rerank_states import RERANKER, corpus, timed_ingest  # noqa: E402
from tests.support.opensearch import drop_prefix, unique_prefix  # noqa: E402
from tests.support.scrape import parse  # noqa: E402

# Every setting spelled out, so a row measures the same thing whatever the defaults become.
# The fill (on in the default row, the one pass only) waits until ingest is quiet, so it
# should never run inside the timed stream (the servers stop right after it); the row
# without it checks that.
ONE_PASS_ONLY = "states, one pass only + fill"
MODES = {"without states": dict(rerank_states=False),
         "states, one pass + second pass": dict(rerank_states=True, rerank_states_one_pass=True,
                                                rerank_states_second_pass=True, rerank_states_fill=False),
         "states, two passes": dict(rerank_states=True, rerank_states_one_pass=False, rerank_states_fill=False),
         "states, one pass only, no fill": dict(rerank_states=True, rerank_states_one_pass=True,
                                                rerank_states_second_pass=False, rerank_states_fill=False),
         ONE_PASS_ONLY: dict(rerank_states=True, rerank_states_one_pass=True, rerank_states_second_pass=False,
                             rerank_states_fill=True)}


async def ingest(data_dir: Path, docs: list[corpus_pb2.Document], settings: dict[str, bool],
                 opensearch_url: str = "") -> tuple[float, int, int]:
    """(chunks/s, chunks, chunks whose states took one pass) for one fresh server: the
    embedded engine, or with ``opensearch_url`` a fresh index of its own on that node."""
    cfg = dataclasses.replace(load_config(None), data_dir=data_dir, reranker_model=RERANKER, api_keys_file="",
                              opensearch_url=opensearch_url, rerank_states_write_back="false", **settings)
    if opensearch_url:
        cfg = dataclasses.replace(cfg, opensearch_index_prefix=unique_prefix("bench-ingest"))
    app = App.build(cfg)
    if app.runtime.reranker is None:
        raise SystemExit(f"no reranker {RERANKER} under {cfg.models_dir}: run `make models`")
    if settings.get("rerank_states_one_pass") and not app.runtime.one_pass_states:
        raise SystemExit("one pass refused (see the log): the embedder is not the reranker's lower layers")
    server = Server(app)
    port = await server.start("127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            seconds, chunks = await timed_ingest(corpus_pb2_grpc.CorpusServiceStub(ch), docs)
        scraped = parse(app.metrics.exposition().decode())
        one = int(scraped.get(("retrieval_ingest_passage_states_total", (("pass", "one"),)), 0))
    finally:
        await server.stop(0.5)
        if opensearch_url:
            drop_prefix(opensearch_url, cfg.opensearch_index_prefix)
    return chunks / seconds, chunks, one


SECTIONS = {"en": ("Insurance answer", "Knowledge base > Insurance"), "zh": ("保险问答", "知识库 > 保险")}


async def main(n_docs: int, rounds: int, langs: list[str], sectioned: bool, opensearch_url: str) -> None:
    names = list(MODES)
    for lang in langs:
        docs, _ = corpus(lang, n_docs, 0)
        if sectioned:
            title, crumb = SECTIONS[lang]
            for i, d in enumerate(docs):
                d.title, d.breadcrumb = f"{title} {i}", crumb
        rates: dict[str, list[float]] = {m: [] for m in names}
        ratios: dict[str, list[float]] = {m: [] for m in names}
        chunks = one = 0
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(rounds):
                order = names[r % len(names):] + names[: r % len(names)]
                got = {}
                for mode in order:
                    rate, chunks, ones = await ingest(Path(tmp) / f"{r}-{len(got)}", docs, MODES[mode], opensearch_url)
                    got[mode] = rate
                    one = ones if mode == ONE_PASS_ONLY else one
                for mode in names:
                    rates[mode].append(got[mode])
                    ratios[mode].append(got[mode] / got["without states"])
        print(f"{lang}{' (sectioned)' if sectioned else ''}{' (OpenSearch)' if opensearch_url else ''}: {len(docs)} documents -> {chunks} chunks; "
              f"one pass gave {one} of them their states "
              f"(the others: past the passage cap)")
        for mode in names:
            per_round = " ".join(f"{x:.2f}" for x in ratios[mode])
            print(f"  {mode:<34} {statistics.median(rates[mode]):7.1f} chunks/s (median of {rounds}), "
                  f"ratio {statistics.median(ratios[mode]):.2f} (rounds: {per_round})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=300, help="documents per language")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--langs", default="en,zh", help="comma-separated: en, zh")
    ap.add_argument("--sectioned", action="store_true", help="give every document a title and a breadcrumb")
    ap.add_argument("--opensearch", default="", metavar="URL",
                    help="ingest into this OpenSearch node (a fresh index per server) instead of the embedded engine")
    a = ap.parse_args()
    asyncio.run(main(a.docs, a.rounds, a.langs.split(","), a.sectioned, a.opensearch))
