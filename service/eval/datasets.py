"""Judged retrieval data: InsuranceQA (the ``eval`` extra) or a user's own JSONL.

InsuranceQA (``insuranceqa-data==1.2``, GPL-3.0 research data, never copied into the repo):
27,413 answers (English original, Chinese machine translation), train/valid/test questions
with binary judgements and 200 shipped hard negatives each. Only ``train`` and ``valid`` are
loadable here: the test split is held out.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

Split = Literal["train", "valid"]
Lang = Literal["en", "zh"]

INSTALL_HINT = (
    "the InsuranceQA evaluation data is not installed; install the evaluation extra with "
    "`pip install '.[eval]'` (or `.venv/bin/pip install insuranceqa-data==1.2`)"
)
_SPACES = re.compile(r"[ \t\u00a0\u3000]{2,}")


class EvalDataMissing(RuntimeError):
    """The ``eval`` extra (insuranceqa-data) is not installed."""


@dataclass
class Judged:
    """A judged retrieval set.

    corpus:    document id -> text (for InsuranceQA: answer id -> answer, all 27,413)
    queries:   query id -> query text
    qrels:     query id -> ids of the relevant documents (binary judgements)
    negatives: query id -> shipped hard negatives (may be empty)
    documents: optional document id -> full service document (JSON object in the ingest
               format); when absent, documents are built from ``corpus`` (see ``document``).
    """

    name: str
    corpus: dict[str, str]
    queries: dict[str, str]
    qrels: dict[str, set[str]]
    negatives: dict[str, list[str]] = field(default_factory=dict)
    documents: dict[str, dict[str, Any]] | None = None
    lang: str = ""

    def sample(self, n: int | None, seed: int = 0) -> Judged:
        """``n`` queries drawn without replacement (seeded, order-independent); the corpus is
        kept whole. ``n`` None or >= len(queries) keeps every query."""
        qids = sorted(self.queries)
        if n is not None and n < len(qids):
            qids = sorted(random.Random(seed).sample(qids, n))
        return self._with_queries(
            qids, self.name if n is None or n >= len(self.queries) else f"{self.name}[sample={n},seed={seed}]")

    def without(self, qids: Iterable[str]) -> Judged:
        """The same set less the queries ``qids`` (the corpus kept whole): questions held out
        from a run that measured or fitted on ``qids``."""
        drop = set(qids)
        return self._with_queries([q for q in sorted(self.queries) if q not in drop],
                                  f"{self.name}[held out from {len(drop)}]")

    def _with_queries(self, qids: Sequence[str], name: str) -> Judged:
        """The queries ``qids`` (in that order) with their judgements, the corpus kept whole."""
        return Judged(
            name=name,
            corpus=self.corpus,
            queries={q: self.queries[q] for q in qids},
            qrels={q: self.qrels.get(q, set()) for q in qids},
            negatives={q: self.negatives.get(q, []) for q in qids},
            documents=self.documents,
            lang=self.lang,
        )

    def sample_corpus(self, n: int | None, seed: int = 0, *, keep_negatives: bool = False) -> Judged:
        """Shrink the corpus to about ``n`` documents: every judged positive of the current
        queries (and their shipped negatives when ``keep_negatives``), then random others up
        to ``n``. ``n`` None keeps the whole corpus. The kept set can exceed ``n`` when the
        positives alone do."""
        if n is None or n >= len(self.corpus):
            return self
        keep: set[str] = set()
        for q in self.queries:
            keep |= {d for d in self.qrels.get(q, ()) if d in self.corpus}
            if keep_negatives:
                keep |= {d for d in self.negatives.get(q, ()) if d in self.corpus}
        rest = sorted(set(self.corpus) - keep)
        extra = max(0, n - len(keep))
        keep |= set(random.Random(seed).sample(rest, min(extra, len(rest))))
        corpus = {d: t for d, t in self.corpus.items() if d in keep}
        docs = None if self.documents is None else {d: self.documents[d] for d in corpus if d in self.documents}
        return Judged(
            name=f"{self.name}[corpus={len(corpus)}]", corpus=corpus, queries=self.queries,
            qrels=self.qrels, negatives={q: [d for d in ns if d in keep] for q, ns in self.negatives.items()},
            documents=docs, lang=self.lang,
        )

    def document(self, doc_id: str) -> dict[str, Any]:
        """The service document (ingest JSONL format) for ``doc_id``: the user's own when
        loaded from a corpus JSONL, else one approved, public, FAQ-free ``doc`` document per
        corpus entry (source_id = document id, version "v1", no title)."""
        if self.documents is not None and doc_id in self.documents:
            return self.documents[doc_id]
        return {"source_id": doc_id, "version": "v1", "title": "", "text": self.corpus[doc_id],
                "collection": "doc", "status": "approved"}

    def stats(self) -> dict[str, Any]:
        judged = sum(len(v) for v in self.qrels.values())
        return {"name": self.name, "lang": self.lang, "corpus": len(self.corpus),
                "queries": len(self.queries), "judged_pairs": judged}


def clean_text(text: str, lang: str) -> str:
    """Strip, and collapse runs of blanks (the English side has doubled spaces throughout)."""
    text = text.strip().strip("\u00a0\u3000").strip()
    return _SPACES.sub(" ", text)


def _data_dir() -> Path:
    try:
        import insuranceqa_data
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise EvalDataMissing(INSTALL_HINT) from exc
    return Path(insuranceqa_data.__file__).parent


def insuranceqa_available() -> bool:
    try:
        _data_dir()
    except EvalDataMissing:
        return False
    return True


@lru_cache(maxsize=4)
def _load_gz(name: str) -> dict[str, Any]:
    path = _data_dir() / name
    if not path.exists():
        raise EvalDataMissing(f"{path} is missing; {INSTALL_HINT}")
    with gzip.open(path, "rb") as fh:
        data: dict[str, Any] = json.loads(fh.read())
    return data


def load_insuranceqa(split: Split, lang: Lang) -> Judged:
    """InsuranceQA ``train`` or ``valid`` in ``en`` or ``zh`` against the full answer corpus.

    Query ids are the dataset's question ids, document ids its answer ids (strings)."""
    if split not in ("train", "valid"):
        raise ValueError(f"split must be 'train' or 'valid' (the test split is held out), got {split!r}")
    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}")
    answers = _load_gz("answers.json.gz")
    questions = _load_gz(f"{split}.json.gz")
    corpus = {str(aid): clean_text(a[lang], lang) for aid, a in answers.items()}
    queries: dict[str, str] = {}
    qrels: dict[str, set[str]] = {}
    negatives: dict[str, list[str]] = {}
    for qid, q in questions.items():
        text = clean_text(q[lang], lang)
        pos = {str(a) for a in q["answers"] if str(a) in corpus}
        if not text or not pos:
            continue
        queries[str(qid)] = text
        qrels[str(qid)] = pos
        negatives[str(qid)] = [str(a) for a in q.get("negatives", []) if str(a) in corpus and str(a) not in pos]
    return Judged(name=f"insuranceqa-{split}-{lang}", corpus=corpus, queries=queries, qrels=qrels,
                  negatives=negatives, lang=lang)


