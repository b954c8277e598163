"""``python -m service eval``: argument parsing for the evaluation runner."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.eval.datasets import Judged, Lang, Split


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def add_eval_parser(sub: Any) -> None:
    e = sub.add_parser(
        "eval", help="evaluate retrieval quality and latency on judged data through the real service",
        description="Ingest a judged corpus through the service API and run every query in every mode. "
                    "InsuranceQA needs the eval extra: pip install '.[eval]'. The test split is held out.")
    e.add_argument("--split", choices=["train", "valid"], default="valid")
    e.add_argument("--lang", choices=["en", "zh"], default="en")
    e.add_argument("--judgements", default=None,
                   help="your own JSONL judgements ({query, positives, negatives, id}) instead of InsuranceQA")
    e.add_argument("--corpus", default=None, help="JSONL corpus (service document format) for --judgements")
    e.add_argument("--sample", type=int, default=None, help="evaluate N sampled queries (default: all)")
    e.add_argument("--corpus-sample", type=int, default=None,
                   help="keep about N documents: every judged positive of the sampled queries, plus random others")
    e.add_argument("--keep-negatives", action="store_true",
                   help="with --corpus-sample, also keep the shipped hard negatives of the sampled queries")
    e.add_argument("--engine", choices=["embedded", "opensearch"], default="embedded")
    e.add_argument("--opensearch-url", default=os.environ.get("RETRIEVAL_OPENSEARCH_URL", ""))
    e.add_argument("--target", default="", help="evaluate a running server instead of starting one")
    e.add_argument("--modes", type=_csv, default=None,
                   help="comma-separated (default: every mode but plan; hybrid+rerank runs only with "
                        "--reranker or --target, and naming it without either is an error)")
    e.add_argument("--models", type=_csv, default=("int8",),
                   help="int8, fp32, a model dir name, or dummy-hash (no model: for BM25-only studies)")
    e.add_argument("--reranker", default="", help="cross-encoder model: a name under the models dir or a path (enables hybrid+rerank)")
    e.add_argument("--rrf-k", type=int, default=None)
    e.add_argument("--bm25-weight", type=float, default=None)
    e.add_argument("--knn-weight", type=float, default=None)
    e.add_argument("--rerank-top-n", type=int, default=None)
    e.add_argument("--rerank-alpha", type=float, default=None,
                   help="interpolation weight the server runs with (the report sweeps every alpha anyway)")
    e.add_argument("--gate", action="store_true",
                   help="record hybrid vs hybrid+rerank in the reranker dir's valid_gate.json (what 'auto' checks)")
    e.add_argument("--chunk-chars", type=int, default=None,
                   help="override the server's child chunk size (an ingest experiment; default: the service's)")
    e.add_argument("--top-k", type=int, default=100)
    e.add_argument("--timeout", type=float, default=60.0, help="per-request deadline, seconds")
    e.add_argument("--concurrency", type=int, default=1,
                   help="queries in flight (1: sequential, latency = single-query latency)")
    e.add_argument("--calibration-sample", type=int, default=0,
                   help="also run N train questions on the same server and save their item signals "
                        "for quality calibration (python -m service.eval.calibration fit)")
    e.add_argument("--calibration-split", choices=("train", "valid"), default="train",
                   help="where the calibration questions come from; never a question this run measures "
                        "(valid: a reranker trained on every train question is over-familiar with train)")
    e.add_argument("--off-domain", action="store_true",
                   help="also run the shipped off-domain training questions (service/eval/data, en + zh, "
                        "plus seeded gibberish) on the same server and save their item signals: the "
                        "calibration's 'nothing here' negatives")
    e.add_argument("--out", default="eval-out")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--no-plots", action="store_true")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(fn=cmd_eval)


def calibration_questions(split: Split, lang: Lang, n: int, seed: int, exclude: Collection[str] = ()) -> Judged:
    """``n`` seeded InsuranceQA questions of ``split`` to fit a quality calibration on, none of
    them in ``exclude`` (the run's measured questions of the same split). The splits share one
    answer pool, so they run over the same corpus."""
    from service.eval.datasets import load_insuranceqa

    pool = load_insuranceqa(split, lang)
    if exclude:
        pool = dataclasses.replace(pool, queries={q: t for q, t in pool.queries.items() if q not in exclude})
    return pool.sample(n, seed)


def cmd_eval(args: argparse.Namespace) -> int:
    from service.eval.datasets import (
        EvalDataMissing,
        load_insuranceqa,
        load_jsonl_judgements,
    )
    from service.eval.runner import DEFAULT_MODES, EvalSettings, evaluate_service

    if args.modes is None:
        args.modes = DEFAULT_MODES
    elif "hybrid+rerank" in args.modes and not (args.reranker or args.target):
        # Asked for by name, it would ingest the whole corpus and then report the mode skipped.
        print("error: --modes hybrid+rerank needs --reranker DIR (or --target a running server)", file=sys.stderr)
        return 2
    try:
        if args.judgements:
            judged = load_jsonl_judgements(args.judgements, args.corpus)
        else:
            judged = load_insuranceqa(args.split, args.lang)
    except EvalDataMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    judged = judged.sample(args.sample, args.seed).sample_corpus(
        args.corpus_sample, args.seed, keep_negatives=args.keep_negatives)
    calibration = None
    if args.calibration_sample:
        if args.judgements or args.corpus_sample is not None:
            print("error: --calibration-sample needs InsuranceQA on its full corpus", file=sys.stderr)
            return 2
        measured = judged.queries if args.calibration_split == args.split else ()
        calibration = calibration_questions(args.calibration_split, args.lang, args.calibration_sample, args.seed,
                                            exclude=measured)
    off_domain = None
    if args.off_domain:
        from service.eval.answerability import off_domain_training
        off_domain = off_domain_training()
    settings = EvalSettings(
        out=Path(args.out), modes=args.modes, models=args.models, reranker=args.reranker,
        engine=args.engine, opensearch_url=args.opensearch_url, target=args.target, top_k=args.top_k,
        rrf_k=args.rrf_k, bm25_weight=args.bm25_weight, knn_weight=args.knn_weight,
        rerank_top_n=args.rerank_top_n, rerank_alpha=args.rerank_alpha, gate=args.gate, lang=args.lang,
        full_split=(args.split == "valid" and not args.judgements and args.sample is None and args.corpus_sample is None),
        full_corpus=(args.split == "valid" and not args.judgements and args.corpus_sample is None),
        chunk_chars=args.chunk_chars, timeout_s=args.timeout, concurrency=args.concurrency,
        plots=not args.no_plots, quiet=args.quiet, calibration=calibration, off_domain=off_domain,
        extra_meta={"command": " ".join(["python -m service", *sys.argv[1:]]), "seed": args.seed},
    )
    report = asyncio.run(evaluate_service(judged, settings))
    print((Path(args.out) / "report.md").read_text())
    print(json.dumps({"out": str(Path(args.out).resolve()), "wall_s": report["wall_s"]}))
    return 0
