"""A Python port of OpenSearch's built-in ``cjk`` analyzer (Lucene ``CJKAnalyzer``).

Both engines must produce the same terms so that BM25 scores agree, so this reproduces the
Lucene chain exactly rather than approximating it:

StandardTokenizer (UAX#29 word breaks, max token length 255) -> CJKWidthFilter ->
LowerCaseFilter -> CJKBigramFilter (outputUnigrams=false) -> StopFilter(CJK default set).

The tokenizer runs Lucene's own JFlex DFA (``_jflex_tables``, extracted from the jar), so
word-break rules, Unicode 9 character properties and longest-match tie-breaks are the real ones.
``analyze`` is a pure function; ``tests/unit/engines/embedded/lucene_oracle.py`` compares it
with the real Lucene.
"""

from __future__ import annotations

import base64
import re
import zlib

import numpy as np
import numpy.typing as npt

from service.engines.embedded import _jflex_tables as _t

MAX_TOKEN_LENGTH = 255  # StandardAnalyzer.DEFAULT_MAX_TOKEN_LENGTH, in UTF-16 code units

# CJKAnalyzer's stopwords.txt (Lucene 9.12).
STOP_WORDS = frozenset(
    "a and are as at be but by for if in into is it no not of on or s such t that the their "
    "then there these they this to was will with www".split()
)

# JFlex action numbers of StandardTokenizerImpl's rules.
_IGNORE, _HANGUL, _IDEOGRAPHIC, _KATAKANA, _HIRAGANA = 1, 6, 7, 8, 9
_CJK_KINDS = frozenset((_HANGUL, _IDEOGRAPHIC, _KATAKANA, _HIRAGANA))


def _build_cmap() -> npt.NDArray[np.uint8]:
    """Character class of every code point (the JFlex two-level map, flattened)."""
    top = np.frombuffer(zlib.decompress(base64.b64decode(_t.CMAP_TOP)), dtype=np.uint8)
    blocks = np.frombuffer(zlib.decompress(base64.b64decode(_t.CMAP_BLOCKS)), dtype=np.uint8)
    cps = np.arange(0x110000, dtype=np.int64)
    cmap: npt.NDArray[np.uint8] = blocks[(top[cps >> 8].astype(np.int64) << 8) | (cps & 0xFF)]
    return cmap


_CMAP = _build_cmap()
_N_CLASSES = int(_CMAP.max()) + 1
# _DELTA[state][char class] -> next state or -1 (ZZ_TRANS rows addressed through ZZ_ROWMAP).
_DELTA = [list(_t.TRANS[row : row + _N_CLASSES]) for row in _t.ROWMAP]
# Action of an accepting state, 0 otherwise; and whether the match cannot grow further.
_ACCEPT = [_t.ACTION[s] if attr & 1 else 0 for s, attr in enumerate(_t.ATTRIBUTE)]
_FINAL = [bool(attr & 8) for attr in _t.ATTRIBUTE]
_NON_IGNORABLE = re.compile(rb"[^\x00]")  # class 0 chars only ever form ignored 1-char matches
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def _classes(text: str) -> bytes:
    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    return bytes(_CMAP[cps])


def _limits(text: str) -> list[int] | None:
    """Per start index, the end of the 255-UTF-16-unit window JFlex's buffer allows; None when
    the text has no supplementary characters (then the window is simply 255 code points)."""
    if _ASTRAL.search(text) is None:
        return None
    units = np.cumsum([2 if ord(c) > 0xFFFF else 1 for c in text], dtype=np.int64)
    starts = np.concatenate(([0], units[:-1]))
    ends: list[int] = np.searchsorted(units, starts + MAX_TOKEN_LENGTH, side="right").tolist()
    return ends


def tokenize(text: str) -> list[tuple[int, int, int]]:
    """StandardTokenizer: ``(start, end, action)`` per token, in code point offsets.

    Mirrors ``StandardTokenizerImpl.getNextToken``: longest match through the DFA, the last
    accepting position wins, and the non-growing 255-char buffer chops longer tokens.
    """
    classes = _classes(text)
    limits = _limits(text)
    n = len(text)
    delta, accept, final = _DELTA, _ACCEPT, _FINAL
    tokens: list[tuple[int, int, int]] = []
    pos = 0
    while pos < n:
        found = _NON_IGNORABLE.search(classes, pos)
        if found is None:
            break
        pos = found.start()
        limit = min(n, pos + MAX_TOKEN_LENGTH) if limits is None else limits[pos]
        state, action, marked, p = 0, 0, pos, pos
        while p < limit:
            state = delta[state][classes[p]]
            if state < 0:
                break
            p += 1
            if accept[state]:
                action, marked = accept[state], p
                if final[state]:
                    break
        if action != _IGNORE:
            tokens.append((pos, marked, action))
        pos = marked
    return tokens


