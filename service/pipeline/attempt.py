"""One retrieval attempt: policy -> legs -> fuse -> rerank -> post-process -> outcome.

The runner is an async generator of typed events (leg reports as legs finish, evidence
in final order, then exactly one result). Every attempt that reaches the policy checks is
recorded in the ledger, whatever its outcome, including a caller that cancels.

Outcome rules (shared/DESIGN.md section 2):
- EMPTY only when every planned leg finished OK and nothing matched;
- no usable result and a leg that did not finish: BACKEND_ERROR if any leg errored,
  else TIMEOUT;
- evidence from the survivors of a failed leg is marked degraded;
- a reranker that times out or fails falls back to the fused order, marked degraded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from service.config import Config
from service.domain import (
    GapKind,
    LegKind,
    LegReport,
    LegStatus,
    LegTiming,
    Outcome,
    QualitySource,
    RelevanceLevel,
)
from service.engines.base import (
    Engine,
    PartialReason,
    SearchFilter,
    SearchResponse,
    VectorField,
)
from service.errors import DeadlineExceeded
from service.ledger.base import NO_GAP_IN_RUN, RUN_NOT_OWNED, Ledger, LedgerUnavailable
from service.ledger.writer import AttemptWriter
from service.models.runtime import ModelRuntime, Timing
from service.observability.logs import ATTEMPT_LOGGER, current_attempt_id
from service.observability.metrics import ServiceMetrics
from service.observability.tracing import AttemptTrace, Tracer
from service.pipeline.fusion import (
    Candidate,
    FusionParams,
    fuse_by_leg,
    fusion_for,
    is_cjk,
    leg_weight,
    max_rrf_score,
)
from service.pipeline.context_budget import apply_plan_budget
from service.pipeline.head_order import HeadOrder
from service.pipeline.legs import REPLY_MARGIN_S, classify_failure, leg_timing
from service.pipeline.legs import LegRun as _LegRun
from service.pipeline.plan_execution import faq_direct_answer, rerank_query, search_planned
from service.pipeline.rerank import RerankStage
from service.pipeline.postprocess import Deduped, admissible, apply_context_budget
from service.pipeline.quality import QualityModel, leg_set
from service.pipeline.recording import entry_for, new_attempt_id, reserve
from service.pipeline.relevance import relevance_level
from service.pipeline.request import AttemptRequest, Principal
from service.planning.plan import RetrievalPlan

CHANNEL = "knowledge_base"
# One DEBUG line per finished attempt; `serve --log-json` turns this logger on (JSON lines).
_attempt_log = logging.getLogger(ATTEMPT_LOGGER)


@dataclass
class EvidenceOut:
    candidate: Candidate
    rank: int
    excerpt: str
    context: str
    # Provenance: the attempt that returned it and the gap it was acquired for.
    attempt_id: str = ""
    gap_id: str = ""


@dataclass
class AttemptResultOut:
    attempt_id: str
    outcome: Outcome
    relevance_level: RelevanceLevel = RelevanceLevel.NONE
    returned_count: int = 0
    truncated: bool = False
    degraded: bool = False
    legs: list[LegReport] = field(default_factory=list)
    stopping_reason: str = ""
    retrieved_count: int = 0
    admissible_count: int = 0
    quality_source: QualitySource = QualitySource.NONE
    top_quality: float = 0.0
    retried_unfiltered: bool = False
    budget_before: int | None = None
    budget_after: int | None = None
    timing: LegTiming = field(default_factory=LegTiming)
    total_ms: float = 0.0
    model_ids: list[str] = field(default_factory=list)
    engine: str = ""
    # Retrieved but inadmissible (draft, retired, wrong version): observed, never returned.
    inadmissible_ids: list[str] = field(default_factory=list)
    # Plan execution (None / empty without a plan).
    plan: RetrievalPlan | None = None
    faq_direct: bool = False
    faq_direct_evidence_id: str = ""
    query_variants: list[str] = field(default_factory=list)

    @property
    def evidence_found(self) -> bool:
        return self.outcome is Outcome.EVIDENCE_FOUND


@dataclass
class LegEvent:
    report: LegReport


@dataclass
class EvidenceEvent:
    evidence: EvidenceOut


@dataclass
class ResultEvent:
    result: AttemptResultOut


Event = LegEvent | EvidenceEvent | ResultEvent


def _from_response(kind: LegKind, resp: SearchResponse, latency_ms: float) -> _LegRun:
    if resp.complete:
        status, detail = LegStatus.OK, ""
    elif resp.partial_reason is PartialReason.TIMED_OUT:
        status, detail = LegStatus.TIMEOUT, resp.detail or "engine reported timed_out"
    else:
        status, detail = LegStatus.ERROR, resp.detail or "engine reported failed shards"
    return _LegRun(LegReport(kind, status, latency_ms, len(resp.hits), detail), resp.hits)


class AttemptRunner:
    def __init__(self, cfg: Config, engine: Engine, runtime: ModelRuntime, ledger: Ledger, *,
                 head_order: HeadOrder | None = None, rerank_unavailable: str = "",
                 quality: QualityModel | None = None, writer: AttemptWriter | None = None,
                 metrics: ServiceMetrics | None = None, tracer: Tracer | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.tracer = tracer or Tracer()
        self.tracer.engine = engine.name
        self.tracer.models = {"KNN": runtime.embedder.info.model_id,
                              "RERANK": runtime.reranker.info.model_id if runtime.reranker else ""}
        # The legs an attempt runs unless the request names some: the Latin-script dense leg
        # too when its embedder is served (it skips queries with Han characters itself).
        latin = runtime.latin_embedder
        self.latin = latin is not None
        if latin is not None:
            self.tracer.models["KNN_LATIN"] = latin.info.model_id
        self.default_legs = (LegKind.BM25, LegKind.KNN) + ((LegKind.KNN_LATIN,) if self.latin else ())
        # Why the Latin-script leg is not searched yet ("" = it is): set while the store
        # catches up on chunks ingested before the leg was served (ingest/backfill.py).
        self.latin_pending = ""
        self.quality = quality or QualityModel()
        self.engine = engine
        self.runtime = runtime
        self.ledger = ledger
        self.writer = writer or AttemptWriter(ledger)
        self.rerank = RerankStage(cfg, engine, runtime, head_order=head_order or HeadOrder.from_alpha(1.0),
                                  unavailable=rerank_unavailable, metrics=metrics)

    @property
    def model_ids(self) -> list[str]:
        return [f"{i.model_id}@{i.sha256[:12]}" for i in self.runtime.model_infos]

    # -- legs -------------------------------------------------------------------------

    async def _bm25(self, query: str, flt: SearchFilter, share_s: float, size: int) -> _LegRun:
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(share_s):  # not wait_for: no extra task per leg
                resp = await self.engine.bm25(query, size, flt, share_s)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            status, detail = classify_failure(exc)
            return _LegRun(LegReport(LegKind.BM25, status, (time.monotonic() - t0) * 1000, 0, detail), [])
        return _from_response(LegKind.BM25, resp, (time.monotonic() - t0) * 1000)

    async def _knn(self, query: str, flt: SearchFilter, share_s: float, size: int,
                   kind: LegKind = LegKind.KNN) -> _LegRun:
        """The kNN leg, or with ``kind`` KNN_LATIN the Latin-script embedder's."""
        latin = kind is LegKind.KNN_LATIN
        t0 = time.monotonic()
        deadline = t0 + share_s
        timing = Timing()
        try:
            async with asyncio.timeout(share_s):
                vector, timing = await self.runtime.embed_query(query, deadline, latin=latin)
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded("no time left for the vector search after embedding")
            async with asyncio.timeout(left):
                resp = await self.engine.knn(vector, size, flt, left, VectorField.LATIN if latin else VectorField.PRIMARY)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            status, detail = classify_failure(exc)
            report = LegReport(kind, status, (time.monotonic() - t0) * 1000, 0, detail, leg_timing(timing))
            return _LegRun(report, [])
        run = _from_response(kind, resp, (time.monotonic() - t0) * 1000)
        run.report.timing = leg_timing(timing)
        return run

    async def _search(
        self, query: str, flt: SearchFilter, legs: tuple[LegKind, ...], deadline: float, size: int
    ) -> AsyncIterator[_LegRun]:
        share = max(0.0, (deadline - time.monotonic() - REPLY_MARGIN_S) * self.cfg.retrieval_share)
        calls: list[Awaitable[_LegRun]] = []
        if LegKind.BM25 in legs:
            calls.append(self._bm25(query, flt, share, size))
        if LegKind.KNN in legs:
            calls.append(self._knn(query, flt, share, size))
        latin_skipped = ""
        if LegKind.KNN_LATIN in legs:
            if not self.latin:
                latin_skipped = "no Latin-script embedder is served (latin_embedding_model)"
            elif self.latin_pending:
                latin_skipped = self.latin_pending
            elif is_cjk(query):
                latin_skipped = "the query has Han characters"
            else:
                calls.append(self._knn(query, flt, share, size, LegKind.KNN_LATIN))
        tasks = [asyncio.ensure_future(c) for c in calls]
        if latin_skipped:
            yield _LegRun(LegReport(LegKind.KNN_LATIN, LegStatus.SKIPPED, 0.0, 0, latin_skipped), [])
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for t in tasks:
                t.cancel()

    # -- the attempt ------------------------------------------------------------------

    async def run(
        self, req: AttemptRequest, principal: Principal, deadline: float
    ) -> AsyncIterator[Event]:
        """Run one attempt. ``deadline`` is absolute, on the time.monotonic() clock."""
        started = time.monotonic()
        attempt_id = new_attempt_id()
        current_attempt_id.set(attempt_id)  # JSON log lines of this task carry it
        trace = self.tracer.begin(attempt_id)
        result = AttemptResultOut(attempt_id, Outcome.EMPTY, model_ids=self.model_ids, engine=self.engine.name)
        evidence: list[EvidenceOut] = []
        try:
            async for event in self._run(req, principal, deadline, result, evidence):
                if trace is not None and isinstance(event, LegEvent):
                    trace.leg_seen(event.report)
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            result.outcome, result.stopping_reason = Outcome.CANCELLED, "cancelled"
            evidence = []
            self._record(req, principal, result, evidence, started, trace)
            raise
        self._record(req, principal, result, evidence, started, trace)
        yield ResultEvent(result)

    def _record(
        self, req: AttemptRequest, principal: Principal, result: AttemptResultOut,
        evidence: list[EvidenceOut], started: float, trace: AttemptTrace | None = None,
    ) -> None:
        """Hand the attempt to the ledger writer (the caller never waits on this write),
        the metrics and the tracer."""
        result.total_ms = (time.monotonic() - started) * 1000
        self.writer.submit(entry_for(req, principal, result, evidence, CHANNEL, self.cfg))
        if self.metrics is not None:
            self.metrics.attempt_finished(result.outcome, result.total_ms / 1000, result.legs)
        self.tracer.finish(trace, result.outcome, result.legs, result.stopping_reason)
        _attempt_log.debug("attempt %s", result.outcome.value, extra={
            "attempt_id": result.attempt_id, "outcome": result.outcome.value,
            "stopping_reason": result.stopping_reason, "total_ms": round(result.total_ms, 3),
            "returned": result.returned_count, "degraded": result.degraded})

    async def _run(
        self, req: AttemptRequest, principal: Principal, deadline: float,
        result: AttemptResultOut, evidence: list[EvidenceOut],
    ) -> AsyncIterator[Event]:
        cfg = self.cfg
        # 1. Policy: the gap kind, then the budget. Nothing is searched when refused.
        if req.gap is not None and req.gap.kind is GapKind.USER_INFORMATION:
            result.outcome = Outcome.PERMISSION_DENIED
            result.stopping_reason = "gap_kind_user_information"
            return
        top_k = req.top_k
        if req.run_id:
            try:
                decision = await reserve(self.ledger, req, cfg, principal)
            except LedgerUnavailable:
                # The budget cannot be enforced: nothing is searched, and that is an
                # infrastructure failure, never EMPTY (README "The evidence ledger").
                result.outcome, result.stopping_reason = Outcome.BACKEND_ERROR, "ledger_unavailable"
                return
            result.budget_before, result.budget_after = decision.before, decision.after
            if decision.reason in (NO_GAP_IN_RUN, RUN_NOT_OWNED):
                result.outcome, result.stopping_reason = Outcome.PERMISSION_DENIED, decision.reason
                return
            if not decision.allowed:
                result.outcome, result.stopping_reason = Outcome.BUDGET_DENIED, "budget_exhausted"
                return
            top_k = min(top_k, decision.max_results_per_search)

        legs = req.legs or self.default_legs
        fusion = fusion_for(req.query, cfg, latin=self.latin and not self.latin_pending and LegKind.KNN_LATIN in legs)
        acl = None if principal.unrestricted else principal.groups
        flt = SearchFilter(req.collections, req.source_ids, dict(req.metadata), acl)

        # 2. Legs, concurrently; retried once without the category filter when weak. A plan
        # (or query variants) searches each collection and variant on its own and merges.
        runs: list[_LegRun] = []
        retry_keys = [k for k in cfg.retry_unfiltered_keys if k in flt.metadata]
        if req.plan is not None or req.query_variants:
            def judge(cands: list[Candidate], legs_run: list[_LegRun]) -> None:
                self._provisional_quality(cands, legs_run, fusion, req.query)

            searched = await search_planned(self._search, req, flt, legs, deadline, fusion, cfg.candidates_per_leg, judge)
            runs, candidates, result.query_variants, result.plan = searched.runs, searched.candidates, searched.variants, req.plan
            for r in runs:
                yield LegEvent(r.report)
        else:
            async for r in self._emit_legs(req, flt, legs, deadline):
                runs.append(r)
                yield LegEvent(r.report)  # as each leg finishes
            candidates = self._fuse(runs, fusion)
        if not result.query_variants and retry_keys and self._weak(candidates, runs, fusion, req.query) and time.monotonic() < deadline - REPLY_MARGIN_S:
            loose = SearchFilter(flt.collections, flt.source_ids,
                                 {k: v for k, v in flt.metadata.items() if k not in retry_keys}, flt.acl_groups)
            runs = []
            async for r in self._emit_legs(req, loose, legs, deadline):
                r.report.detail = (r.report.detail + " " if r.report.detail else "") + "(retry without category filter)"
                runs.append(r)
                yield LegEvent(r.report)
            candidates = self._fuse(runs, fusion)
            result.retried_unfiltered = True
        result.legs = [r.report for r in runs]
        failed = [r.report for r in runs if r.report.status not in (LegStatus.OK, LegStatus.SKIPPED)]
        result.degraded = bool(failed)
        result.retrieved_count = len(candidates)
        for r in runs:
            if r.report.timing:
                result.timing = result.timing.plus(r.report.timing)

        def infra_failure(reason: str) -> None:
            errored = any(f.status is LegStatus.ERROR for f in failed)
            result.outcome = Outcome.BACKEND_ERROR if errored else Outcome.TIMEOUT
            result.stopping_reason = reason

        if not candidates:
            if failed:
                infra_failure("legs_failed_no_hits")
            else:
                result.outcome, result.stopping_reason = Outcome.EMPTY, "completed_no_match"
            self._add_rerank_report(result, "nothing to rerank", req)
            return

        # 3. Admissibility and dedupe before reranking: never spend the model on drafts.
        statuses = cfg.admissible_statuses
        allowed = [c for c in candidates if admissible(c, statuses, req.version_pins)]
        result.admissible_count = len(allowed)
        kept = {id(c) for c in allowed}
        result.inadmissible_ids = [c.chunk.chunk_id for c in candidates if id(c) not in kept]
        if not allowed:
            self._add_rerank_report(result, "nothing admissible to rerank", req)
            if failed:
                infra_failure("legs_failed_none_admissible")
            else:
                result.outcome, result.stopping_reason = Outcome.INADMISSIBLE, "none_admissible"
            return
        # Deduped as far as read: the rerank head and the items returned (a plan's merge and
        # FAQ answer judge every item). The gate below reads on when min_quality drops some.
        deduped = Deduped(allowed, None if req.plan is not None or req.query_variants
                          else max(cfg.rerank_top_n, top_k))
        ranked = deduped.items

        # 4. Rerank (falls back to the fused order on timeout/failure, and says so).
        max_fused = self._max_fused(runs, fusion)
        reranked = await self._rerank(req, ranked, deadline, result, rerank_query(req))

        # 5. Quality, gate, relevance, budget.
        legs_key, answered_max = self._answered(runs, fusion)
        cjk = is_cjk(req.query)
        judgement = self.quality.judge(
            ranked, deduped.more, reranked=reranked, max_fused=max_fused, cjk=cjk, legs=legs_key,
            answered_max_fused=answered_max, min_quality=req.min_quality or cfg.min_quality, top_k=top_k)
        gated = judgement.gated
        # The list's quality is its judged item's: the top, or where the two-leg view judges
        # a three-leg list, the item BM25 and kNN rank best (QualityModel.judged_index).
        judged = ranked[judgement.judged]
        result.top_quality = judged.quality
        top_source = result.quality_source = judgement.sources[judgement.judged]
        if not gated:
            if failed:
                infra_failure("legs_failed_none_passed_gate")
            else:
                result.outcome, result.stopping_reason = Outcome.INSUFFICIENT, "below_quality_gate"
            return
        reference = self.quality.reference_threshold(top_source, cjk, legs_key, cfg.reference_threshold,
                                                     judged_jointly=judgement.first_stage is not None)
        result.relevance_level = relevance_level(judged.quality, cfg.precise_threshold, reference)
        budget = req.max_context_chars or cfg.max_context_chars
        if req.plan is not None:  # the FAQ direct answer goes first, then the plan's budget
            direct = faq_direct_answer(gated, req.plan.faq_direct_threshold, req.plan.faq_direct_exact_only, req.query)
            if direct is not None:
                gated = [direct] + [c for c in gated if c is not direct]
                result.faq_direct, result.faq_direct_evidence_id = True, direct.chunk.chunk_id
            items, truncated = apply_plan_budget(gated, top_k, req.plan, budget)
        else:
            items, truncated = apply_context_budget(gated, top_k, budget)
        result.truncated = truncated
        result.outcome, result.stopping_reason = Outcome.EVIDENCE_FOUND, (
            "completed_degraded" if result.degraded else "completed"
        )
        for rank, b in enumerate(items, start=1):
            out = EvidenceOut(b.candidate, rank, b.excerpt, b.context, result.attempt_id,
                              req.gap.gap_id if req.gap else "")
            evidence.append(out)
            yield EvidenceEvent(out)
        result.returned_count = len(evidence)

    async def _emit_legs(
        self, req: AttemptRequest, flt: SearchFilter, legs: tuple[LegKind, ...], deadline: float
    ) -> AsyncIterator[_LegRun]:
        skipped = [k for k in self.default_legs if k not in legs]
        async for run in self._search(req.query, flt, legs, deadline, self.cfg.candidates_per_leg):
            yield run
        for kind in skipped:
            yield _LegRun(LegReport(kind, LegStatus.SKIPPED, 0.0, 0, "not requested"), [])

    @staticmethod
    def _fuse(runs: list[_LegRun], fusion: FusionParams) -> list[Candidate]:
        return fuse_by_leg({r.report.kind: r.hits for r in runs}, fusion)

    @staticmethod
    def _max_fused(runs: list[_LegRun], fusion: FusionParams) -> float:
        """Best possible fused score over the planned legs: a leg that failed still counts,
        so a degraded single-leg answer can never look PRECISE by rank alone."""
        weights = [leg_weight(r.report.kind, fusion) for r in runs if r.report.status is not LegStatus.SKIPPED]
        return max_rrf_score(weights, fusion.rrf_k)

    @staticmethod
    def _answered(runs: list[_LegRun], fusion: FusionParams) -> tuple[str, float]:
        """Which legs answered (finished OK), as a leg set (``quality.leg_set``: quality
        calibrations are fitted per leg set), and the best fused score they could give."""
        ok = [r.report.kind for r in runs if r.report.status is LegStatus.OK]
        if not ok:  # partial hits from legs that did not finish: judge them as planned
            ok = [r.report.kind for r in runs if r.report.status is not LegStatus.SKIPPED]
        return leg_set(ok), max_rrf_score([leg_weight(k, fusion) for k in ok], fusion.rrf_k)

    def _weak(self, candidates: list[Candidate], runs: list[_LegRun], fusion: FusionParams, query: str) -> bool:
        if not candidates:
            return True
        best = max(candidates, key=lambda c: c.fused_score)
        self._provisional_quality([best], runs, fusion, query)
        return best.quality < self.cfg.retry_unfiltered_below

    def _provisional_quality(self, candidates: list[Candidate], runs: list[_LegRun], fusion: FusionParams,
                             query: str) -> None:
        """The hybrid calibrated quality before rerank (what the legs alone say)."""
        legs_key, answered_max = self._answered(runs, fusion)
        self.quality.assign_all(candidates, reranked=False, max_fused=self._max_fused(runs, fusion),
                                cjk=is_cjk(query), legs=legs_key, answered_max_fused=answered_max)

    def _add_rerank_report(self, result: AttemptResultOut, detail: str, req: AttemptRequest) -> None:
        """The rerank leg did not run (nothing to rerank, or the stage's own reason)."""
        result.legs.append(self.rerank.skipped(req, detail))

    async def _rerank(self, req: AttemptRequest, ranked: list[Candidate], deadline: float,
                      result: AttemptResultOut, query: str) -> bool:
        report = await self.rerank.run(req, ranked, deadline, query)
        result.legs.append(report)
        if report.status is LegStatus.OK:
            if report.timing is not None:
                result.timing = result.timing.plus(report.timing)
            return True
        if report.status is not LegStatus.SKIPPED:
            result.degraded = True  # the reranker failed or ran out of time: fused order served
        return False
