"""Post-processing of fused candidates: admissibility, dedupe, context budget."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

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


def dedupe(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Keep the best child per parent section (they share one context) and drop repeated
    texts across sources; input order is rank order."""
    seen: set[str] = set()
    out = []
    for c in candidates:
        chunk = c.chunk
        parent_key = f"p:{chunk.source_id}@{chunk.version}:{_parent_digest(chunk.parent_text)}"
        text_key = "t:" + _text_digest(chunk.text)
        if parent_key in seen or text_key in seen:
            continue
        seen.update((parent_key, text_key))
        out.append(c)
    return out


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
