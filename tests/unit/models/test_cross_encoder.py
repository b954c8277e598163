"""The ONNX cross-encoder runner, on a tiny random-weight model."""

from __future__ import annotations

import numpy as np
import pytest

from service.models.onnx_cross_encoder import OnnxCrossEncoder

pytestmark = pytest.mark.slow

PAIRS = [
    ("what is term life insurance", "Term life insurance pays a benefit if you die during the term."),
    ("如何申请理赔", "申请理赔时需要提交发票和诊断证明。"),
    ("q", "a much longer passage " * 10),
]


def test_shape_and_info(tiny_ce: OnnxCrossEncoder) -> None:
    enc = tiny_ce.tokenize(PAIRS)
    assert enc.token_type_ids is not None
    logits = tiny_ce.infer(enc)
    assert logits.shape == (3,) and logits.dtype == np.float32
    assert np.isfinite(logits).all() and np.ptp(logits) > 0
    assert tiny_ce.info.kind == "cross-encoder" and len(tiny_ce.info.sha256) == 64


def test_pair_template(tiny_ce: OnnxCrossEncoder) -> None:
    enc = tiny_ce.tokenize([("a", "b")])
    ids, types = enc.input_ids[0].tolist(), enc.token_type_ids[0].tolist()  # type: ignore[index]
    assert ids[0] == 0 and ids.count(2) == 2 and ids[-1] == 2  # <s> q </s> p </s>
    assert types[0] == 0 and types[-1] == 1


def test_deterministic(tiny_ce: OnnxCrossEncoder) -> None:
    a = tiny_ce.infer(tiny_ce.tokenize(PAIRS))
    b = tiny_ce.infer(tiny_ce.tokenize(PAIRS))
    np.testing.assert_array_equal(a, b)


def test_padding_invariance(tiny_ce: OnnxCrossEncoder) -> None:
    batch = tiny_ce.infer(tiny_ce.tokenize(PAIRS))
    for i, pair in enumerate(PAIRS):
        alone = tiny_ce.infer(tiny_ce.tokenize([pair]))[0]
        assert abs(float(alone) - float(batch[i])) < 1e-4


def test_truncates_passage_first(tiny_ce: OnnxCrossEncoder) -> None:
    query = "what does my policy cover"
    enc = tiny_ce.tokenize([(query, "word " * 1000)])
    assert enc.input_ids.shape == (1, tiny_ce.max_length)
    plain = tiny_ce.tokenize([(query, "x")])
    q_len = plain.input_ids[0].tolist().index(2) + 1
    assert enc.input_ids[0, :q_len].tolist() == plain.input_ids[0, :q_len].tolist()
    long_query = tiny_ce.tokenize([("word " * 1000, "word " * 1000)])
    assert long_query.input_ids.shape == (1, tiny_ce.max_length)


def test_empty(tiny_ce: OnnxCrossEncoder) -> None:
    assert tiny_ce.infer(tiny_ce.tokenize([])).shape == (0,)