# CJKWidthFilter tables: halfwidth katakana 0xFF65-0xFF9F and voiced-mark combining diffs
# for 0x30A6-0x30FD.
_KANA_NORM = (
    0x30FB, 0x30F2, 0x30A1, 0x30A3, 0x30A5, 0x30A7, 0x30A9, 0x30E3, 0x30E5,
    0x30E7, 0x30C3, 0x30FC, 0x30A2, 0x30A4, 0x30A6, 0x30A8, 0x30AA, 0x30AB,
    0x30AD, 0x30AF, 0x30B1, 0x30B3, 0x30B5, 0x30B7, 0x30B9, 0x30BB, 0x30BD,
    0x30BF, 0x30C1, 0x30C4, 0x30C6, 0x30C8, 0x30CA, 0x30CB, 0x30CC, 0x30CD,
    0x30CE, 0x30CF, 0x30D2, 0x30D5, 0x30D8, 0x30DB, 0x30DE, 0x30DF, 0x30E0,
    0x30E1, 0x30E2, 0x30E4, 0x30E6, 0x30E8, 0x30E9, 0x30EA, 0x30EB, 0x30EC,
    0x30ED, 0x30EF, 0x30F3, 0x3099, 0x309A,
)  # fmt: skip
_VOICED = (
    78, 0, 0, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 0,
    1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1,
)  # fmt: skip
_HALF_VOICED = tuple(2 if i in (41, 44, 47, 50, 53) else 0 for i in range(88))
_WIDE = re.compile("[\uff01-\uff5e\uff65-\uff9f]")


def _fold_width(term: str) -> str:
    """CJKWidthFilter: fullwidth ASCII -> ASCII, halfwidth katakana -> fullwidth, combining
    a following halfwidth (semi-)voiced mark into the preceding kana where one exists."""
    chars = [ord(c) for c in term]
    out: list[int] = []
    for ch in chars:
        if 0xFF01 <= ch <= 0xFF5E:
            out.append(ch - 0xFEE0)
        elif 0xFF65 <= ch <= 0xFF9F:
            if ch in (0xFF9E, 0xFF9F) and out and 0x30A6 <= out[-1] <= 0x30FD:
                diff = (_HALF_VOICED if ch == 0xFF9F else _VOICED)[out[-1] - 0x30A6]
                if diff:
                    out[-1] += diff
                    continue
            out.append(_KANA_NORM[ch - 0xFF65])
        else:
            out.append(ch)
    return "".join(map(chr, out))


def _lower(term: str) -> str:
    """LowerCaseFilter: Java's per-code-point ``Character.toLowerCase`` (simple case mapping,
    no final-sigma context, U+0130 -> 'i')."""
    if "\u03a3" not in term and "\u0130" not in term:
        # str.lower differs from Java only through final sigma and U+0130's two-char mapping
        return term.lower()
    return "".join("i" if c == "\u0130" else c.lower() for c in term)


def analyze(text: str) -> list[str]:
    """Terms of ``text`` under OpenSearch's ``cjk`` analyzer, in order, duplicates kept."""
    terms: list[str] = []
    run: list[str] = []  # code points of the current run of offset-adjacent CJK tokens
    run_end = 0  # CJKBigramFilter.lastEndOffset

    def flush() -> None:
        if len(run) == 1:
            terms.append(run[0])
        else:
            terms.extend(a + b for a, b in zip(run, run[1:], strict=False))
        run.clear()

    has_wide = _WIDE.search(text) is not None
    for start, end, action in tokenize(text):
        term = text[start:end]
        if has_wide and _WIDE.search(term):
            term = _fold_width(term)
        term = _lower(term)
        if action in _CJK_KINDS:
            if start != run_end and run:
                flush()
            run.extend(term)
            run_end = end
        else:
            if run:
                flush()
            if term not in STOP_WORDS:
                terms.append(term)
    flush()
    return terms
