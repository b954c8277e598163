"""Smoke evaluation: a small InsuranceQA sample through the real service (in-process gRPC
server, embedded engine, e5-small int8), failing when a stage regresses below the stage
before it. Thresholds come from measured values (see MEASURED below), not guesses.

Skips loudly when the ``eval`` extra (insuranceqa-data) is missing, except under CI=true,
where it fails: ``make test`` installs the extra.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from service.eval.datasets import INSTALL_HINT, insuranceqa_available, load_insuranceqa
from service.eval.runner import EvalSettings, evaluate_service

pytestmark = pytest.mark.slow
TUNED = Path(__file__).resolve().parents[2] / "service" / "eval" / "fusion_tuned.json"

# The sample: 60 train questions (seed 0), corpus = their judged answers + the first 10
# shipped hard negatives of each + random answers up to 1,000 documents. English, int8.
QUESTIONS, NEGATIVES_PER_QUESTION, CORPUS, SEED = 60, 10, 1000, 0

# Measured on this sample (2 cores, e5-small int8, embedded engine, fusion from
# fusion_tuned.json: rrf_k 10, bm25_weight 0.3, knn_weight 1.0), nDCG@10. The hybrid is the
# default's three legs (the Latin-script leg, bge-small-en, fused with its own settings:
# README "The Latin-script dense leg"); two legs measured 0.6197 here.
MEASURED = {"bm25": 0.4044, "knn": 0.6425, "hybrid": 0.6590}
# The old defaults (rrf_k 60, equal weights) measured hybrid 0.5476 here: 0.095 below kNN.
# The shipped negatives are hard for BM25 but easy for dense models, so on this small
# sample tuned fusion sits 0.023 below kNN (on the full valid corpus it is 0.011 above).
# Stage over stage: kNN may not fall below BM25 by more than KNN_MARGIN (measured +0.238);
# hybrid may not fall below the best single leg by more than HYBRID_MARGIN (measured -0.023,
# the old defaults -0.095 fail it).
KNN_MARGIN = 0.03
HYBRID_MARGIN = 0.05
# Absolute floors: no stage may lose more than FLOOR_DROP of its measured value (the run is
# deterministic on one machine; the slack absorbs int8 kernel differences across CPUs).
FLOOR_DROP = 0.03


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


@pytest.fixture(scope="module")
def judged():  # type: ignore[no-untyped-def]
    if not insuranceqa_available():
        msg = f"SMOKE EVALUATION NOT RUN: {INSTALL_HINT}"
        if _ci():
            pytest.fail(msg + " (CI=true: the eval extra must be installed)")
        pytest.skip(msg)
    full = load_insuranceqa("train", "en").sample(QUESTIONS, SEED)
    negatives = {q: ns[:NEGATIVES_PER_QUESTION] for q, ns in full.negatives.items()}
    return dataclasses.replace(full, negatives=negatives).sample_corpus(CORPUS, SEED, keep_negatives=True)


async def test_each_stage_earns_its_place(judged, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from service.offline.builder import build_all, default_models_dir

    build_all(default_models_dir())  # no-op when current
    # Fusion as tuned on train (service/eval/fusion_tuned.json). With the old defaults (rrf_k 60,
    # equal weights) this very test fails: hybrid 0.548 < kNN 0.643 - margin.
    tuned = json.loads(TUNED.read_text())["languages"]["en"]["chosen"]
    settings = EvalSettings(out=tmp_path, modes=("bm25", "knn", "hybrid"), models=("int8",),
                            rrf_k=tuned["rrf_k"], bm25_weight=tuned["bm25_weight"], knn_weight=tuned["knn_weight"],
                            plots=False, save_runs=False, quiet=True)
    report = await evaluate_service(judged, settings)
    rows = {r["mode"]: r for r in report["results"]}
    ndcg = {m: rows[m]["metrics"]["ndcg@10"] for m in ("bm25", "knn", "hybrid")}
    detail = f"nDCG@10 {ndcg}; measured {MEASURED}; margins {KNN_MARGIN}/{HYBRID_MARGIN}/{FLOOR_DROP}"
    for m in ndcg:
        assert rows[m]["outcomes"] == {"ATTEMPT_OUTCOME_EVIDENCE_FOUND": QUESTIONS}, rows[m]["outcomes"]
        assert not rows[m]["leg_failures"], rows[m]["leg_failures"]
    # Stage over stage: dense may not fall below lexical, fusion not below the best leg.
    assert ndcg["knn"] >= ndcg["bm25"] - KNN_MARGIN, detail  # measured 0.6425 vs 0.4044
    assert ndcg["hybrid"] >= max(ndcg["bm25"], ndcg["knn"]) - HYBRID_MARGIN, detail  # measured 0.6197 vs 0.6425
    # And no stage may silently lose what it measured.
    for m, value in MEASURED.items():
        assert ndcg[m] >= value - FLOOR_DROP, f"{m} regressed: {detail}"


# -- the rerank stage -------------------------------------------------------------------
# The trained reranker ships as a committed delta that `make models` assembles (with its
# gate file), so this stage runs on every install; it skips loudly only where the models
# were not built, and fails under CI=true. Sample: 400 VALID questions per language (the
# reranker trained on train), corpus = judged answers + 10 shipped negatives each + random
# answers up to 5,000 documents.
#
# Why 400: the 40 questions this stage used to ask could not tell a +0.01 reranker from a
# -0.01 one (paired standard error ~0.03): on them the continued reranker read 0.7230 against
# a hybrid of 0.7292, while it adds +0.047 over the hybrid on 500 questions of the full valid
# corpus. At 400 the paired 95 % interval of rerank over hybrid is about +-0.017.
RERANK_QUESTIONS, RERANK_CORPUS = 400, 5000
# Measured 2026-12-07 evening (AMD EPYC with AVX-512 VNNI, the default's legs: three in
# English, two in Chinese; the server's rerank order, rerank depth 50, passage cap 192),
# nDCG@10, with the shipped reranker (the towers trained with in-batch negatives). Paired
# rerank - hybrid, 95 % bootstrap: en +0.062 (+0.042..+0.081), zh +0.088 (+0.065..+0.111).
# At cap 128 that afternoon: + rerank en 0.5986 / zh 0.4445, en +0.063 (+0.044..+0.081),
# zh +0.086 (+0.063..+0.109). At depth 20 the same
# morning (another machine of the kind): hybrid en 0.5382 / zh 0.3537, + rerank 0.5860 /
# 0.4232, en +0.048 (+0.031..+0.066), zh +0.070 (+0.053..+0.088). The continued reranker (AVX2,
# 2026-12-04): hybrid en 0.5398 / zh 0.3522, + rerank 0.5722 / 0.4149, en +0.032
# (+0.015..+0.049), zh +0.063 (+0.046..+0.079); the one before it en +0.032, zh +0.056.
RERANK_MEASURED = {"en": {"hybrid": 0.5360, "hybrid+rerank": 0.5977},
                   "zh": {"hybrid": 0.3587, "hybrid+rerank": 0.4468}}
# Rerank must add at least this over hybrid: below the lower end of both rerankers' paired
# intervals, so a reranker that adds nothing (or scores pairs wrongly) fails.
RERANK_MARGIN = {"en": 0.01, "zh": 0.03}


def _gated_reranker() -> Path:
    from service.app import DEFAULT_RERANKER, resolve_reranker
    from service.config import Config

    choice = resolve_reranker(dataclasses.replace(Config(), reranker_model="auto"))
    if choice.backend is None:
        msg = f"RERANK SMOKE EVALUATION NOT RUN: {choice.reason}"
        if _ci():
            pytest.fail(msg + " (CI=true: make test builds the shipped reranker)")
        pytest.skip(msg)
    return Config().models_dir / DEFAULT_RERANKER


@pytest.mark.parametrize("lang", ["en", "zh"])
async def test_rerank_earns_its_place(lang: str, tmp_path: Path) -> None:
    if not insuranceqa_available():
        msg = f"RERANK SMOKE EVALUATION NOT RUN: {INSTALL_HINT}"
        if _ci():
            pytest.fail(msg + " (CI=true: the eval extra must be installed)")
        pytest.skip(msg)
    reranker = _gated_reranker()
    full = load_insuranceqa("valid", lang).sample(RERANK_QUESTIONS, SEED)
    negatives = {q: ns[:NEGATIVES_PER_QUESTION] for q, ns in full.negatives.items()}
    judged = dataclasses.replace(full, negatives=negatives).sample_corpus(RERANK_CORPUS, SEED, keep_negatives=True)
    # No rerank_alpha: the server orders the head as it does by default (the reranker's
    # shipped rerank_order.json, else its gate's alpha).
    settings = EvalSettings(out=tmp_path, modes=("hybrid", "hybrid+rerank"), models=("int8",), reranker=str(reranker),
                            plots=False, save_runs=False, quiet=True)
    report = await evaluate_service(judged, settings)
    rows = {r["mode"]: r for r in report["results"]}
    ndcg = {m: rows[m]["metrics"]["ndcg@10"] for m in ("hybrid", "hybrid+rerank")}
    detail = f"{lang} nDCG@10 {ndcg}; measured {RERANK_MEASURED.get(lang)}"
    print(detail)
    assert rows["hybrid+rerank"]["outcomes"] == {"ATTEMPT_OUTCOME_EVIDENCE_FOUND": RERANK_QUESTIONS}, detail
    assert not rows["hybrid+rerank"]["degraded"] and not rows["hybrid+rerank"]["leg_failures"], detail
    assert ndcg["hybrid+rerank"] >= ndcg["hybrid"] + RERANK_MARGIN[lang], detail
    for m, value in RERANK_MEASURED.get(lang, {}).items():
        assert ndcg[m] >= value - FLOOR_DROP, f"{m} regressed: {detail}"
