"""The head-order fit (service/eval/head_order_fit.py) and the gate it feeds (service/eval/gate.py)."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest

from service.app import GATE_FILE
from service.config import Config
from service.eval.datasets import Judged
from service.eval.gate import update_gate
from service.eval.head_order_fit import load_heads, main, mean_ndcg
from service.eval.runner import EvalSettings, ModeResult, _write_gate
from service.pipeline.head_order import ORDER_FILE, HeadOrder, order_sha256, read_order


def _dump(path: Path, n: int, seed: int, bm25_knows: bool, latin_knows: bool = False) -> Path:
    """A hybrid+rerank item dump shaped like runner.py's: the reranker is noisy, BM25 (when
    ``bm25_knows``) scores the relevant item high, the fused score is uninformative; with
    ``latin_knows`` rows carry a Latin-script cosine that does."""
    rng = random.Random(seed)
    records: dict[str, Any] = {}
    for q in range(n):
        rows = []
        rel = rng.randrange(20)
        for i in range(20):
            hit = i == rel
            bm25 = (12.0 if hit else rng.uniform(0, 10)) if bm25_knows else rng.uniform(0, 10)
            rows.append([f"q{q}-d{i}", None if (not hit and rng.random() < 0.3) else bm25, rng.uniform(0.7, 0.9),
                         0.05 - i * 0.001, rng.gauss(2.0 if hit else 0.0, 2.0), 0.1])
            if latin_knows:
                rows[-1].append(0.95 if hit else rng.uniform(0.6, 0.9))
        records[f"q{q}"] = {"degraded": False, "relevant": [f"q{q}-d{rel}"], "items": rows}
    records["degraded"] = {"degraded": True, "relevant": ["x"], "items": [["x", 1, 1, 1, 1, 1]] * 3}
    path.write_text(json.dumps(records))
    return path


def test_fit_finds_an_informative_leg_and_ships_a_loadable_order(tmp_path: Path) -> None:
    en = _dump(tmp_path / "en.json", 150, 1, bm25_knows=True)
    zh = _dump(tmp_path / "zh.json", 150, 2, bm25_knows=False)
    assert len(load_heads(en)) == 150  # the degraded query is left out
    out = tmp_path / "order" / ORDER_FILE
    assert main(["fit", "--train-en", str(en), "--train-zh", str(zh), "--start-alpha", "0.7", "--out", str(out)]) == 0
    order = read_order(out.parent)
    assert order is not None and order.weights["latin"].get("bm25", 0.0) > 0
    doc = json.loads(out.read_text())
    fitted = doc["fitted_on"]["latin"]
    assert fitted["ndcg@10_fitted"] > fitted["ndcg@10_alpha_0.7"]
    # Held-out questions from the same process gain too (it is not memorising the train ones).
    held = load_heads(_dump(tmp_path / "en-valid.json", 150, 9, bm25_knows=True))
    assert mean_ndcg(held, order, cjk=False) > mean_ndcg(held, HeadOrder.from_alpha(0.7), cjk=False) + 0.05


def test_a_partial_refit_keeps_the_other_scripts_weights(tmp_path: Path) -> None:
    # A first stage that changed for one script (the Latin-script leg) re-fits that script
    # from the shipped order; the other keeps its weights and its record.
    shipped = tmp_path / "shipped" / ORDER_FILE
    shipped.parent.mkdir()
    cjk = {"rerank": 1.5, "fused": 0.3, "bm25": 0.4, "dense": 0.05}
    shipped.write_text(HeadOrder.from_weights({"latin": {"rerank": 1.1, "fused": 0.3}, "cjk": cjk}).to_json(
        fitted_on={"cjk": {"queries": 1000, "ndcg@10_fitted": 0.32}}))
    en = _dump(tmp_path / "en.json", 150, 3, bm25_knows=False, latin_knows=True)
    out = tmp_path / "order" / ORDER_FILE
    assert main(["fit", "--train-en", str(en), "--start-order", str(shipped), "--scripts", "latin", "--out", str(out)]) == 0
    order = read_order(out.parent)
    assert order is not None and dict(order.weights["cjk"]) == cjk
    assert order.weights["latin"].get("latin_dense", 0.0) > 0
    doc = json.loads(out.read_text())
    assert doc["fitted_on"]["cjk"] == {"queries": 1000, "ndcg@10_fitted": 0.32}
    latin = doc["fitted_on"]["latin"]
    assert latin["ndcg@10_fitted"] > latin["ndcg@10_start_order"]
    # Fitting one script without saying what the other keeps is refused.
    with pytest.raises(SystemExit):
        main(["fit", "--train-en", str(en), "--scripts", "latin", "--out", str(out)])
    with pytest.raises(SystemExit):
        main(["fit", "--start-order", str(shipped), "--scripts", "latin", "--out", str(out)])


def _model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "reranker"
    d.mkdir()
    for name in ("model.onnx", "tokenizer.json"):
        (d / name).write_text("")
    (d / "manifest.json").write_text(json.dumps({"kind": "cross-encoder", "onnx_sha256": "ab" * 32}))
    return d


def _sweep(values: dict[str, float]) -> dict[str, dict[str, float]]:
    return {a: {"ndcg@10": v} for a, v in values.items()}


def test_gate_records_the_served_order(tmp_path: Path) -> None:
    d = _model_dir(tmp_path)
    kw: dict[str, Any] = {"full_split": False, "full_corpus": True, "queries": 500, "documents": 27413, "embedder": "int8"}
    # Without an order file: the best alpha of the sweeps decides.
    update_gate(d, "en", 0.40, _sweep({"0.5": 0.42, "0.7": 0.44}), **kw)
    gate = update_gate(d, "zh", 0.27, _sweep({"0.5": 0.29, "0.7": 0.28}), **kw)
    assert gate["alpha"] == 0.7 and gate["head_order_sha256"] is None and gate["passed"]
    # With one: each language's hybrid_rerank is the served run's, and the file is named.
    (d / ORDER_FILE).write_text(HeadOrder.from_weights({"latin": {"rerank": 1.0}, "cjk": {"rerank": 1.0}}).to_json())
    sha = order_sha256(d)
    assert sha is not None
    gate = update_gate(d, "en", 0.40, _sweep({"0.7": 0.44}), head_order=(sha, 0.455), **kw)
    assert set(gate["languages"]) == {"en"}  # measured with another order before: started over
    assert gate["languages"]["en"]["hybrid_rerank"] == 0.455 and not gate["passed"]  # zh missing
    gate = update_gate(d, "zh", 0.27, _sweep({"0.7": 0.28}), head_order=(sha, 0.265), **kw)
    assert gate["head_order_sha256"] == sha and not gate["passed"] and "valid zh" in gate["reason"]
    gate = update_gate(d, "zh", 0.27, _sweep({"0.7": 0.28}), head_order=(sha, 0.291), **kw)
    assert gate["passed"] and json.loads((d / GATE_FILE).read_text())["languages"]["zh"]["gain"] == 0.021


@pytest.mark.parametrize(("key", "first", "other"), [("rerank_top_n", 20, 40), ("passage_tokens", 128, 192)])
def test_gate_records_how_the_server_reranked_and_starts_over_at_another(tmp_path: Path, key: str, first: int,
                                                                        other: int) -> None:
    """The depth and the passage cap the server reranked at: a run at another starts over."""
    d = _model_dir(tmp_path)
    kw: dict[str, Any] = {"full_split": False, "full_corpus": True, "queries": 500, "documents": 27413, "embedder": "int8"}
    update_gate(d, "en", 0.40, _sweep({"0.7": 0.44}), **{key: first}, **kw)
    gate = update_gate(d, "zh", 0.27, _sweep({"0.7": 0.29}), **{key: first}, **kw)
    assert gate[key] == first and gate["passed"]
    gate = update_gate(d, "en", 0.40, _sweep({"0.7": 0.45}), **{key: other}, **kw)
    assert gate[key] == other and set(gate["languages"]) == {"en"} and not gate["passed"]
    # A gate from before the key (measured at the then default) is not a measurement at another.
    legacy = {k: v for k, v in gate.items() if k != key}
    (d / GATE_FILE).write_text(json.dumps(legacy))
    gate = update_gate(d, "zh", 0.27, _sweep({"0.7": 0.29}), **{key: other}, **kw)
    assert set(gate["languages"]) == {"zh"}


def _gate_of_a_run(d: Path, tmp_path: Path, served: Config | None = None) -> dict[str, Any]:
    """``service eval --gate``'s gate for a run whose server ran ``served``."""
    settings = EvalSettings(out=tmp_path / "out", reranker=str(d), lang="en", gate=True, rerank_alpha=0.7)
    results = [ModeResult("int8", "hybrid", "ok", metrics={"ndcg@10": 0.40}),
               ModeResult("int8", "hybrid+rerank", "ok", metrics={"ndcg@10": 0.44}, alpha_sweep=_sweep({"0.7": 0.44}))]
    judged = Judged(name="t", corpus={"a": "x"}, queries={"q": "y"}, qrels={"q": {"a"}})
    return _write_gate(settings, results, judged, served)


