"""The hashing embedder and overlap cross-encoder used by fast tests."""

from __future__ import annotations

import numpy as np

from service.models.dummy import HashEmbedder, OverlapCrossEncoder


def test_hash_embedder_is_deterministic_and_normalised() -> None:
    model = HashEmbedder()
    texts = ["insurance claim", "保险理赔", ""]
    a = model.infer(model.tokenize(texts, "query"))
    b = HashEmbedder().infer(HashEmbedder().tokenize(texts, "passage"))
    assert a.shape == (3, 384) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, rtol=1e-6)
    assert model.info.model_id == "dummy-hash-384"


def test_hash_embedder_similarity() -> None:
    model = HashEmbedder()
    v = model.infer(
        model.tokenize(
            ["how to file an insurance claim", "filing insurance claims", "the weather is sunny", "如何申请保险理赔", "申请保险理赔的流程", "今天天气晴朗"],
            "passage",
        )
    )
    sims = v @ v.T
    assert sims[0, 1] > sims[0, 2] + 0.2
    assert sims[3, 4] > sims[3, 5] + 0.2


def test_hash_embedder_batch_independence() -> None:
    model = HashEmbedder()
    batch = model.infer(model.tokenize(["a b c", "a much longer text with many more words in it"], "query"))
    alone = model.infer(model.tokenize(["a b c"], "query"))
    np.testing.assert_array_equal(batch[0], alone[0])


def test_overlap_cross_encoder() -> None:
    model = OverlapCrossEncoder()
    pairs = [
        ("insurance claim", "how to file an insurance claim"),
        ("insurance claim", "only insurance here"),
        ("insurance claim", "weather"),
        ("保险理赔", "申请保险理赔"),
        ("", "anything"),
    ]
    logits = model.infer(model.tokenize(pairs))
    assert logits.shape == (5,) and logits.dtype == np.float32
    assert logits[0] > logits[1] > logits[2]
    assert logits[3] == 5.0 and logits[4] == -5.0
