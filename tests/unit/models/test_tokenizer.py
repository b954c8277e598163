"""The generated Unigram tokenizer.json."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tok(e5_fp32_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(e5_fp32_dir / "tokenizer.json"))


@pytest.mark.parametrize(
    "text",
    ["query: how much protein per day", "passage: 人寿保险的受益人可以更改吗？", "mixed 中文 and English 123", "波浪号～保留"],
)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    enc = tok.encode(text)
    assert "<unk>" not in enc.tokens
    assert tok.normalizer is not None
    assert tok.decode(enc.ids) == tok.normalizer.normalize_str(text)


def test_known_pieces_and_specials(tok: Tokenizer) -> None:
    enc = tok.encode("query: how much protein per day")
    # Ids of the original XLM-R sentencepiece vocabulary.
    assert enc.ids == [0, 41, 1294, 12, 3642, 5045, 21308, 117, 5155, 2]
    assert enc.tokens[0] == "<s>" and enc.tokens[-1] == "</s>"
    assert [tok.token_to_id(t) for t in ("<s>", "<pad>", "</s>", "<unk>")] == [0, 1, 2, 3]


def test_normalisation(tok: Tokenizer) -> None:
    assert tok.normalizer is not None
    assert tok.normalizer.normalize_str("ＡＢＣ１２３，") == "ABC123,"
    assert tok.normalizer.normalize_str("a\t\nb  \u200bc\x01") == "a b c"
    assert tok.normalizer.normalize_str("～") == "～"  # kept, like the C engine


def test_padding_and_truncation(tok: Tokenizer) -> None:
    batch = tok.encode_batch(["short", "a somewhat longer sentence here"])
    assert len(batch[0].ids) == len(batch[1].ids)
    assert batch[0].ids[-1] == 1 and batch[0].attention_mask[-1] == 0
    long = tok.encode("word " * 1000)
    assert len(long.ids) == 512 and long.ids[-1] == 2