def test_the_gate_records_the_depth_the_eval_server_served(tmp_path: Path) -> None:
    """``service eval --gate`` writes the depth of the config its server ran (the config's
    default unless --rerank-top-n), not one read again from the environment afterwards."""
    d = _model_dir(tmp_path)
    assert _gate_of_a_run(d, tmp_path, dataclasses.replace(Config(), rerank_top_n=37))["rerank_top_n"] == 37
    assert _gate_of_a_run(d, tmp_path)["rerank_top_n"] == Config().rerank_top_n  # none given: the default


def test_the_gate_records_the_passage_cap_the_eval_server_read(tmp_path: Path) -> None:
    """A split reranker's gate names the passage cap its server read (``rerank_passage_tokens``,
    0 = the trained cap, ``rerank_max_length`` bounding both); a joint one has none."""
    d = _model_dir(tmp_path)
    assert "passage_tokens" not in _gate_of_a_run(d, tmp_path, Config())
    manifest = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**manifest, "max_length": 192, "passage_max_tokens": 192}))
    assert _gate_of_a_run(d, tmp_path, Config())["passage_tokens"] == 192
    assert _gate_of_a_run(d, tmp_path, dataclasses.replace(Config(), rerank_passage_tokens=128))["passage_tokens"] == 128
    assert _gate_of_a_run(d, tmp_path, dataclasses.replace(Config(), rerank_max_length=160))["passage_tokens"] == 160