def _jsonl(path: Path) -> list[tuple[int, Any]]:
    out = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                try:
                    out.append((lineno, json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: invalid JSON: {exc}") from exc
    return out


def load_jsonl_judgements(path: str | Path, corpus_path: str | Path | None = None, *, lang: str = "") -> Judged:
    """A user's own judgements: one JSON object per line,
    ``{"query": str, "positives": [doc ids], "negatives": [doc ids], "id": optional str}``.

    ``corpus_path`` is a JSONL of documents in the service's ingest format (``source_id``,
    ``version``, ``title``, ``text``, ...); document ids are ``source_id``. Without it the
    corpus is empty (evaluate against documents already ingested into a ``--target``)."""
    path = Path(path)
    documents: dict[str, dict[str, Any]] = {}
    corpus: dict[str, str] = {}
    if corpus_path is not None:
        for lineno, obj in _jsonl(Path(corpus_path)):
            if not isinstance(obj, dict) or not obj.get("source_id") or not str(obj.get("text", "")).strip():
                raise ValueError(f"{corpus_path}:{lineno}: a document needs 'source_id' and non-empty 'text'")
            sid = str(obj["source_id"])
            documents[sid] = {"version": "v1", "collection": "doc", **obj, "source_id": sid}
            title = str(obj.get("title", "")).strip()
            corpus[sid] = f"{title}\n{obj['text']}" if title else str(obj["text"])
    queries: dict[str, str] = {}
    qrels: dict[str, set[str]] = {}
    negatives: dict[str, list[str]] = {}
    for lineno, obj in _jsonl(path):
        if not isinstance(obj, dict) or not isinstance(obj.get("query"), str) or not obj["query"].strip():
            raise ValueError(f"{path}:{lineno}: each line needs a non-empty string 'query'")
        pos = obj.get("positives") or []
        neg = obj.get("negatives") or []
        if not isinstance(pos, list) or not isinstance(neg, list) or not pos:
            raise ValueError(f"{path}:{lineno}: 'positives' must be a non-empty list (and 'negatives' a list)")
        qid = str(obj.get("id", f"q{lineno}"))
        if qid in queries:
            raise ValueError(f"{path}:{lineno}: duplicate query id {qid!r}")
        if corpus:
            missing = [str(d) for d in pos if str(d) not in corpus]
            if missing:
                raise ValueError(f"{path}:{lineno}: positives not in the corpus: {missing[:5]}")
        queries[qid] = obj["query"].strip()
        qrels[qid] = {str(d) for d in pos}
        negatives[qid] = [str(d) for d in neg if str(d) not in qrels[qid]]
    return Judged(name=path.stem, corpus=corpus, queries=queries, qrels=qrels, negatives=negatives,
                  documents=documents or None, lang=lang)
