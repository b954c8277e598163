"""Expected terms of OpenSearch's ``cjk`` analyzer, checked against the Python port.

Each row was confirmed against Lucene 9.12's CJKAnalyzer (see test_analyzer_lucene_parity.py);
the comments say which Lucene rule the row pins down.
"""

from __future__ import annotations

import pytest

from service.engines.embedded.analyzer import STOP_WORDS, analyze

CASES = [
    # English: lowercased, CJKAnalyzer's stop set removed (no stemming).
    ("The quick brown fox", ["quick", "brown", "fox"]),
    ("Hello, World! It is a test.", ["hello", "world", "test"]),
    ("the and of to in is it", []),
    ("S&P 500", ["p", "500"]),  # '&' breaks; "s" is a stop word
    # Chinese: Han chars are single-char tokens, adjacent ones become overlapping bigrams.
    ("中华人民共和国", ["中华", "华人", "人民", "民共", "共和", "和国"]),
    ("中", ["中"]),  # a lone CJK char stays a unigram
    ("中 文", ["中", "文"]),  # not adjacent: no bigram across the space
    ("保险费\u3000理赔。", ["保险", "险费", "理赔"]),
    ("𠀀𠀁", ["𠀀𠀁"]),  # supplementary ideographs bigram like BMP ones
    # Mixed scripts: Latin and digits split from Han; Han runs bigram on their own.
    ("Lucene是搜索引擎", ["lucene", "是搜", "搜索", "索引", "引擎"]),
    ("年度免赔额是5,000元", ["年度", "度免", "免赔", "赔额", "额是", "5,000", "元"]),
    ("IPv6 4K 2024年5月", ["ipv6", "4k", "2024", "年", "5", "月"]),
    # Versions and numbers: MidNum/MidNumLet join digits, letters and digits join (WB9/10).
    ("version v2.3 and 1.2.3", ["version", "v2.3", "1.2.3"]),
    ("3,000.50 元", ["3,000.50", "元"]),
    ("a1b2 1a 3.14abc", ["a1b2", "1a", "3.14abc"]),
    ("x.y.z 1,2 a,b", ["x.y.z", "1,2", "b"]),  # ',' is MidNum only; "a" is a stop word
    ("www.example.com user@mail.org", ["www.example.com", "user", "mail.org"]),
    # Apostrophes (MidNumLet / Single_Quote) join letters.
    ("don't stop", ["don't", "stop"]),
    ("O'Reilly's book", ["o'reilly's", "book"]),
    # Hyphens break, underscores (ExtendNumLet) join.
    ("e-mail Wi-Fi", ["e", "mail", "wi", "fi"]),
    ("user_id snake_case", ["user_id", "snake_case"]),
    # Fullwidth ASCII folds to ASCII; halfwidth katakana to fullwidth (voiced marks combine).
    ("ＡＢＣ１２３ ｆｕｌｌ", ["abc123", "full"]),
    ("ＨＥＬＬＯ\u3000Ｗｏｒｌｄ", ["hello", "world"]),
    ("ｶﾀｶﾅ ﾊﾞｲｸ", ["カタ", "タカ", "カナ", "バイ", "イク"]),
    # Katakana words, hiragana chars and Hangul words all bigram, also across scripts.
    ("カタカナ", ["カタ", "タカ", "カナ"]),
    ("ひらがな", ["ひら", "らが", "がな"]),
    ("日本語のテキスト", ["日本", "本語", "語の", "のテ", "テキ", "キス", "スト"]),
    ("한국어 텍스트", ["한국", "국어", "텍스", "스트"]),
    # Other letters: Java's per-char lowercase (no final sigma, İ -> i).
    ("café naïve Straße", ["café", "naïve", "straße"]),
    ("α-Beta ΣΑΣ İ", ["α", "beta", "σασ", "i"]),
    ("人々", ["人", "々"]),  # U+3005 is a word char, not Han-typed: no bigram
    ("#hashtag @mention ¼", ["hashtag", "mention"]),
]


@pytest.mark.parametrize(("text", "expected"), CASES, ids=[c[0] for c in CASES])
def test_cjk_analyzer_terms(text: str, expected: list[str]) -> None:
    assert analyze(text) == expected


def test_tokens_longer_than_255_are_chopped() -> None:
    assert analyze("a" * 300) == ["a" * 255, "a" * 45]
    # the window is 255 UTF-16 units, so supplementary chars count twice
    assert analyze("\U0001d400" * 200) == ["\U0001d400" * 127, "\U0001d400" * 73]


def test_stop_set_is_cjk_analyzers() -> None:
    assert len(STOP_WORDS) == 35
    assert {"s", "t", "www", "such", "with"} <= STOP_WORDS


def test_pure_and_repeatable() -> None:
    text = "保险 Policy v2.3 保险"
    assert analyze(text) == analyze(text) == ["保险", "policy", "v2.3", "保险"]