def test_compare_pairs_two_runs_on_their_common_questions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Two runs of the same questions: "new" puts the judged answer first in q0 and q1, "base"
    # only in q0; a question only one run asked is left out of the pairing.
    def run(path: Path, first: dict[str, bool], extra: str = "") -> Path:
        records: dict[str, Any] = {}
        for q, hit_first in first.items():
            ids = [f"{q}-a", f"{q}-b", f"{q}-c"] if hit_first else [f"{q}-b", f"{q}-c", f"{q}-a"]
            records[q] = {"degraded": False, "relevant": [f"{q}-a"], "items": [[i, 1.0, 0.8, 0.01, None, 0.1] for i in ids]}
        if extra:
            records[extra] = {"degraded": False, "relevant": ["z"], "items": [["z", 1, 1, 1, None, 1]]}
        path.write_text(json.dumps(records))
        return path

    base = run(tmp_path / "base.json", {"q0": True, "q1": False}, extra="only-base")
    new = run(tmp_path / "new.json", {"q0": True, "q1": True})
    assert main(["compare", "--base", str(base), "--new", str(new)]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (r["questions"], r["only_base"], r["only_new"]) == (2, 1, 0)
    assert r["new"] == 1.0 and r["base"] == pytest.approx((1.0 + 0.5) / 2, abs=1e-4)  # 1/log2(4) at rank 3
    assert r["diff"] == pytest.approx(0.25, abs=1e-4) and r["ci_low"] <= r["diff"] <= r["ci_high"]
    with pytest.raises(SystemExit, match="share no question"):
        main(["compare", "--base", str(run(tmp_path / "other.json", {"x9": True})), "--new", str(new)])


def test_compare_alpha_pairs_the_rerankers_own_orders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Both runs served the same lists; only "new"'s reranker put the judged answer first.
    # As served they tie; re-ordered by the logit alone (--alpha 1.0) "new" wins every question.
    def run(path: Path, answer_logit: float) -> Path:
        records = {f"q{q}": {"degraded": False, "relevant": [f"q{q}-a"],
                             "items": [[f"q{q}-{d}", 1.0, 0.8, fused, logit, 0.1]
                                       for d, fused, logit in (("b", 0.03, 1.0), ("c", 0.02, 0.5),
                                                               ("a", 0.01, answer_logit))]}
                   for q in range(3)}
        path.write_text(json.dumps(records))
        return path

    base, new = run(tmp_path / "base.json", -1.0), run(tmp_path / "new.json", 3.0)
    assert main(["compare", "--base", str(base), "--new", str(new)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["diff"] == 0.0
    assert main(["compare", "--alpha", "1.0", "--base", str(base), "--new", str(new)]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["questions"] == 3 and r["new"] == 1.0 and r["base"] == pytest.approx(0.5, abs=1e-4)


def test_depth_reads_a_deep_runs_heads_as_a_shallower_head(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One run at a deep rerank_top_n answers shallower depths: each head cut to its best by
    # fused score. Here the relevant item sits at fused rank 15 of 20 in every question, so a
    # head of 10 never holds it and a head of 20 (the reranker knows it) puts it first.
    records = {}
    for q in range(30):
        rows = [[f"q{q}-d{i}", 1.0, 0.8, 0.05 - i * 0.001, 5.0 if i == 15 else 0.0, 0.1] for i in range(20)]
        rows.reverse()  # the dump's order is the served one, not the fused one
        records[f"q{q}"] = {"degraded": False, "relevant": [f"q{q}-d15"], "items": rows}
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(records))
    assert [len(h.ids) for h in load_heads(path, 10)] == [10] * 30
    assert all(f"q{i}-d15" not in h.ids for i, h in enumerate(load_heads(path, 10)))
    assert mean_ndcg(load_heads(path, 10), HeadOrder.from_alpha(1.0), cjk=False) == 0.0
    assert mean_ndcg(load_heads(path, 20), HeadOrder.from_alpha(1.0), cjk=False) == pytest.approx(1.0)
    assert main(["score", "--alpha", "1.0", "--depth", "10", "--items", str(path)]) == 0
    assert "nDCG@10 0.0000" in capsys.readouterr().out
    out = tmp_path / ORDER_FILE
    assert main(["fit", "--train-en", str(path), "--train-zh", str(path), "--depth", "12", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["fitted_on"]["latin"]["depth"] == 12
    with pytest.raises(SystemExit):  # nDCG@10 needs the top 10 reranked
        main(["score", "--alpha", "1.0", "--depth", "5", "--items", str(path)])
