"""What a chunk's first rerank costs when ingest left its vector to it (the one pass only,
``rerank_states_second_pass`` off, the default), against ingest's second pass, on a corpus
large enough that the questions' heads rarely overlap (the rerank bench's 200 documents
per language let most first asks find their head already computed).

    .venv/bin/python tests/bench/bench_first_rerank.py [--docs 4000] [--queries 60] [--lang zh] \
        [--rerank-top-n 20] [--opensearch URL]

Three fresh servers (real gRPC, the default models and the shipped split reranker; the
embedded engine, or with ``--opensearch`` each its own fresh indices on that node), the same
InsuranceQA valid answers and questions: one storing every vector at ingest (second pass
on); one with the one pass only and write-back, the fill off, where each question is asked
twice (the first ask computes the head chunks past the passage cap, write-back stores them,
the second reads them); and the default, the one pass only with the fill
(``ingest/states_fill.py``), asked once the fill caught up after ingest. Prints the rerank
stage's p50 / p90 per server and ask, hybrid + rerank p50, ingest chunks/s (one run each:
the ingest bench, ``bench_ingest_states.py``, is the one for ingest ratios), and how long
the fill took (from the last ingest ack, its quiet wait included) for how many chunks, and
what a start's scan of the caught-up store takes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tests.bench.bench_rerank_states as rerank_bench  # noqa: E402
from service.config import load_config  # noqa: E402
from service.eval.metrics import percentile  # noqa: E402


async def main(n_docs: int, n_queries: int, lang: str, opensearch_url: str) -> None:
    docs, questions = rerank_bench.corpus(lang, n_docs, n_queries)
    queries = {lang: questions}
    with tempfile.TemporaryDirectory() as tmp:
        second = await rerank_bench.serve(True, Path(tmp) / "second-pass", docs, queries, second_pass=True,
                                          opensearch_url=opensearch_url)
        only = await rerank_bench.serve(True, Path(tmp) / "one-pass-only", docs, queries, write_back=True,
                                        second_pass=False, opensearch_url=opensearch_url, fill=False)
        filled = await rerank_bench.serve(True, Path(tmp) / "one-pass-fill", docs, queries, write_back=True,
                                          second_pass=False, opensearch_url=opensearch_url, fill=True)
    depth = rerank_bench.RERANK_TOP_N or load_config(None).rerank_top_n
    print(f"{lang}{' on OpenSearch' if opensearch_url else ''}: {len(docs)} documents -> {second.chunks} chunks; "
          f"{len(questions)} questions; rerank head {depth} pairs")
    print(f"{'rerank stage, ms':<40} {'p50':>7} {'p90':>7} {'hybrid+rerank p50':>18} {'ingest chunks/s':>16}")

    def row(name: str, ms: list[float], total: list[float] | None, cps: float | None) -> None:
        t = f"{percentile(total, 50):.1f}" if total else ""
        c = f"{cps:.1f}" if cps else ""
        print(f"{name:<40} {percentile(ms, 50):>7.1f} {percentile(ms, 90):>7.1f} {t:>18} {c:>16}")

    row("every vector stored at ingest", second.rerank_ms[lang], second.total_ms[lang], second.chunks / second.ingest_s)
    row("one pass only, 1st ask (computes)", only.first_rerank_ms[lang], None, only.chunks / only.ingest_s)
    row("one pass only, 2nd ask (all read)", only.rerank_ms[lang], only.total_ms[lang], None)
    row("one pass only + fill, 1st ask", filled.first_rerank_ms[lang], None, filled.chunks / filled.ingest_s)
    row("one pass only + fill, 2nd ask", filled.rerank_ms[lang], filled.total_ms[lang], None)
    print(f"the fill: {filled.filled} chunks in {filled.fill_s:.1f} s after the last ingest ack "
          f"(its {load_config(None).rerank_states_fill_idle_s:.0f} s quiet wait included); a start's scan of the "
          f"caught-up store: {filled.scan_s:.2f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=4000, help="InsuranceQA valid answers")
    ap.add_argument("--queries", type=int, default=60, help="valid questions")
    ap.add_argument("--lang", default="zh", choices=["en", "zh"])
    ap.add_argument("--rerank-top-n", type=int, default=0, help="candidates reranked (default: the config's)")
    ap.add_argument("--opensearch", default="", metavar="URL", help="ingest into this OpenSearch node instead")
    a = ap.parse_args()
    rerank_bench.RERANK_TOP_N = a.rerank_top_n
    asyncio.run(main(a.docs, a.queries, a.lang, a.opensearch))
