"""The Python ``cjk`` analyzer and BM25 against the real Lucene 9.12 (OpenSearch 2.19's).

Skips, with the reason, where Java or the Lucene jars are missing (fetch the jars with
``mvn dependency:get``; see lucene_oracle.py), and fails instead under ``CI=true``.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

import lucene_oracle
from service.engines.embedded.analyzer import analyze
from service.engines.embedded.bm25 import Bm25Index

if not lucene_oracle.available():
    _WHY = "Lucene oracle unavailable (needs java, javac and lucene 9.12.3 jars in ~/.m2)"
    if os.environ.get("CI", "").lower() == "true":  # CI must run the parity test, never skip it
        pytest.fail(f"{_WHY} (CI=true: this test must run, not skip)", pytrace=False)
    pytest.skip(_WHY, allow_module_level=True)

# Characters chosen to exercise every tokenizer rule and filter: ASCII word/number joiners,
# quotes, Han (BMP and supplementary), kana of both widths with voiced marks, Hangul,
# fullwidth ASCII, combining marks, emoji sequences, Thai, Hebrew, and separators.
PALETTE = list(
    "abcXYZ019_.,:;'\"-@#*&/ \t\n"
    "中文保险理赔額々〇"
    "ひらがなカタカナーヴｶﾀﾅﾊﾞﾟﾞｰ"
    "한국어텍스트"
    "ＡＢＣａｂｃ１２３．，"
    "\u0301\u200d\ufe0f\u20e3"
    "👍🏽❤🇨🇳©™"
    "ภาษาไทย"
    "עברית׳״"
    "\U00020000\U0001d400"
    "İΣßé"
)


def _random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    texts = ["".join(rng.choice(PALETTE) for _ in range(rng.randint(0, 40))) for _ in range(count)]
    texts += ["".join(rng.choice("ab1_.'") for _ in range(rng.randint(250, 600))) for _ in range(5)]
    return texts


def test_analyzer_matches_lucene_on_random_text() -> None:
    texts = _random_texts(seed=20240501, count=3000)
    expected = lucene_oracle.analyze_many(texts)
    mismatches = [
        (t, analyze(t), e) for t, e in zip(texts, expected, strict=True) if analyze(t) != e
    ]
    assert mismatches == []


def test_bm25_scores_match_lucene_bit_for_bit() -> None:
    rng = random.Random(7)
    words = ["insurance", "policy", "claim", "premium", "v2.3", "the", "保险", "理赔",
             "免赔额", "保单", "被保险人", "年度"]  # fmt: skip
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 60))) for _ in range(300)]
    queries = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in range(60)]
    queries += ["claim claim policy", "保险保险", "no such term"]
    index = Bm25Index()
    for slot, doc in enumerate(docs):
        index.add(slot, analyze(doc))
    for query, expected in zip(queries, lucene_oracle.bm25_many(docs, queries), strict=True):
        assert index.search(analyze(query), len(docs)) == expected, query


def test_tokenizer_tables_are_the_jars() -> None:
    generated = Path(__file__).parents[4] / "service/engines/embedded/_jflex_tables.py"
    assert lucene_oracle.emit_tables() == generated.read_text()
