"""The plan's context budget: how many items (final_context_top_n), how many characters
per item (max_context_doc_chars) and in all (max_context_chars)."""

from __future__ import annotations

from collections.abc import Sequence

from service.pipeline.fusion import Candidate
from service.pipeline.postprocess import Budgeted, apply_context_budget
from service.planning.plan import RetrievalPlan


def apply_plan_budget(
    candidates: Sequence[Candidate], top_k: int, plan: RetrievalPlan, default_max_chars: int
) -> tuple[list[Budgeted], bool]:
    """Items in order while they fit. ``truncated`` when the budget cut or dropped
    something the caller would otherwise get: characters always; the item count only
    when the caller's top_k asked for more than final_context_top_n (top_k 0 means "the
    plan decides", so the plan's own count is then no cut)."""
    n = plan.final_context_top_n if top_k == 0 else min(top_k, plan.final_context_top_n)
    items, cut = apply_context_budget(candidates, n, plan.max_context_chars or default_max_chars,
                                      plan.max_context_doc_chars)
    return items, cut or (top_k > n and len(candidates) > n)
