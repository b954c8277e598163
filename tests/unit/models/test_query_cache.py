"""The query embedding cache: its key never merges texts the model would see differently,
LRU eviction, and the runtime answering repeats without running the model."""

from __future__ import annotations

import time

import numpy as np
import pytest
from tokenizers import Tokenizer

from service.models.dummy import HashEmbedder
from service.models.query_cache import QueryEmbeddingCache, normalise_query
from service.models.runtime import ModelRuntime
from service.offline.builder import default_models_dir

VARIANTS = [
    "How do I reset my password", "How do I  reset my password", "  How do I reset my password",
    "How do I reset my password ", "How do I reset my password\t", "how do I reset my password",
    "How do I\nreset my password", "如何开具发票", "如何 开具发票", "如何开具发票？", "如何开具发票?",
    "Ｈow do I reset my password",
]


def test_key_merges_only_texts_with_the_same_token_ids() -> None:
    path = default_models_dir() / "multilingual-e5-small-int8" / "tokenizer.json"
    if not path.exists():
        pytest.skip("models not built (make models)")
    tok = Tokenizer.from_file(str(path))
    for a in VARIANTS:
        for b in VARIANTS:
            if normalise_query(a) == normalise_query(b):
                assert tok.encode("query: " + a).ids == tok.encode("query: " + b).ids, (a, b)
    assert normalise_query("a  b\t") == "a b " and normalise_query("  A b") == "A b"


def test_lru_eviction_and_model_in_key() -> None:
    cache = QueryEmbeddingCache(2, "sha-a")
    v = np.ones(3, np.float32)
    cache.put("one", v)
    cache.put("two", v * 2)
    assert cache.get("one") is not None  # "one" is now the most recent
    cache.put("three", v * 3)
    assert cache.get("two") is None and cache.get("one") is not None and len(cache) == 2
    assert QueryEmbeddingCache(2, "sha-b").get("one") is None
    assert QueryEmbeddingCache(0, "sha-a").get("one") is None


async def test_runtime_answers_a_repeat_from_the_cache() -> None:
    rt = ModelRuntime(HashEmbedder(), None, workers=1, query_cache_size=16)
    await rt.start()
    try:
        deadline = time.monotonic() + 5
        first, t1 = await rt.embed_query("refund  policy", deadline)
        batches = rt._embedding.queries.batches_run
        again, t2 = await rt.embed_query("refund policy", deadline)
        assert rt._embedding.queries.batches_run == batches  # no model call
        assert np.array_equal(first, again) and t2.inference_ms == 0 and t1.batch_size == 1
        assert not again.flags.writeable
    finally:
        await rt.close()
