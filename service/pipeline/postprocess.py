"""Post-processing of fused candidates: admissibility, dedupe, context budget."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import islice

from service.pipeline.fusion import Candidate


def admissible(c: Candidate, statuses: Sequence[str], version_pins: dict[str, str]) -> bool:
    """Policy: the source version's status is allowed, and a pinned source matches its pin."""
    chunk = c.chunk
    if chunk.status not in statuses:
        return False
    pin = version_pins.get(chunk.source_id)
    return pin is None or pin == chunk.version


# Digests of the texts dedupe compares, memoised: an attempt dedupes every fused candidate
# (up to two legs' depth), and hashing their texts anew was 12 % of the event loop's time at
# concurrency 32 (py-spy, InsuranceQA answers). A str caches its own hash, so a hit on the
# embedded engine's shared records costs a dict lookup. Bounded: at most this many texts.
_DIGESTS = 16384


@lru_cache(maxsize=_DIGESTS)
def _parent_digest(parent_text: str) -> str:
    return hashlib.sha1(parent_text.encode()).hexdigest()


@lru_cache(maxsize=_DIGESTS)
def _text_digest(text: str) -> str:
    return hashlib.sha1(" ".join(text.split()).encode()).hexdigest()


def iter_dedupe(candidates: Iterable[Candidate]) -> Iterator[Candidate]:
    """Keep the best child per parent section (they share one context) and drop repeated
    texts across sources; input order is rank order. Lazy: each item is judged when read."""
    seen: set[str] = set()
    for c in candidates:
        chunk = c.chunk
        parent_key = f"p:{chunk.source_id}@{chunk.version}:{_parent_digest(chunk.parent_text)}"
        text_key = "t:" + _text_digest(chunk.text)
        if parent_key in seen or text_key in seen:
            continue
        seen.update((parent_key, text_key))
        yield c


def dedupe(candidates: Iterable[Candidate]) -> list[Candidate]:
    """``iter_dedupe``, all of it."""
    return list(iter_dedupe(candidates))


class Deduped:
    """The deduped candidates in rank order, deduped only as far as an attempt reads them.

    An attempt reads the rerank head and the items it returns (a handful more when a
    min_quality gate drops some), not the whole fused list of two 100-deep legs: judging
    every candidate (dedupe's keys, then its calibrated quality) was ~10 % of the event
    loop's time at concurrency 32. ``items`` is the prefix read so far; ``more`` extends it."""

    def __init__(self, candidates: Iterable[Candidate], upfront: int | None = None) -> None:
        self._rest = iter_dedupe(candidates)
        self.items: list[Candidate] = list(self._rest if upfront is None else islice(self._rest, upfront))
        self.exhausted = upfront is None or len(self.items) < upfront

    def more(self, n: int) -> list[Candidate]:
        """Up to ``n`` more items, appended to ``items``; [] once every candidate was read."""
        if self.exhausted:
            return []
        extra = list(islice(self._rest, n))
        self.exhausted = len(extra) < n
        self.items.extend(extra)
        return extra


@dataclass(frozen=True)
class Budgeted:
    candidate: Candidate
    excerpt: str
    context: str


def cap(excerpt: str, context: str, limit: int) -> tuple[str, str, bool]:
    """Cut context first, then the excerpt, to ``limit`` characters in all; and whether it cut."""
    if len(excerpt) + len(context) <= limit:
        return excerpt, context, False
    if len(excerpt) >= limit:
        return excerpt[:limit], "", True
    return excerpt, context[: limit - len(excerpt)], True


def apply_context_budget(
    candidates: Sequence[Candidate], top_k: int, max_chars: int, max_item_chars: int = 0
) -> tuple[list[Budgeted], bool]:
    """Take up to top_k items while excerpt + context characters fit in max_chars (and each
    item in ``max_item_chars``, when set).

    The item that crosses the budget is cut (context first, then excerpt); later items are
    dropped. Returns the items and whether the budget cut or dropped anything (top_k
    alone is the caller's choice and does not count as truncation).
    """
    out: list[Budgeted] = []
    left = max_chars
    truncated = False
    for c in candidates[:top_k]:
        if left <= 0:
            truncated = True
            break
        excerpt = c.chunk.text
        context = c.chunk.parent_text if c.chunk.parent_text != c.chunk.text else ""
        if max_item_chars:
            excerpt, context, cut = cap(excerpt, context, max_item_chars)
            truncated |= cut
        excerpt, context, cut = cap(excerpt, context, left)
        truncated |= cut
        left -= len(excerpt) + len(context)
        out.append(Budgeted(c, excerpt, context))
    return out, truncated
