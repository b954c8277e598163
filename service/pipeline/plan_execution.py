"""Executing a retrieval plan: the FAQ and document collections searched separately, each
with its own top_k (every (collection, variant) pair concurrently, each a hybrid BM25 +
kNN search), query variants fused with RRF, the collections merged; then, after quality,
the FAQ direct answer.

``resolve_plan`` runs at admission (before anything is searched): it builds the plan from
intent signals or checks the caller's own, so a bad plan or a direct-answer intent is
INVALID_ARGUMENT, never an attempt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import re
import unicodedata
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from service.config import Config
from service.domain import SEARCH_LEGS, LegKind, LegReport, LegStatus, LegTiming
from service.engines.base import SearchFilter
from service.errors import FieldViolation, InvalidArgument
from service.pipeline.fusion import Candidate, FusionParams, fuse_by_leg
from service.pipeline.legs import LegRun
from service.pipeline.request import AttemptRequest
from service.pipeline.variants import fuse_variants
from service.planning.plan import plan_violations
from service.planning.planner import IntentInput, build_plan, history_rewrite
from service.planning.rules import PlanRules

MAX_QUERY_VARIANTS = 4
SearchFn = Callable[[str, SearchFilter, tuple[LegKind, ...], float, int], AsyncIterator[LegRun]]
# Assigns each candidate's provisional (hybrid) calibrated quality, given the leg runs.
JudgeFn = Callable[[list[Candidate], list[LegRun]], None]


def resolve_plan(req: AttemptRequest, rules: PlanRules, cfg: Config) -> AttemptRequest:
    """The request with its plan built (or checked) and its variants decided. Raises
    InvalidArgument naming the field."""
    v: list[FieldViolation] = []
    if len(req.query_variants) > MAX_QUERY_VARIANTS:
        v.append(FieldViolation("query_variants", f"at most {MAX_QUERY_VARIANTS} variants"))
    for i, q in enumerate(req.query_variants):
        if not q.strip() or len(q) > cfg.max_query_chars:
            v.append(FieldViolation(f"query_variants[{i}]", f"must be 1..{cfg.max_query_chars} characters"))
    if v:
        raise InvalidArgument(v)
    if not req.planned:
        return req
    if req.plan is not None:
        plan = req.plan
        bad = plan_violations(plan, cfg.max_top_k)
        if bad:
            raise InvalidArgument(bad)
        rewrite = history_rewrite(req.query, req.history) if req.history else req.query
        server_variants: tuple[str, ...] = (rewrite,) if rewrite != req.query else ()
    else:
        built = build_plan(req.query, req.history, req.intent or IntentInput(), rules)
        plan, server_variants = built.plan, built.variants[1:]
    allowed = set(req.collections) if req.collections else {"faq", "doc"}
    if not ((plan.run_faq and "faq" in allowed) or (plan.run_doc and "doc" in allowed)):
        raise InvalidArgument.one("filters.collections", "excludes every collection the plan searches")
    variants: tuple[str, ...] = ()
    if plan.use_query_variants:
        variants = tuple(dict.fromkeys(q for q in (*req.query_variants, *server_variants) if q != req.query))
    min_quality = max(req.min_quality or cfg.min_quality, plan.min_context_score)
    rerank = req.rerank if req.rerank is not None else (None if plan.rerank else False)
    return dataclasses.replace(req, plan=plan, query_variants=variants, min_quality=min_quality, rerank=rerank)


def rerank_query(req: AttemptRequest) -> str:
    """The query the reranker judges against: a follow-up's history-aware rewrite (the
    last variant; it carries the question the bare follow-up leaves implicit), else the query."""
    if req.history and req.query_variants:
        return req.query_variants[-1]
    return req.query


@dataclass
class PlannedSearch:
    runs: list[LegRun]  # one aggregated run per leg kind, hits empty (fused already)
    candidates: list[Candidate]  # merged over collections, in order
    variants: list[str]  # the queries actually retrieved, the query first


def _aggregate(kind: LegKind, parts: list[tuple[str, LegRun]]) -> LegRun:
    """One report per leg kind over every sub-search: the worst status, the slowest
    latency, the hits summed, each failure named in the detail."""
    mine = [(label, r.report) for label, r in parts if r.report.kind is kind]
    if not mine or all(rep.status is LegStatus.SKIPPED for _, rep in mine):
        detail = mine[0][1].detail if mine else "not requested"
        return LegRun(LegReport(kind, LegStatus.SKIPPED, 0.0, 0, detail), [])
    statuses = [rep.status for _, rep in mine]
    status = next((s for s in (LegStatus.ERROR, LegStatus.TIMEOUT) if s in statuses), LegStatus.OK)
    detail = "; ".join(f"{label}: {rep.detail}" for label, rep in mine if rep.status is not LegStatus.OK and rep.detail)
    timing: LegTiming | None = None
    for _, rep in mine:
        if rep.timing is not None:
            timing = rep.timing if timing is None else timing.plus(rep.timing)
    report = LegReport(kind, status, max(rep.latency_ms for _, rep in mine),
                       sum(rep.hit_count for _, rep in mine), detail, timing)
    return LegRun(report, [])


async def _collect(search: SearchFn, query: str, flt: SearchFilter, legs: tuple[LegKind, ...],
                   deadline: float, size: int) -> list[LegRun]:
    return [r async for r in search(query, flt, legs, deadline, size)]


async def search_planned(search: SearchFn, req: AttemptRequest, flt: SearchFilter, legs: tuple[LegKind, ...],
                         deadline: float, fusion: FusionParams, default_size: int, judge: JudgeFn) -> PlannedSearch:
    """Every (collection, variant) sub-search concurrently, then fuse and merge. Each
    collection's list keeps its own (RRF) order; the collections are interleaved by
    calibrated quality, a probability comparable across lists (ranks are not: each
    collection has a first hit)."""
    variants = [req.query, *req.query_variants]
    if req.plan is None:  # variants without a plan: one search with the caller's filters
        searches = [("all", flt, default_size)]
    else:
        allowed = set(flt.collections) if flt.collections else {"faq", "doc"}
        searches = [(name, dataclasses.replace(flt, collections=(name,)), size)
                    for name, on, size in (("faq", req.plan.run_faq, req.plan.faq_top_k),
                                           ("doc", req.plan.run_doc, req.plan.doc_top_k))
                    if on and name in allowed]
    # Every leg searches at least the service's usual depth (and deep enough to take over an
    # empty collection's share); each collection's fused list is cut to its size afterwards:
    # RRF over two plan-sized (8-10 deep) lists loses the answers that sit deep in one leg.
    depth = max(default_size, sum(size for _, _, size in searches))
    jobs = [(name, i, asyncio.ensure_future(_collect(search, q, f, legs, deadline, depth)))
            for name, f, size in searches for i, q in enumerate(variants)]
    try:
        await asyncio.gather(*(j for _, _, j in jobs))
    finally:
        for _, _, j in jobs:
            j.cancel()
    parts: list[tuple[str, LegRun]] = []
    fused_lists: list[list[Candidate]] = []
    for name, _, _ in searches:
        lists = []
        for coll, i, job in jobs:
            if coll != name:
                continue
            runs = job.result()
            label = name if len(variants) == 1 else f"{name}/variant {i}"
            parts.extend((label, r) for r in runs)
            hits = {r.report.kind: r.hits for r in runs}
            lists.append(fuse_by_leg(hits, fusion))
        fused_lists.append([c for c, _ in fuse_variants(lists)])
    per_collection = fused_lists if req.plan is None else cut_to_plan(fused_lists, [size for _, _, size in searches])
    ran = {r.report.kind for _, r in parts}
    runs = [_aggregate(kind, parts) for kind in SEARCH_LEGS if kind in ran or kind is not LegKind.KNN_LATIN]
    judge([c for lst in per_collection for c in lst], runs)
    merged = list(heapq.merge(*per_collection, key=lambda c: -c.quality))
    return PlannedSearch(runs, merged, variants)


def cut_to_plan(fused: list[list[Candidate]], sizes: list[int]) -> list[list[Candidate]]:
    """Each collection's fused list cut to its plan size; a collection that found nothing
    (the knowledge base has no FAQ entries, say) hands its share to the ones that did, so
    an FAQ-first plan (documents halved because the FAQ is expected to answer) does not
    starve the documents when there is no FAQ to answer."""
    found = [i for i, lst in enumerate(fused) if lst]
    spare = sum(size for lst, size in zip(fused, sizes) if not lst)
    extra = {i: spare // len(found) + (1 if n < spare % len(found) else 0) for n, i in enumerate(found)}
    return [lst[: size + extra.get(i, 0)] for i, (lst, size) in enumerate(zip(fused, sizes))]


_NOT_WORD = re.compile(r"[\W_]+")


def normalize_question(text: str) -> str:
    """NFKC, case-folded, without punctuation or spaces: "如何开具发票？" == "如何开具发票"."""
    return _NOT_WORD.sub("", unicodedata.normalize("NFKC", text).casefold())


def faq_question(c: Candidate) -> str:
    """An FAQ entry's question: its title, else its text up to the first question mark."""
    if c.chunk.title.strip():
        return c.chunk.title
    head = re.split(r"[?？]", c.chunk.text, maxsplit=1)[0]
    return head


def faq_direct_answer(candidates: Sequence[Candidate], threshold: float, exact_only: bool,
                      query: str) -> Candidate | None:
    """The best FAQ hit (highest calibrated quality) when it reaches the threshold, and,
    for an exact-only plan, when it is the query's own question."""
    faqs = [c for c in candidates if c.chunk.collection == "faq"]
    if not faqs:
        return None
    best = max(faqs, key=lambda c: c.quality)
    if best.quality < threshold:
        return None
    if exact_only and normalize_question(faq_question(best)) != normalize_question(query):
        return None
    return best
