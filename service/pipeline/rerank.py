"""The rerank stage: the reranker scores the fused head, which is then ordered by the
head order (pipeline/head_order.py); a reranker that is off, out of time or failing leaves
the fused order and says why in its leg report (a failure marks the attempt degraded).

Stored passage states are read for the head first and states the reranker had to compute
are offered for write-back (pipeline/rerank_states.py)."""

from __future__ import annotations

import asyncio
import time

from service.config import Config
from service.domain import LegKind, LegReport, LegStatus
from service.engines.base import Engine
from service.errors import DeadlineExceeded
from service.models.passage_states import rerank_passage_text
from service.models.runtime import ModelRuntime, Timing
from service.observability.metrics import ServiceMetrics
from service.pipeline.fusion import Candidate, is_cjk
from service.pipeline.head_order import HeadOrder, head_signals
from service.pipeline.legs import REPLY_MARGIN_S, classify_failure, leg_timing
from service.pipeline.request import AttemptRequest
from service.pipeline.rerank_states import StatesWriteBack, stored_states


class RerankStage:
    def __init__(self, cfg: Config, engine: Engine, runtime: ModelRuntime, *, head_order: HeadOrder,
                 unavailable: str = "", metrics: ServiceMetrics | None = None) -> None:
        self.cfg = cfg
        self.engine = engine
        self.runtime = runtime
        self.head_order = head_order
        self.unavailable = unavailable or "no reranker model configured"
        self.states_write_back = StatesWriteBack(engine, runtime.states_key, cfg.states_write_back, metrics=metrics)

    def skipped(self, req: AttemptRequest, detail: str) -> LegReport:
        """The report of a rerank that did not run: disabled by the request, no reranker,
        or ``detail`` (nothing to rerank)."""
        if req.rerank is False:
            detail = "disabled by request"
        elif self.runtime.reranker is None:
            detail = self.unavailable
        return LegReport(LegKind.RERANK, LegStatus.SKIPPED, 0.0, 0, detail)

    async def run(self, req: AttemptRequest, ranked: list[Candidate], deadline: float, query: str) -> LegReport:
        """Rerank the first ``rerank_top_n`` of ``ranked`` in place against ``query`` (the
        plan's rerank query); the head order's script is the request's, as for fusion. The
        report says what happened: OK (reranked, in the head order), SKIPPED, or TIMEOUT /
        ERROR (the fused order stands and the attempt is degraded)."""
        if req.rerank is False or self.runtime.reranker is None:
            return self.skipped(req, "")
        head = ranked[: self.cfg.rerank_top_n]
        t0 = time.monotonic()
        left = deadline - t0 - REPLY_MARGIN_S
        timing = Timing()
        try:
            if left <= 0:
                raise DeadlineExceeded("no time left for reranking")
            passages = [rerank_passage_text(c.chunk.title, c.chunk.breadcrumb, c.chunk.text) for c in head]
            states = await stored_states(self.engine, self.runtime.states_key, head, left)
            computed: dict[int, bytes] = {}
            scores, timing = await asyncio.wait_for(
                self.runtime.rerank(query, passages, t0 + left, states, computed),
                t0 + left - time.monotonic(),
            )
            self.states_write_back.offer(head, computed)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            status, detail = classify_failure(exc)
            return LegReport(LegKind.RERANK, status, (time.monotonic() - t0) * 1000, 0,
                             f"{detail}; fell back to the fused order", leg_timing(timing))
        for c, s in zip(head, scores):
            c.rerank_score = float(s)
        order = self.head_order.order(head_signals(head), is_cjk(req.query))
        head[:] = [head[i] for i in order]
        ranked[: len(head)] = head
        return LegReport(LegKind.RERANK, LegStatus.OK, (time.monotonic() - t0) * 1000, len(head), "",
                         leg_timing(timing))
