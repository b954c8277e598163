"""Answerability: off-topic and gibberish questions end INSUFFICIENT with no relevance level,
answerable questions keep EVIDENCE_FOUND, with the shipped models and the server defaults.

Two knowledge bases, each probed with the other's questions (both ways round):
- the demo corpus (product help, en + zh): in-domain = the demo ranking cases; off topic =
  InsuranceQA valid questions, general-knowledge questions and seeded gibberish, en and zh;
- an InsuranceQA valid sample (en + zh answers in one index): in-domain = the sampled
  valid questions (answerable when the ungated top-1 is a judged answer); off topic = the
  demo questions, general-knowledge questions and gibberish.
Both with rerank on (the shipped reranker, chosen by "auto" as a fresh install does) and
off (the hybrid calibration). Each run prints its rates and the operating curve over
``min_quality``; the bar is >= 95 % each way, and every EVIDENCE_FOUND has a relevance level.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from service._gen.retrieval.v1 import corpus_pb2, types_pb2
from service.app import DEFAULT_RERANKER, resolve_reranker
from service.config import Config
from service.eval.answerability import (
    GENERAL_OFF_TOPIC,
    PRODUCT_SUPPORT_OFF_TOPIC,
    Probe,
    gibberish,
    off_domain_training,
    operating_curve,
    probe,
    summarize,
)
from service.eval.datasets import INSTALL_HINT, Judged, insuranceqa_available, load_insuranceqa
from service.models.base import EmbeddingBackend
from tests.support.demo_expectations import RANKING_CASES
from tests.support.harness import Live, launch, shutdown

pytestmark = pytest.mark.slow

BAR = 0.95
# 200 valid questions per language (~256 answerable, +-1.5 points). At 60 (87 answerable) the
# bar hung on one question: the same code and models kept 83 / 87 on an AVX2 EPYC and 82 / 87
# on an AVX-512 VNNI Xeon, whose float kernels move scores a little.
QUESTIONS, CORPUS, SEED = 200, 1000, 0
# The gate runs' valid sample (README "Evaluation": --sample 500, seed 0), on whose answerable
# lists the "nothing here" gates are chosen: the answerable probes are drawn from the other
# valid questions, so this check is held out on both sides.
GATE_RUN_QUESTIONS = 500
OFF_TOPIC_IQA = 15  # InsuranceQA questions per language asked of the demo corpus
# Demo-corpus questions for the InsuranceQA knowledge base (product help, not insurance).
DEMO_QUESTIONS = [q for q, _ in RANKING_CASES] + ["what is new in v2.4", "v2.4 SSO SAML", "how do I enable two-factor login"]
CURVE = (0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5)


def held_out_valid(lang: str) -> Judged:
    """The InsuranceQA valid questions of ``lang`` that the gate runs do not ask."""
    valid = load_insuranceqa("valid", lang)
    return valid.without(valid.sample(GATE_RUN_QUESTIONS, SEED).queries)


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def _need(ok: bool, msg: str) -> None:
    if not ok:
        if _ci():
            pytest.fail(msg + " (CI=true: make test installs and builds everything this needs)")
        pytest.skip(msg)


@pytest.fixture(scope="module")
def reranker_cfg() -> Config:
    cfg = dataclasses.replace(Config(), reranker_model="auto")
    _need(insuranceqa_available(), f"ANSWERABILITY CHECK NOT RUN: {INSTALL_HINT}")
    choice = resolve_reranker(cfg)
    _need(choice.backend is not None, f"ANSWERABILITY CHECK NOT RUN: the shipped reranker is not usable "
                                      f"({choice.reason}); run `make models`")
    return cfg


@pytest.fixture(scope="module")
async def demo_kb(tmp_path_factory: pytest.TempPathFactory, e5_embedder: EmbeddingBackend,
                  bge_embedder: EmbeddingBackend, reranker_cfg: Config) -> AsyncIterator[Live]:
    # The default's models: e5, the Latin-script leg's bge and the shipped reranker.
    cfg = dataclasses.replace(reranker_cfg, data_dir=tmp_path_factory.mktemp("answerability-demo"))
    live = await launch(cfg, e5_embedder, latin_embedder=bge_embedder)
    yield live
    await shutdown(live)


@pytest.fixture(scope="module")
async def iqa_kb(tmp_path_factory: pytest.TempPathFactory, e5_embedder: EmbeddingBackend,
                 bge_embedder: EmbeddingBackend, reranker_cfg: Config) -> AsyncIterator[tuple[Live, list[Probe]]]:
    """One index with an InsuranceQA valid sample in both languages (ids prefixed en:/zh:)."""
    cfg = dataclasses.replace(reranker_cfg, data_dir=tmp_path_factory.mktemp("answerability-iqa"))
    live = await launch(cfg, e5_embedder, demo=False, latin_embedder=bge_embedder)
    probes: list[Probe] = []
    docs = []
    for lang in ("en", "zh"):
        judged = held_out_valid(lang).sample(QUESTIONS, SEED).sample_corpus(CORPUS, SEED)
        for doc_id in judged.corpus:
            docs.append(corpus_pb2.Document(source_id=f"{lang}:{doc_id}", version="v1", text=judged.corpus[doc_id],
                                            collection=types_pb2.COLLECTION_DOC,
                                            status=types_pb2.SOURCE_STATUS_APPROVED))
        probes += [Probe(q, "in_domain", frozenset(f"{lang}:{d}" for d in judged.qrels[qid]), lang)
                   for qid, q in judged.queries.items()]
    summary = await live.ingest(docs)
    assert not summary.errors, summary.errors[:3]
    yield live, probes
    await shutdown(live)


def _off_topic(questions: dict[str, list[str]]) -> list[Probe]:
    out = []
    for lang in ("en", "zh"):
        out += [Probe(q, "off_topic", lang=lang) for q in (*GENERAL_OFF_TOPIC[lang], *questions.get(lang, []))]
        out += [Probe(q, "gibberish", lang=lang) for q in gibberish(10, lang, SEED)]
    return out


def _report(name: str, results: list, rerank: bool) -> dict:  # type: ignore[type-arg]
    s = summarize(results)
    s["curve"] = operating_curve(results, CURVE)
    print(f"\n[answerability] {name} rerank={'on' if rerank else 'off'}: " + json.dumps(s, ensure_ascii=False))
    out = Path(os.environ.get("ANSWERABILITY_OUT", ".cache/answerability"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-rerank-{'on' if rerank else 'off'}.json").write_text(json.dumps(s, indent=2, ensure_ascii=False))
    return s


def _check(s: dict, rerank: bool) -> None:  # type: ignore[type-arg]
    want = "QUALITY_SOURCE_RERANKER_PROBABILITY" if rerank else "QUALITY_SOURCE_HYBRID_CALIBRATED"
    assert s["quality_sources"] == [want], s["quality_sources"]
    assert s["off_topic_nothing_here"] >= BAR, s["off_topic_failures"]
    assert s["answerable"] >= 5 and s["answerable_found"] >= BAR, s
    assert s["found_without_level"] == 0, s  # what the default gate lets through has a level


@pytest.mark.parametrize("rerank", [True, False], ids=["rerank-on", "rerank-off"])
async def test_demo_kb_says_nothing_here(demo_kb: Live, rerank: bool) -> None:
    iqa = {lang: list(load_insuranceqa("valid", lang).sample(OFF_TOPIC_IQA, SEED + 1).queries.values())
           for lang in ("en", "zh")}
    probes = [Probe(q, "in_domain", frozenset({src})) for q, src in RANKING_CASES] + _off_topic(iqa)
    _check(_report("demo", await probe(demo_kb.retrieval, probes, rerank=rerank), rerank), rerank)


# With rerank on, a reranked list passes only when the first stage's own judge (the hybrid
# calibration of the fused top) also finds something (QualityModel.gate): the reranker alone,
# trained on in-domain pairs, let Chinese software-support questions through (66 / 71). The
# two judges meet one joint gate, fitted on both at once (README "The joint gate"): each
# one's own gate, fitted as if it judged alone, refused 16 of 256 answerable questions here.
@pytest.mark.parametrize("rerank", [True, False], ids=["rerank-on", "rerank-off"])
async def test_insuranceqa_kb_says_nothing_here(iqa_kb: tuple[Live, list[Probe]], rerank: bool) -> None:
    live, in_domain = iqa_kb
    probes = in_domain + _off_topic({"en": [*DEMO_QUESTIONS[:4], *DEMO_QUESTIONS[8:], *PRODUCT_SUPPORT_OFF_TOPIC["en"]],
                                     "zh": [*DEMO_QUESTIONS[4:8], *PRODUCT_SUPPORT_OFF_TOPIC["zh"]]})
    s = _report("insuranceqa", await probe(live.retrieval, probes, rerank=rerank), rerank)
    print(f"[answerability] insuranceqa rerank={'on' if rerank else 'off'}: answerable kept "
          f"{s['answerable_found']:.4f} of {s['answerable']} against the {BAR} bar")
    _check(s, rerank)


def test_answerable_probes_are_held_out_from_the_gate_runs() -> None:
    """The gates are chosen on the answerable lists of the gate runs' 500 valid questions per
    language: this check asks none of them."""
    _need(insuranceqa_available(), INSTALL_HINT)
    for lang in ("en", "zh"):
        valid = load_insuranceqa("valid", lang)
        asked = set(held_out_valid(lang).sample(QUESTIONS, SEED).queries)
        assert len(asked) == QUESTIONS and not asked & set(valid.sample(GATE_RUN_QUESTIONS, SEED).queries)


def test_probes_are_held_out_from_the_calibration_negatives() -> None:
    """What this check asks is never what the calibrations were fitted on."""
    fitted = set(off_domain_training().queries.values())
    asked = {*DEMO_QUESTIONS, *(q for lang in ("en", "zh") for q in (*GENERAL_OFF_TOPIC[lang], *PRODUCT_SUPPORT_OFF_TOPIC[lang],
                                                                    *gibberish(10, lang, SEED)))}
    assert not fitted & asked, sorted(fitted & asked)


def test_fresh_install_reranks_by_default(reranker_cfg: Config) -> None:
    """`make models` assembles the shipped reranker and "auto" (the default) picks it."""
    assert Config().reranker_model == "auto"
    choice = resolve_reranker(reranker_cfg)
    assert choice.backend is not None and choice.backend.info.model_id == DEFAULT_RERANKER
    assert choice.alpha < 1.0  # the alpha tuned on valid, from the shipped gate file
