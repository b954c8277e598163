"""The split cross-encoder (builder/split_graph.py) and its runner, on tiny random weights.

The graph's defining property: with the cross-segment attention shut (bias -1e4) and the
head at ``w = 1, b = 0`` it IS the bi-encoder, i.e. its logit equals the dot product of the
mean-pooled, L2-normalised embeddings that the embedding graph (same writer, same layers)
gives the query and the passage on their own. Opening the cross attention must change that.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from service.offline.builder.bert_graph import GraphOptions, build_bert_graph
from service.offline.builder.q4bin import BertConfig
from service.offline.builder.tiny_cross_encoder import _random_weights, build_tiny_split_cross_encoder
from service.models.manifest import TOKENIZER_FILE, read_manifest
from service.models.onnx_cross_encoder import OnnxCrossEncoder
from tests.support.rerank_pairs import SPLIT_PAIRS as PAIRS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer_json(e5_fp32_dir: Path) -> Path:
    return e5_fp32_dir / TOKENIZER_FILE


def _split_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: Path, **kw: float) -> Path:
    return build_tiny_split_cross_encoder(tmp_path_factory.mktemp("split"), tokenizer_json, lower=1, upper=1, **kw)  # type: ignore[arg-type]


def _split(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: Path, **kw: float) -> OnnxCrossEncoder:
    return OnnxCrossEncoder(_split_dir(tmp_path_factory, tokenizer_json, **kw))


def test_closed_cross_attention_is_the_bi_encoder(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: Path) -> None:
    model_dir = _split_dir(tmp_path_factory, tokenizer_json, cross_bias=-1e4, head_scale=1.0)
    ce = OnnxCrossEncoder(model_dir)
    enc = ce.tokenize(PAIRS)
    logits = ce.infer(enc)

    manifest = read_manifest(model_dir, "cross-encoder")
    cfg = BertConfig(**manifest["config"])
    weights = _random_weights(cfg, np.random.default_rng(0))
    embed = build_bert_graph(cfg, weights, GraphOptions(head="mean_l2"), "tiny-bi")
    sess = ort.InferenceSession(embed.SerializeToString(), providers=["CPUExecutionProvider"])

    def emb(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return np.asarray(sess.run(None, {"input_ids": ids, "attention_mask": mask})[0])

    q = emb(enc.extra["query_ids"], enc.extra["query_mask"])
    p = emb(enc.input_ids, enc.attention_mask)
    np.testing.assert_allclose(logits, (q * p).sum(1), atol=1e-5)


def test_open_cross_attention_changes_scores(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: Path) -> None:
    closed = _split(tmp_path_factory, tokenizer_json, cross_bias=-1e4)
    opened = _split(tmp_path_factory, tokenizer_json, cross_bias=0.0)
    a, b = closed.infer(closed.tokenize(PAIRS)), opened.infer(opened.tokenize(PAIRS))
    assert np.isfinite(b).all() and np.abs(a - b).max() > 1e-3


def test_layout_prefixes_and_caps(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: Path) -> None:
    ce = _split(tmp_path_factory, tokenizer_json)
    enc = ce.tokenize(PAIRS)
    qids, qmask = enc.extra["query_ids"], enc.extra["query_mask"]
    # <s> "query:" tokens ... </s>, exactly like the trainer's ``assemble``.
    tok = ce._tokenizer
    prefix = tok.encode("query:", add_special_tokens=False).ids
    row = qids[0][: int(qmask[0].sum())].tolist()
    assert row[0] == 0 and row[-1] == 2 and row[1 : 1 + len(prefix)] == prefix
    assert row[1 + len(prefix) : -1] == tok.encode(PAIRS[0][0], add_special_tokens=False).ids
    # Long inputs are capped at the manifest's budgets; every pair keeps a passage body.
    assert qmask.sum(1).max() == 16 and enc.attention_mask.sum(1).max() == 48
    assert (qids[0] == qids[1]).all()  # one query, tokenized once, repeated


def test_scores_do_not_depend_on_batch_company(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: Path) -> None:
    ce = _split(tmp_path_factory, tokenizer_json, cross_bias=0.0)
    together = ce.infer(ce.tokenize(PAIRS))
    alone = np.array([ce.infer(ce.tokenize([p]))[0] for p in PAIRS])
    np.testing.assert_allclose(together, alone, atol=1e-4)
