"""Chunking: heading breadcrumbs and parent/child chunks.

A small child chunk is what matches a query precisely; its parent section is returned as
context so the evidence reads on its own. Markdown headings (``#`` .. ``######``) build
the breadcrumb. FAQ entries are never split: the question and its answer belong together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from service.models.passage_states import rerank_passage_text

_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
# Sentence ends: ASCII punctuation only before whitespace (so "v2.4" and "3.5" stay
# whole); CJK full stops need none. The delimiter stays with its sentence.
_SENTENCE = re.compile(r"(?<=[.!?;])\s+|(?<=[。！？；])")
_CJK_END = ("。", "！", "？", "；")


@dataclass(frozen=True)
class Chunk:
    index: int
    breadcrumb: str
    text: str
    parent_text: str


def embedded_text(title: str, chunk: Chunk) -> str:
    """What a chunk is embedded and searched as (its ``search_text``): the document title,
    the chunk's breadcrumb and its text. Everything that must match what ingest embeds
    (the eval's embedding cache, the training pack, the benches) builds it here."""
    return rerank_passage_text(title, chunk.breadcrumb, chunk.text)


def _sections(text: str, base: str) -> list[tuple[str, str]]:
    path: list[str] = []
    out: list[tuple[str, str]] = []
    lines: list[str] = []

    def flush() -> None:
        body = "\n".join(lines).strip()
        if body:
            out.append((" > ".join([p for p in [base, *path] if p]), body))
        lines.clear()

    for line in text.splitlines():
        m = _HEADING.match(line)
        if m:
            flush()
            level = len(m.group(1))
            path[:] = path[: level - 1] + [m.group(2)]
        else:
            lines.append(line)
    flush()
    return out


def _pack(pieces: list[str], limit: int, sep: str) -> list[str]:
    """Greedily pack pieces into chunks of at most ``limit`` chars (a longer piece is cut).
    Chinese sentences are joined without a separator, as they were written."""
    chunks: list[str] = []
    cur = ""
    for piece in pieces:
        glue = "" if sep == " " and cur.endswith(_CJK_END) else sep
        while len(piece) > limit:
            if cur:
                chunks.append(cur)
                cur = ""
            chunks.append(piece[:limit])
            piece = piece[limit:]
        if not piece:
            continue
        if cur and len(cur) + len(glue) + len(piece) > limit:
            chunks.append(cur)
            cur = piece
        else:
            cur = f"{cur}{glue}{piece}" if cur else piece
    if cur:
        chunks.append(cur)
    return chunks


def chunk_document(
    text: str, breadcrumb: str, collection: str, child_chars: int, parent_chars: int
) -> list[Chunk]:
    if collection == "faq":
        body = text.strip()
        return [Chunk(0, breadcrumb, body, body)]
    chunks: list[Chunk] = []
    for crumb, body in _sections(text, breadcrumb):
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", body) if p.strip()]
        for parent in _pack(paragraphs, parent_chars, "\n\n"):
            sentences = [s for s in _SENTENCE.split(parent) if s.strip()]
            for child in _pack(sentences, child_chars, " "):
                chunks.append(Chunk(len(chunks), crumb, child.strip(), parent))
    return chunks
