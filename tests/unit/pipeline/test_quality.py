"""Calibrated quality: the logistic models, the hash check, and the fallbacks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from service.domain import QualitySource, RelevanceLevel
from service.engines.base import ChunkRecord
from service.pipeline.fusion import Candidate
from service.pipeline.quality import (
    CALIBRATION_FILE,
    HYBRID_FEATURES,
    RERANK_FEATURES,
    Logistic,
    QualityModel,
    load_calibration,
    fingerprint,
    parse_calibration,
    signals,
)
from service.pipeline.relevance import relevance_level


def _logistic(features: tuple[str, ...], coef: float) -> dict[str, object]:
    return Logistic(features, tuple(0.0 for _ in features), tuple(1.0 for _ in features),
                    tuple(coef if f in ("dense_cos", "rerank_logit") else 0.0 for f in features), -2.0).to_json()


def _doc(kind: str, sha: str) -> dict[str, object]:
    features = RERANK_FEATURES if kind == "rerank" else HYBRID_FEATURES
    return {"version": 1, "kind": kind, "onnx_sha256": sha,
            "models": {"both/en": _logistic(features, 4.0), "both/cjk": _logistic(features, 2.0),
                       "bm25/en": _logistic(features, 1.0)}}


def _candidate(distance: float | None, bm25: float | None, fused: float, rerank: float | None = None) -> Candidate:
    chunk = ChunkRecord(chunk_id="s#0@v1", source_id="s", version="v1", chunk_index=0, collection="doc",
                        status="approved", title="s", breadcrumb="", text="t", parent_text="t", search_text="t")
    return Candidate(chunk, fused_score=fused, bm25_score=bm25, distance=distance, rerank_score=rerank)


def test_signals_mark_missing_legs() -> None:
    x = signals(dense_score=None, bm25_score=3.0, fused_score=0.05, max_fused=0.1)
    assert x["has_dense"] == 0.0 and x["dense_cos"] == 0.0 and x["has_bm25"] == 1.0
    assert x["bm25_log"] == pytest.approx(math.log1p(3.0)) and x["fused_rel"] == pytest.approx(0.5)


def test_probability_is_logistic_per_language() -> None:
    model = QualityModel(hybrid=parse_calibration(_doc("hybrid", "h"), "hybrid"),
                         rerank=parse_calibration(_doc("rerank", "r"), "rerank"))
    c = _candidate(distance=math.sqrt(2 * (1 - 0.9)), bm25=2.0, fused=0.1)
    assert model.assign(c, reranked=False, max_fused=0.2, cjk=False) is QualitySource.HYBRID_CALIBRATED
    assert c.quality == pytest.approx(1 / (1 + math.exp(-(-2.0 + 4.0 * 0.9))), rel=1e-6)
    model.assign(c, reranked=False, max_fused=0.2, cjk=True)
    assert c.quality == pytest.approx(1 / (1 + math.exp(-(-2.0 + 2.0 * 0.9))), rel=1e-6)
    # One leg answered: its own model where fitted ("bm25/en"), else the two-leg one.
    model.assign(c, reranked=False, max_fused=0.2, cjk=False, legs="bm25", answered_max_fused=0.1)
    assert c.quality == pytest.approx(1 / (1 + math.exp(-(-2.0 + 1.0 * 0.9))), rel=1e-6)
    model.assign(c, reranked=False, max_fused=0.2, cjk=True, legs="knn")
    assert c.quality == pytest.approx(1 / (1 + math.exp(-(-2.0 + 2.0 * 0.9))), rel=1e-6)
    c.rerank_score = 1.5
    assert model.assign(c, reranked=True, max_fused=0.2, cjk=False) is QualitySource.RERANKER_PROBABILITY
    assert c.quality == pytest.approx(1 / (1 + math.exp(-(-2.0 + 4.0 * 1.5 + 4.0 * 0.9))), rel=1e-6)


def test_a_signal_the_fit_always_had_counts_as_neutral_when_an_item_lacks_it() -> None:
    # Fitted on lists whose top items all had a kNN cosine (has_dense mean 1), with a
    # negative cosine weight (a reranker-conditional artefact): an item found by BM25 or the
    # Latin-script leg alone has no cosine, and reading it as 0 (19 sd below the fitted mean)
    # made a hopeless candidate 0.9 likely. It counts as the fitted mean instead.
    features = RERANK_FEATURES
    mean = {"rerank_logit": -4.3, "dense_cos": 0.89, "has_dense": 1.0, "bm25_log": 1.1, "has_bm25": 0.55, "fused_rel": 0.68}
    scale = {"rerank_logit": 4.06, "dense_cos": 0.047, "has_dense": 1.0, "bm25_log": 1.03, "has_bm25": 0.5, "fused_rel": 0.19}
    coef = {"rerank_logit": 2.62, "dense_cos": -0.67, "has_dense": 0.0, "bm25_log": 0.32, "has_bm25": -0.13, "fused_rel": 0.83}
    model = Logistic(features, tuple(mean[f] for f in features), tuple(scale[f] for f in features),
                     tuple(coef[f] for f in features), -2.92)
    lacking = signals(dense_score=None, bm25_score=3.0, fused_score=0.03, max_fused=0.1, rerank_score=-11.9)
    p = model.probability(lacking)
    with_mean_cosine = model.probability({**lacking, "dense_cos": 0.89, "has_dense": 1.0})
    assert p == pytest.approx(with_mean_cosine) and p < 0.001
    # A flag the fitting rows varied on (has_bm25) keeps its fitted meaning.
    no_bm25 = signals(dense_score=0.8, bm25_score=None, fused_score=0.03, max_fused=0.1, rerank_score=-11.9)
    z = -2.92 + sum(coef[f] * (no_bm25[f] - mean[f]) / scale[f] for f in features)
    assert model.probability(no_bm25) == pytest.approx(1 / (1 + math.exp(-z)))


def test_uncalibrated_fallbacks() -> None:
    model = QualityModel()
    c = _candidate(distance=0.5, bm25=1.0, fused=0.1, rerank=0.0)
    assert model.assign(c, reranked=True, max_fused=0.2, cjk=False) is QualitySource.RERANKER_PROBABILITY
    assert c.quality == pytest.approx(0.5)
    assert model.assign(c, reranked=False, max_fused=0.2, cjk=False) is QualitySource.DENSE_DISTANCE
    lexical = _candidate(distance=None, bm25=1.0, fused=0.1)
    assert model.assign(lexical, reranked=False, max_fused=0.2, cjk=False) is QualitySource.RANK_FALLBACK


def test_calibration_applies_only_to_its_model(tmp_path: Path) -> None:
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(_doc("hybrid", "abc")))
    assert load_calibration(tmp_path, "hybrid", "abc") is not None
    assert load_calibration(tmp_path, "hybrid", "another-build") is None
    assert load_calibration(tmp_path / "missing", "hybrid", "abc") is None
    with pytest.raises(ValueError, match="kind"):
        load_calibration(tmp_path, "rerank", "abc")
    partial = _doc("hybrid", "abc")
    del partial["models"]["both/cjk"]  # type: ignore[attr-defined]
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(partial))
    with pytest.raises(ValueError, match="lacks"):
        load_calibration(tmp_path, "hybrid", "abc")
    bad = _doc("hybrid", "abc")
    bad["models"]["both/en"]["scale"] = [0.0] * len(HYBRID_FEATURES)  # type: ignore[index]
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="invalid quality calibration"):
        load_calibration(tmp_path, "hybrid", "abc")


def test_the_default_gate_is_the_calibrations_per_language() -> None:
    doc = {**_doc("hybrid", "h"), "gate": {"both/en": 0.07, "both/cjk": 0.03, "bm25/en": 0.02}}
    model = QualityModel(hybrid=parse_calibration(doc, "hybrid"), rerank=parse_calibration(_doc("rerank", "r"), "rerank"))
    assert model.default_gate(QualitySource.HYBRID_CALIBRATED, cjk=False) == 0.07
    assert model.default_gate(QualitySource.HYBRID_CALIBRATED, cjk=True) == 0.03
    # A single-leg list has its own gate where fitted, else none.
    assert model.default_gate(QualitySource.HYBRID_CALIBRATED, cjk=False, legs="bm25") == 0.02
    assert model.default_gate(QualitySource.HYBRID_CALIBRATED, cjk=True, legs="knn") == 0.0
    assert model.default_gate(QualitySource.RERANKER_PROBABILITY, cjk=False) == 0.0  # none fitted
    assert QualityModel().default_gate(QualitySource.DENSE_DISTANCE, cjk=False) == 0.0
    for bad in ({"both/en": 1.5}, {"both/fr": 0.1}, {"knn/cjk": 0.1}):
        with pytest.raises(ValueError, match="gate"):
            parse_calibration({**_doc("hybrid", "h"), "gate": bad}, "hybrid")


def test_the_default_gate_judges_the_list_by_its_top_a_min_quality_filters_items() -> None:
    doc = {**_doc("hybrid", "h"), "gate": {"both/en": 0.3, "both/cjk": 0.3}}
    model = QualityModel(hybrid=parse_calibration(doc, "hybrid"))
    items = [_candidate(0.1, None, 0.1), _candidate(0.2, None, 0.1), _candidate(0.3, None, 0.1)]
    for c, q in zip(items, (0.5, 0.2, 0.1)):
        c.quality = q
    src = [QualitySource.HYBRID_CALIBRATED] * 3
    assert model.gate(items, src, 0.0, cjk=False) == items  # the top reaches 0.3: the whole list
    assert model.gate(items, src, 0.15, cjk=False) == items[:2]  # an explicit floor filters
    items[0].quality, items[1].quality = 0.29, 0.9
    assert model.gate(items, src, 0.0, cjk=False) == []  # the top is below its gate: nothing here
    assert model.gate(items, [QualitySource.DENSE_DISTANCE] * 3, 0.0, cjk=False) == items  # uncalibrated: no gate
    # What passes the default gate has a level: REFERENCE from the gate, unless configured.
    assert model.reference_threshold(QualitySource.HYBRID_CALIBRATED, False, "both", 0.0) == 0.3
    assert model.reference_threshold(QualitySource.HYBRID_CALIBRATED, False, "bm25", 0.0) == 0.5  # no gate fitted
    assert model.reference_threshold(QualitySource.DENSE_DISTANCE, False, "both", 0.0) == 0.5
    assert model.reference_threshold(QualitySource.HYBRID_CALIBRATED, False, "both", 0.6) == 0.6


def test_judge_reads_on_until_top_k_items_pass_a_min_quality() -> None:
    model = QualityModel(hybrid=parse_calibration(_doc("hybrid", "h"), "hybrid"))
    # dense_cos drives the probability: distances 0.2 (pass 0.5) and 1.2 (fail) alternate.
    pool = [_candidate(0.2 if i % 2 == 0 else 1.2, None, 0.1) for i in range(12)]
    ranked, rest = pool[:3], iter(pool[3:])
    asked: list[int] = []

    def more(n: int) -> list[Candidate]:
        asked.append(n)
        extra = [c for _, c in zip(range(n), rest)]
        ranked.extend(extra)
        return extra

    kw = dict(reranked=False, max_fused=0.1, cjk=False, legs="both", answered_max_fused=0.1)
    sources, gated, first, judged = model.judge(ranked, more, min_quality=0.5, top_k=4, **kw)  # type: ignore[arg-type]
    assert first is None and len(sources) == len(ranked)
    assert ranked[judged] is gated[0]  # under a min_quality, the first item that passes speaks for the list
    assert gated == [c for c in ranked if c.quality >= 0.5] and len(gated) == 4
    assert ranked == pool[: len(ranked)] and len(ranked) < len(pool)  # read on, but not to the end
    assert all(c.quality >= 0.5 for c in gated) and asked[0] == 2  # 2 of 3 passed: asked for the 2 missing
    # Without a min_quality, the top decides and nothing more is read.
    ranked2, asked2 = pool[:3], []
    _, gated2, _, _ = model.judge(ranked2, lambda n: asked2.append(n) or [], min_quality=0.0, top_k=4, **kw)  # type: ignore[arg-type, func-returns-value]
    assert gated2 == pool[:3] and asked2 == []
    # The list runs out before top_k pass: everything that passes, no more asking.
    ranked3 = [pool[1], pool[3]]
    _, gated3, _, _ = model.judge(ranked3, lambda n: [], min_quality=0.5, top_k=4, **kw)  # type: ignore[arg-type]
    assert gated3 == []


def test_a_reranked_list_passes_only_when_the_first_stage_also_finds_something() -> None:
    hybrid = parse_calibration({**_doc("hybrid", "h"), "gate": {"both/en": 0.3, "both/cjk": 0.2}}, "hybrid")
    rerank = parse_calibration({**_doc("rerank", "r"), "gate": {"both/en": 0.1, "both/cjk": 0.1}}, "rerank")
    model = QualityModel(hybrid=hybrid, rerank=rerank)
    items = [_candidate(0.1, 2.0, 0.1, rerank=1.0), _candidate(0.2, 1.0, 0.05, rerank=0.5)]
    src = [QualitySource.RERANKER_PROBABILITY] * 2
    for c in items:
        c.quality = 0.4  # the reranker's calibrated probability: above its gate
    weak = _candidate(distance=math.sqrt(2 * (1 - 0.1)), bm25=None, fused=0.01)  # cosine 0.1
    strong = _candidate(distance=math.sqrt(2 * (1 - 0.9)), bm25=None, fused=0.01)  # cosine 0.9
    q_weak = model.first_stage_quality([weak], max_fused=0.1, cjk=False)
    q_strong = model.first_stage_quality([strong], max_fused=0.1, cjk=False)
    assert q_weak is not None and q_strong is not None and q_weak < 0.3 <= q_strong
    assert weak.quality == 0.0  # judged without being touched
    assert model.gate(items, src, 0.0, cjk=False, first_stage=q_strong) == items
    assert model.gate(items, src, 0.0, cjk=False, first_stage=q_weak) == []  # the legs found nothing
    assert model.gate(items, src, 0.0, cjk=False, first_stage=None) == items  # no hybrid judge: the reranker's alone
    assert model.gate(items, src, 0.2, cjk=False, first_stage=q_weak) == items  # an explicit floor filters items only
    for c in items:
        c.quality = 0.05
    assert model.gate(items, src, 0.0, cjk=False, first_stage=q_strong) == []  # the reranker found nothing
    # A hybrid list (no rerank) is judged by its own gate alone.
    hyb = [QualitySource.HYBRID_CALIBRATED] * 2
    for c in items:
        c.quality = 0.35
    assert model.gate(items, hyb, 0.0, cjk=False, first_stage=q_weak) == items
    assert QualityModel(rerank=rerank).first_stage_quality([strong], max_fused=0.1, cjk=False) is None
    # The first stage's judge reads the fused top (before rerank), not the reranked top.
    assert model.first_stage_quality([weak, strong], max_fused=0.1, cjk=False) == q_weak  # equal fused: the first
    strong.fused_score = 0.05
    assert model.first_stage_quality([weak, strong], max_fused=0.1, cjk=False) == model.first_stage_quality(
        [strong], max_fused=0.1, cjk=False)


def test_a_joint_gate_judges_a_reranked_list_by_both_judges_at_once() -> None:
    """Each judge's own gate was fitted as if it judged alone; the joint gate, fitted on both,
    keeps a list the reranker alone would refuse when the first stage is sure enough, and
    REFERENCE follows it (what passes the default gate has a level)."""
    hybrid_doc = {**_doc("hybrid", "h"), "gate": {"both/en": 0.3, "both/cjk": 0.2}}
    hybrid = parse_calibration(hybrid_doc, "hybrid")
    assert hybrid.fingerprint == fingerprint(hybrid_doc["models"])  # type: ignore[arg-type]
    joint = {"both/en": {"rerank": 0.02, "first_stage": 0.35, "first_stage_calibration": hybrid.fingerprint}}
    rerank = parse_calibration({**_doc("rerank", "r"), "gate": {"both/en": 0.1, "both/cjk": 0.1},
                                "joint_gate": joint}, "rerank")
    model = QualityModel(hybrid=hybrid, rerank=rerank)
    items = [_candidate(0.1, 2.0, 0.1, rerank=-3.0), _candidate(0.2, 1.0, 0.05, rerank=-3.5)]
    src = [QualitySource.RERANKER_PROBABILITY] * 2
    for c in items:
        c.quality = 0.05  # below the reranker's own gate (0.1), above the joint one (0.02)
    assert model.gate(items, src, 0.0, cjk=False, first_stage=0.5) == items
    assert model.gate(items, src, 0.0, cjk=False, first_stage=0.32) == []  # the first stage's own gate passes, not the joint
    assert model.reference_threshold(QualitySource.RERANKER_PROBABILITY, False, "both", 0.0, judged_jointly=True) == 0.02
    assert model.reference_threshold(QualitySource.RERANKER_PROBABILITY, False, "both", 0.0) == 0.1
    for c in items:
        c.quality = 0.01
    assert model.gate(items, src, 0.0, cjk=False, first_stage=0.9) == []  # the reranker found nothing
    # No first-stage judge (an uncalibrated embedder): the reranker's own gate alone.
    assert model.gate(items, src, 0.0, cjk=False, first_stage=None) == []
    # Chinese has no joint gate here: each judge's own gate (reranker 0.1 AND first stage 0.2).
    for c in items:
        c.quality = 0.05
    assert model.gate(items, src, 0.0, cjk=True, first_stage=0.9) == []
    # A re-chosen first-stage gate leaves the scale as it was: the joint gate still applies.
    regated = parse_calibration({**hybrid_doc, "gate": {"both/en": 0.31, "both/cjk": 0.2}}, "hybrid")
    assert QualityModel(hybrid=regated, rerank=rerank).joint_gate(False) == rerank.joint_gates["both/en"]
    # Fitted against another first-stage calibration (a refit): not applied (its scale differs).
    refit = json.loads(json.dumps(hybrid_doc))
    refit["models"]["both/en"]["intercept"] = -1.5
    stale = QualityModel(hybrid=parse_calibration(refit, "hybrid"), rerank=rerank)
    assert stale.joint_gate(False) is None and stale.gate(items, src, 0.0, cjk=False, first_stage=0.5) == []
    assert QualityModel(rerank=rerank).joint_gate(False) is None
    # What the service logs at start: joint gates that do not apply.
    assert stale.stale_joint_gates() and QualityModel(rerank=rerank).stale_joint_gates()
    assert not model.stale_joint_gates() and not QualityModel(hybrid=hybrid).stale_joint_gates()
    assert not QualityModel(hybrid=hybrid, rerank=parse_calibration(_doc("rerank", "r"), "rerank")).stale_joint_gates()


def test_a_joint_gate_of_0_for_the_reranker_gives_what_passes_a_level() -> None:
    """The joint gate's grid includes 0: the first stage's judge alone decides the list. What
    passes still has a level (REFERENCE at 0, not the unfitted fallback of 0.5)."""
    hybrid = parse_calibration({**_doc("hybrid", "h"), "gate": {"both/en": 0.3}}, "hybrid")
    joint = {"both/en": {"rerank": 0.0, "first_stage": 0.35, "first_stage_calibration": hybrid.fingerprint}}
    rerank = parse_calibration({**_doc("rerank", "r"), "gate": {"both/en": 0.1}, "joint_gate": joint}, "rerank")
    model = QualityModel(hybrid=hybrid, rerank=rerank)
    items = [_candidate(0.1, 2.0, 0.1, rerank=-6.0)]
    items[0].quality = 0.003  # far below the reranker's own gate
    src = [QualitySource.RERANKER_PROBABILITY]
    assert model.gate(items, src, 0.0, cjk=False, first_stage=0.5) == items
    assert model.gate(items, src, 0.0, cjk=False, first_stage=0.3) == []
    reference = model.reference_threshold(QualitySource.RERANKER_PROBABILITY, False, "both", 0.0, judged_jointly=True)
    assert reference == 0.0
    assert relevance_level(0.003, 0.9, reference) is RelevanceLevel.REFERENCE
    assert model.reference_threshold(QualitySource.RERANKER_PROBABILITY, False, "both", 0.0) == 0.1  # not read jointly
    assert model.reference_threshold(QualitySource.RERANKER_PROBABILITY, True, "both", 0.0, judged_jointly=True) == 0.5


@pytest.mark.parametrize("joint, why", [
    ({"both/fr": {"rerank": 0.02, "first_stage": 0.3, "first_stage_calibration": "x"}}, "keys of the models"),
    ({"both/en": {"rerank": 1.5, "first_stage": 0.3, "first_stage_calibration": "x"}}, "values in"),
    ({"both/en": {"rerank": 0.02, "first_stage": 0.3}}, "first_stage_calibration"),
])
def test_a_malformed_joint_gate_is_refused(joint: dict[str, object], why: str) -> None:
    with pytest.raises((ValueError, KeyError), match=why):
        parse_calibration({**_doc("rerank", "r"), "joint_gate": joint}, "rerank")
    with pytest.raises(ValueError, match="rerank calibrations only"):
        parse_calibration({**_doc("hybrid", "h"), "joint_gate": {
            "both/en": {"rerank": 0.02, "first_stage": 0.3, "first_stage_calibration": "x"}}}, "hybrid")


def test_the_latin_leg_sets_are_judged_only_where_a_model_was_fitted_for_them() -> None:
    # "all" (BM25, kNN and the Latin-script leg) has its own model and gate where fitted; a
    # calibration fitted before the leg has none, and such lists stay uncalibrated (no gate),
    # never judged by the two-leg model, whose fused-score scale differs.
    doc = {**_doc("hybrid", "h"), "gate": {"both/en": 0.07}}
    older = QualityModel(hybrid=parse_calibration(doc, "hybrid"), rerank=parse_calibration(_doc("rerank", "r"), "rerank"))
    c = _candidate(distance=math.sqrt(2 * (1 - 0.9)), bm25=2.0, fused=0.1, rerank=1.5)
    assert older.assign(c, reranked=False, max_fused=0.2, cjk=False, legs="all") is QualitySource.DENSE_DISTANCE
    assert older.assign(c, reranked=True, max_fused=0.2, cjk=False, legs="all") is QualitySource.RERANKER_PROBABILITY
    assert c.quality == pytest.approx(1 / (1 + math.exp(-1.5)))  # the uncalibrated sigmoid
    assert older.first_stage_quality([c], max_fused=0.2, cjk=False, legs="all") is None
    assert older.default_gate(QualitySource.HYBRID_CALIBRATED, cjk=False, legs="all") == 0.0
    fitted = {**doc, "models": {**doc["models"], "all/en": _logistic(HYBRID_FEATURES, 6.0)},  # type: ignore[dict-item]
              "gate": {"both/en": 0.07, "all/en": 0.09}}
    model = QualityModel(hybrid=parse_calibration(fitted, "hybrid"))
    assert model.assign(c, reranked=False, max_fused=0.2, cjk=False, legs="all") is QualitySource.HYBRID_CALIBRATED
    assert c.quality == pytest.approx(1 / (1 + math.exp(-(-2.0 + 6.0 * 0.9))), rel=1e-6)
    assert model.default_gate(QualitySource.HYBRID_CALIBRATED, cjk=False, legs="all") == 0.09
    # Han-script lists never have the Latin-script leg: no "all/cjk" model, so uncalibrated.
    assert model.assign(c, reranked=False, max_fused=0.2, cjk=True, legs="all") is QualitySource.DENSE_DISTANCE
    # A leg set with no model at all (the Latin-script leg alone): uncalibrated.
    lexical = _candidate(distance=None, bm25=None, fused=0.1)
    assert model.assign(lexical, reranked=False, max_fused=0.2, cjk=False, legs="knn_latin") is QualitySource.RANK_FALLBACK


def test_the_two_leg_view_judges_a_three_leg_list_as_the_two_legs_see_it() -> None:
    # Where the Latin-script leg is served and a calibration has no "all" model (the shipped
    # ones), an item of a three-leg list is judged by the two-leg model on what BM25 and kNN
    # say of it: their ranks fused with the two-leg settings, on the two-leg scale.
    from service.pipeline.fusion import FusionParams
    from service.pipeline.quality import TwoLegView

    view = TwoLegView(FusionParams(rrf_k=10, bm25_weight=0.3, knn_weight=1.0))
    doc = {**_doc("hybrid", "h"), "gate": {"both/en": 0.07}}
    model = QualityModel(hybrid=parse_calibration(doc, "hybrid"), rerank=parse_calibration(_doc("rerank", "r"), "rerank"),
                         two_leg=view)
    c = _candidate(distance=math.sqrt(2 * (1 - 0.9)), bm25=2.0, fused=0.4, rerank=1.5)
    c.bm25_rank, c.knn_rank, c.latin_rank = 3, 1, 1
    pair = 0.3 / 13 + 1.0 / 11
    assert view.fused(c) == pytest.approx(pair) and view.best == pytest.approx(1.3 / 11)
    assert model.assign(c, reranked=False, max_fused=0.5, cjk=False, legs="all") is QualitySource.HYBRID_CALIBRATED
    x = signals(dense_score=0.9, bm25_score=2.0, fused_score=pair, max_fused=1.3 / 11)
    assert c.quality == pytest.approx(model.hybrid.probability(x, False, "both"))  # type: ignore[union-attr]
    assert model.default_gate(QualitySource.HYBRID_CALIBRATED, cjk=False, legs="all") == 0.07
    assert model.assign(c, reranked=True, max_fused=0.5, cjk=False, legs="all") is QualitySource.RERANKER_PROBABILITY
    assert c.quality == pytest.approx(model.rerank.probability(x | {"rerank_logit": 1.5}, False, "both"))  # type: ignore[union-attr]
    # The first stage's judge reads the item the two legs rank best, not the three-leg top.
    only_latin = _candidate(distance=None, bm25=None, fused=0.45)
    only_latin.latin_rank = 1
    assert model.first_stage_quality([only_latin, c], max_fused=0.5, cjk=False, legs="all") == pytest.approx(
        model.hybrid.probability(x, False, "both"))  # type: ignore[union-attr]
    # So do the gate and the list's quality without rerank: the three-leg top (found by the
    # Latin-script leg alone) does not speak for the list, the two legs' best item does.
    ranked = [only_latin, c]
    sources = model.assign_all(ranked, reranked=False, max_fused=0.5, cjk=False, legs="all")
    assert model.judged_index(ranked, sources, cjk=False, legs="all") == 1
    passing = ranked[1].quality >= 0.07
    assert model.gate(ranked, sources, 0.0, cjk=False, legs="all") == (ranked if passing else [])
    judgement = model.judge(list(ranked), lambda n: [], reranked=False, max_fused=0.5, cjk=False, legs="all",
                            answered_max_fused=0.5, min_quality=0.0, top_k=2)
    assert judgement.judged == 1 and judgement.first_stage is None
    # Reranked, the reranker's top speaks for the list (the first stage's judge is separate).
    only_latin.rerank_score = 2.0
    sources = model.assign_all(ranked, reranked=True, max_fused=0.5, cjk=False, legs="all")
    assert model.judged_index(ranked, sources, cjk=False, legs="all") == 0
    # A two-leg list is judged by its top, whatever the fused scores say.
    two = [_candidate(distance=1.0, bm25=1.0, fused=0.1), c]
    two_sources = model.assign_all(two, reranked=False, max_fused=0.5, cjk=False, legs="both")
    assert model.judged_index(two, two_sources, cjk=False, legs="both") == 0
    # An "all" model, where a calibration has one, judges instead.
    fitted = {**doc, "models": {**doc["models"], "all/en": _logistic(HYBRID_FEATURES, 6.0)}}  # type: ignore[dict-item]
    own = QualityModel(hybrid=parse_calibration(fitted, "hybrid"), two_leg=view)
    own.assign(c, reranked=False, max_fused=0.5, cjk=False, legs="all", answered_max_fused=0.5)
    assert c.quality == pytest.approx(1 / (1 + math.exp(-(-2.0 + 6.0 * 0.9))), rel=1e-6)
