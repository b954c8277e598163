"""The calibration fit: recovers a known logistic model, reports a small ECE, writes files."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from service.eval.calibration import ece, fit, fit_logistic, load_rows, main
from service.pipeline.quality import HYBRID_FEATURES, parse_calibration
from service.script import has_han


def test_fit_logistic_recovers_coefficients() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20000, 2))
    p = 1 / (1 + np.exp(-(0.5 + 2.0 * x[:, 0] - 1.0 * x[:, 1])))
    y = (rng.random(20000) < p).astype(np.float64)
    model = fit_logistic(x, y, ("a", "b"), l2=0.0)
    coef = np.array(model.coef) / np.array(model.scale)
    assert np.allclose(coef, [2.0, -1.0], atol=0.1)
    probs = np.array([model.probability({"a": r[0], "b": r[1]}) for r in x])
    assert ece(probs, y)[0] < 0.02


def test_ece_of_a_miscalibrated_predictor() -> None:
    y = np.array([1.0, 0.0] * 500)
    assert ece(np.full(1000, 0.5), y)[0] < 1e-9
    assert abs(ece(np.full(1000, 0.9), y)[0] - 0.4) < 1e-9


def _dump(path: Path, n: int, seed: int) -> None:
    """Item dumps shaped like ``service eval`` writes: relevant items have higher cosine."""
    rng = random.Random(seed)
    data = {}
    for q in range(n):
        items = []
        for i in range(8):
            rel = i == 0 and rng.random() < 0.6
            cos = 0.8 + (0.08 if rel else 0.0) + rng.gauss(0, 0.03)
            items.append([f"d{q}-{i}", rng.uniform(0, 20), cos, 1 / (10 + i + 1), 2.0 * (cos - 0.8) / 0.08 - 1, 0.0])
        data[f"q{q}"] = {"query": "english question" if q % 2 else "中文问题", "max_fused": 1.3 / 11, "rrf_k": 10,
                         "degraded": False,
                         "relevant": [f"d{q}-0"] if items[0][2] > 0.84 else [], "items": items}
    path.write_text(json.dumps(data, ensure_ascii=False))


def test_fit_writes_calibrations_and_report(tmp_path: Path) -> None:
    _dump(tmp_path / "train.json", 800, 0)
    _dump(tmp_path / "valid.json", 400, 1)
    report = fit([tmp_path / "train.json"], [tmp_path / "valid.json"], hybrid_sha="h" * 64, rerank_sha="r" * 64,
                 out=tmp_path / "out", top=3)
    for kind in ("hybrid", "rerank"):
        cal = parse_calibration(json.loads((tmp_path / "out" / f"{kind}.json").read_text()), kind)
        assert cal.onnx_sha256 == (kind[0] * 64)
        for key in ("both/en", "both/cjk"):
            res = report["sources"][kind][key]
            assert res["ece_top1"] < 0.1 and res["valid_rows"] > 0
    # One model per leg set and language for both sources (a single-leg list has no cosine
    # or no BM25 score: the two-leg model would read a missing signal as a bad one).
    keys = {f"{legs}/{lang}" for legs in ("both", "bm25", "knn") for lang in ("en", "cjk")}
    assert set(report["sources"]["hybrid"]) == keys and set(report["sources"]["rerank"]) == keys
    hybrid = parse_calibration(json.loads((tmp_path / "out" / "hybrid.json").read_text()), "hybrid")
    x = dict.fromkeys(HYBRID_FEATURES, 0.0) | {"has_dense": 1.0, "has_bm25": 1.0, "fused_rel": 1.0}
    assert hybrid.probability(x | {"dense_cos": 0.9}, False) > hybrid.probability(x | {"dense_cos": 0.75}, False)
    assert not math.isnan(hybrid.probability(x, True))
    assert (tmp_path / "out" / "reliability.png").stat().st_size > 1000


def _off_domain_dump(path: Path, n: int, seed: int) -> None:
    """Off-domain questions: nothing stands out (flat, low cosines), nothing is relevant."""
    rng = random.Random(seed)
    data = {}
    for q in range(n):
        items = [[f"o{q}-{i}", rng.uniform(0, 5), 0.78 + rng.gauss(0, 0.005), 1 / (10 + i + 1),
                  rng.gauss(-2, 0.5), 0.0] for i in range(12)]
        data[f"off{q}"] = {"query": "off topic" if q % 2 else "无关问题", "max_fused": 1.3 / 11, "rrf_k": 10,
                           "degraded": False, "relevant": [], "items": items}
    path.write_text(json.dumps(data, ensure_ascii=False))


def test_off_domain_negatives_give_each_language_a_gate(tmp_path: Path) -> None:
    _dump(tmp_path / "train.json", 800, 0)
    _dump(tmp_path / "valid.json", 400, 1)
    _off_domain_dump(tmp_path / "off.json", 300, 2)
    report = fit([tmp_path / "train.json"], [tmp_path / "valid.json"], hybrid_sha="h" * 64, rerank_sha="r" * 64,
                 out=tmp_path / "out", top=3, off_domain=[tmp_path / "off.json"])
    for kind in ("hybrid", "rerank"):
        doc = json.loads((tmp_path / "out" / f"{kind}.json").read_text())
        cal = parse_calibration(doc, kind)
        keys = {f"{legs}/{lang}" for legs in ("both", "knn") for lang in ("en", "cjk")}  # none for BM25 alone
        assert set(cal.gates) == keys and all(0 < g < 1 for g in cal.gates.values())
        for lang, rows in report["gate"][kind].items():
            at_gate = next(r for r in rows if r["min_quality"] >= cal.gates[f"both/{lang}"])
            # Separable here: the chosen gate keeps the answers and refuses the off-domain.
            assert at_gate["answerable_kept"] >= 0.9 and at_gate["off_domain_refused"] >= 0.9, (kind, lang, rows)
    # Serving's rule for a reranked list (both judges: the reranker's gate and the first
    # stage's), measured at the fitted gates on the same lists.
    both = report["gate"]["rerank_with_first_stage"]
    for lang in ("en", "cjk"):
        rows = report["gate"]["rerank"][lang]
        alone = next(r for r in rows if r["min_quality"] >= parse_calibration(
            json.loads((tmp_path / "out" / "rerank.json").read_text()), "rerank").gates[f"both/{lang}"])
        assert both[lang]["off_domain_refused"] >= alone["off_domain_refused"] - 1e-9  # a second judge only refuses more
        assert 0.8 <= both[lang]["answerable_kept"] <= 1.0 and both[lang]["off_domain_refused"] >= 0.9, both
    # Without off-domain questions there is nothing to choose a gate from.
    fit([tmp_path / "train.json"], [tmp_path / "valid.json"], hybrid_sha="h" * 64, rerank_sha="", out=tmp_path / "o2")
    assert "gate" not in json.loads((tmp_path / "o2" / "hybrid.json").read_text())


def test_the_gates_command_measures_the_serving_rule_at_shipped_gates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _dump(tmp_path / "train.json", 800, 0)
    _dump(tmp_path / "valid.json", 400, 1)
    _off_domain_dump(tmp_path / "off.json", 300, 2)
    report = fit([tmp_path / "train.json"], [tmp_path / "valid.json"], hybrid_sha="h" * 64, rerank_sha="r" * 64,
                 out=tmp_path / "out", top=3, off_domain=[tmp_path / "off.json"])
    assert main(["gates", "--valid", str(tmp_path / "valid.json"), "--off-domain", str(tmp_path / "off.json"),
                 "--hybrid", str(tmp_path / "out" / "hybrid.json"), "--rerank", str(tmp_path / "out" / "rerank.json")]) == 0
    rates = json.loads(capsys.readouterr().out)
    assert rates == report["gate"]["rerank_with_first_stage"]
    assert rates["en"]["off_domain"] == 150 and rates["en"]["answerable"] > 0


def test_the_joint_gate_keeps_what_each_judge_alone_would_refuse(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``joint-gate`` picks both thresholds at once on the lists' two judges, keeps at least
    as many answerable questions as each judge's own gate at no fewer off-domain refused, and
    --write adds it to the rerank calibration, which serving then reads (fingerprint included)."""
    _dump(tmp_path / "train.json", 800, 0)
    _dump(tmp_path / "valid.json", 400, 1)
    _off_domain_dump(tmp_path / "off.json", 300, 2)
    fit([tmp_path / "train.json"], [tmp_path / "valid.json"], hybrid_sha="h" * 64, rerank_sha="r" * 64,
        out=tmp_path / "out", top=3, off_domain=[tmp_path / "off.json"])
    hybrid, rerank = tmp_path / "out" / "hybrid.json", tmp_path / "out" / "rerank.json"
    args = ["joint-gate", "--valid", str(tmp_path / "valid.json"), "--off-domain", str(tmp_path / "off.json"),
            "--hybrid", str(hybrid), "--rerank", str(rerank)]
    assert main(args) == 0
    chosen = json.loads(capsys.readouterr().out)
    assert "joint_gate" not in json.loads(rerank.read_text())  # without --write, nothing written
    for lang in ("en", "cjk"):
        g, own = chosen[lang], chosen[lang]["each_judge_own_gate"]
        assert min(g["answerable_kept"], g["off_domain_refused"]) >= min(own["answerable_kept"],
                                                                         own["off_domain_refused"])
    assert main([*args, "--write"]) == 0
    capsys.readouterr()
    assert main(args) == 0  # chosen again over the written one: "before" is each judge's own gate still
    assert json.loads(capsys.readouterr().out) == chosen
    h, r = (json.loads(p.read_text()) for p in (hybrid, rerank))
    cal = parse_calibration(r, "rerank")
    assert set(cal.joint_gates) == {"both/en", "both/cjk"}
    assert cal.joint_gates["both/en"].rerank == chosen["en"]["rerank"]
    # Serving's rule now reads the joint gate: the gates command measures it on the same lists.
    assert main(["gates", "--valid", str(tmp_path / "valid.json"), "--off-domain", str(tmp_path / "off.json"),
                 "--hybrid", str(hybrid), "--rerank", str(rerank)]) == 0
    served = json.loads(capsys.readouterr().out)
    for lang in ("en", "cjk"):
        assert served[lang]["answerable_kept"] == chosen[lang]["answerable_kept"]
        assert served[lang]["off_domain_refused"] == chosen[lang]["off_domain_refused"]
    # Another first-stage calibration (a refit) puts its quality on another scale: the joint
    # gate no longer applies and serving's rule is each judge's own gate again.
    h["models"]["both/en"]["intercept"] += 0.5
    hybrid.write_text(json.dumps(h))
    assert main(["gates", "--valid", str(tmp_path / "valid.json"), "--off-domain", str(tmp_path / "off.json"),
                 "--hybrid", str(hybrid), "--rerank", str(rerank)]) == 0
    assert json.loads(capsys.readouterr().out)["cjk"]["answerable_kept"] == chosen["cjk"]["each_judge_own_gate"][
        "answerable_kept"]


