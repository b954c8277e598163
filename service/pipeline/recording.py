"""The ledger stages of an attempt: reserve a search of the run (the one ledger round trip
an attempt waits on) and build what the attempt writes (record, observations, gap)."""

from __future__ import annotations

import os
import random
import time
from typing import TYPE_CHECKING, Any

from service.config import Config
from service.domain import AttemptRecord
from service.ledger.base import RUN_NOT_OWNED, AttemptEntry, BudgetDecision, GapRecord, Ledger, Observation, RunState
from service.pipeline.request import AttemptRequest, Principal

if TYPE_CHECKING:
    from service.pipeline.attempt import AttemptResultOut, EvidenceOut


# Attempt ids: 128 random bits, as uuid4 has, from a generator seeded once per process
# (reseeded in a forked child) rather than os.urandom per attempt, a syscall that let go
# of the GIL on the event loop (1.8 % of its time at concurrency 32, mostly waiting to
# take it back). Ids need to be unique, not secret: GetAttempt checks the owner.
_ids = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(32)))


def new_attempt_id() -> str:
    """A new attempt id: 32 lowercase hex digits."""
    return f"{_ids.getrandbits(128):032x}"


def request_to_dict(req: AttemptRequest) -> dict[str, Any]:
    return {
        "query": req.query, "top_k": req.top_k, "collections": list(req.collections),
        "source_ids": list(req.source_ids), "metadata": dict(req.metadata), "legs": [leg.value for leg in req.legs],
        "rerank": req.rerank, "min_quality": req.min_quality, "max_context_chars": req.max_context_chars,
        "version_pins": dict(req.version_pins),
    }


async def reserve(ledger: Ledger, req: AttemptRequest, cfg: Config, principal: Principal) -> BudgetDecision:
    """Spend one search of ``req.run_id`` (created owned by ``principal``); raises LedgerUnavailable."""
    return await ledger.reserve_search(
        req.run_id, req.budget_max_searches or cfg.default_max_searches,
        req.budget_max_results or cfg.default_max_results_per_search,
        require_gap=req.require_gap, has_gap=req.gap is not None, owner=principal.name,
        sees_all=principal.unrestricted)


def entry_for(
    req: AttemptRequest, principal: Principal, result: AttemptResultOut, evidence: list[EvidenceOut], channel: str,
    cfg: Config,
) -> AttemptEntry:
    now = int(time.time() * 1000)
    gap_id = req.gap.gap_id if req.gap else ""
    # Refused for naming another principal's run: a fact of the caller's, written into
    # nothing of that run (not its attempts list, not its gaps).
    run_id = "" if result.stopping_reason == RUN_NOT_OWNED else req.run_id
    returned = [e.candidate.chunk.chunk_id for e in evidence]
    record = AttemptRecord(
        attempt_id=result.attempt_id, run_id=run_id, gap_id=gap_id, channel=channel, query=req.query,
        requested_top_k=req.top_k, outcome=result.outcome, stopping_reason=result.stopping_reason,
        principal=principal.name, created_at_ms=now, evidence_ids=returned,
        retrieved_count=result.retrieved_count, admissible_count=result.admissible_count,
        legs=list(result.legs), budget_before=result.budget_before, budget_after=result.budget_after,
        total_ms=result.total_ms, model_ids=result.model_ids,
        plan_reason=req.plan.reason if req.plan is not None else "",
    )
    observations: list[Observation] = []
    gap = None
    run = None
    if run_id:
        run = RunState(req.run_id, req.budget_max_searches or cfg.default_max_searches,
                       req.budget_max_results or cfg.default_max_results_per_search, 0, req.require_gap, now,
                       principal.name)
        observations = [Observation(req.run_id, eid, result.attempt_id, gap_id, True, now) for eid in returned]
        observations += [Observation(req.run_id, eid, result.attempt_id, gap_id, False, now)
                         for eid in dict.fromkeys(result.inadmissible_ids)]
        if req.gap is not None and req.gap.gap_id:
            g = req.gap
            gap = GapRecord(req.run_id, g.gap_id, g.kind.value, g.question, g.rationale, g.criticality,
                            g.targeted_query)
    return AttemptEntry(record, observations, gap, request_to_dict(req), run)