def test_rechoose_gates_keeps_the_models_and_moves_a_gate_only_on_a_clear_gain(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    _dump(tmp_path / "train.json", 800, 0)
    _dump(tmp_path / "valid.json", 400, 1)
    _off_domain_dump(tmp_path / "off.json", 300, 2)
    fit([tmp_path / "train.json"], [tmp_path / "valid.json"], hybrid_sha="h" * 64, rerank_sha="r" * 64,
        out=tmp_path / "out", top=3, off_domain=[tmp_path / "off.json"])
    path = tmp_path / "out" / "hybrid.json"
    fitted = json.loads(path.read_text())
    args = ["rechoose-gates", "--valid", str(tmp_path / "valid.json"), "--off-domain", str(tmp_path / "off.json"),
            "--calibration", str(path)]
    assert main(args) == 0
    same = json.loads(capsys.readouterr().out)
    assert {k: r["chosen"] for k, r in same.items()} == fitted["gate"]  # the same dumps, the same rule
    assert all(r["gate"] == r["shipped"] for r in same.values())
    # A shipped gate far off its balance point moves (kNN alone: 0.5 keeps too few answers);
    # one the new gate does no better than stays (both legs separate perfectly here at 0.5
    # too); with every off-domain question asked of an English corpus, the Chinese gates
    # have nothing to be chosen on and stay; the models are never touched.
    data = json.loads((tmp_path / "off.json").read_text())
    for record in data.values():
        record["corpus_lang"] = "en"
    (tmp_path / "off.json").write_text(json.dumps(data, ensure_ascii=False))
    path.write_text(json.dumps({**fitted, "gate": {k: 0.5 for k in fitted["gate"]}}))
    assert main([*args, "--write"]) == 0
    moved = json.loads(capsys.readouterr().out)
    written = json.loads(path.read_text())
    assert written["models"] == fitted["models"] and "both/cjk" not in moved
    assert moved["knn/en"]["gain_se"] > 2 and written["gate"]["knn/en"] == moved["knn/en"]["chosen"]
    assert moved["knn/en"]["chosen"] < 0.5
    assert moved["both/en"]["gain_se"] <= 2 and written["gate"]["both/en"] == 0.5
    assert written["gate"]["both/cjk"] == written["gate"]["knn/cjk"] == 0.5


def test_gates_are_chosen_on_questions_asked_of_a_corpus_of_their_own_language(tmp_path: Path) -> None:
    """An off-domain question against a corpus of the other language is refused trivially:
    the gate fit leaves it out (dumps record ``corpus_lang``; older ones count every list)."""
    _off_domain_dump(tmp_path / "off.json", 300, 2)
    data = json.loads((tmp_path / "off.json").read_text())
    for record in data.values():
        record["corpus_lang"] = "en"
    (tmp_path / "off-en.json").write_text(json.dumps(data, ensure_ascii=False))
    everything = load_rows([tmp_path / "off.json"], "hybrid", 1)
    own = load_rows([tmp_path / "off-en.json"], "hybrid", 1, same_language_only=True)
    assert len(everything["en"]) == len(own["en"]) == 150 and len(everything["cjk"]) == 150
    assert own["cjk"] == []  # Chinese questions asked of an English corpus
    assert len(load_rows([tmp_path / "off-en.json"], "hybrid", 1)["cjk"]) == 150  # the fit itself reads them


def _with_legs(path: Path, legs: list[str], max_fused: float) -> None:
    """Mark every Latin-script list of a dump as answered by ``legs`` (what runs with the
    Latin-script leg record); Han-script lists keep BM25 and kNN, as served."""
    data = json.loads(path.read_text())
    for record in data.values():
        if not has_han(record["query"]):
            record["legs_ok"], record["max_fused"] = legs, max_fused
        else:
            record["legs_ok"] = ["BM25", "KNN"]
    path.write_text(json.dumps(data, ensure_ascii=False))


def test_the_latin_leg_set_is_fitted_from_its_own_runs_and_merged_into_the_shipped_one(tmp_path: Path) -> None:
    for name, n, seed in (("train", 800, 0), ("valid", 400, 1)):
        _dump(tmp_path / f"{name}.json", n, seed)
    _off_domain_dump(tmp_path / "off.json", 300, 2)
    two = [tmp_path / f"{n}.json" for n in ("train", "valid", "off")]
    fit(two[:1], two[1:2], hybrid_sha="h" * 64, rerank_sha="r" * 64, out=tmp_path / "shipped", off_domain=two[2:])
    shipped = {k: json.loads((tmp_path / "shipped" / f"{k}.json").read_text()) for k in ("hybrid", "rerank")}
    three = []
    for path in two:  # the same lists as if the Latin-script leg had answered in them
        target = tmp_path / f"latin-{path.name}"
        target.write_text(path.read_text())
        _with_legs(target, ["BM25", "KNN", "KNN_LATIN"], 3.3 / 11)
        three.append(target)
    # Two-leg English models are never fitted from three-leg lists (and the other way round).
    with pytest.raises(ValueError, match="no en train rows"):
        fit(three[:1], three[1:2], hybrid_sha="h" * 64, rerank_sha="", out=tmp_path / "wrong")
    report = fit(three[:1], three[1:2], hybrid_sha="h" * 64, rerank_sha="r" * 64, out=tmp_path / "merged",
                 off_domain=three[2:], leg_sets=["all"], merge=shipped)
    for kind in ("hybrid", "rerank"):
        doc = json.loads((tmp_path / "merged" / f"{kind}.json").read_text())
        cal = parse_calibration(doc, kind)
        assert set(report["sources"][kind]) == {"all/en"}  # Han-script lists never run the leg
        assert {k: v for k, v in doc["models"].items() if k != "all/en"} == shipped[kind]["models"]
        assert {k: v for k, v in cal.gates.items() if k != "all/en"} == shipped[kind]["gate"]
        assert 0 < cal.gates["all/en"] < 1 and cal.covers(False, "all") and not cal.covers(True, "all")
    with pytest.raises(ValueError, match="another model"):
        fit(three[:1], three[1:2], hybrid_sha="x" * 64, rerank_sha="", out=tmp_path / "o3", leg_sets=["all"],
            merge=shipped)
