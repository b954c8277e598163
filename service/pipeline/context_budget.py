"""The plan's context budget: how many items (final_context_top_n), how many characters
per item (max_context_doc_chars) and in all (max_context_chars)."""

from __future__ import annotations

from collections.abc import Sequence

from service.pipeline.fusion import Candidate
from service.pipeline.postprocess import Budgeted
from service.planning.plan import RetrievalPlan


def _cap(excerpt: str, context: str, limit: int) -> tuple[str, str, bool]:
    """Cut context first, then the excerpt, to ``limit`` characters in all."""
    if len(excerpt) + len(context) <= limit:
        return excerpt, context, False
    if len(excerpt) >= limit:
        return excerpt[:limit], "", True
    return excerpt, context[: limit - len(excerpt)], True


def apply_plan_budget(
    candidates: Sequence[Candidate], top_k: int, plan: RetrievalPlan, default_max_chars: int
) -> tuple[list[Budgeted], bool]:
    """Items in order while they fit. ``truncated`` when the budget cut or dropped
    something the caller would otherwise get: characters always; the item count only
    when the caller's top_k asked for more than final_context_top_n (top_k 0 means "the
    plan decides", so the plan's own count is then no cut)."""
    n = plan.final_context_top_n if top_k == 0 else min(top_k, plan.final_context_top_n)
    truncated = top_k > n and len(candidates) > n
    left = plan.max_context_chars or default_max_chars
    out: list[Budgeted] = []
    for c in candidates[:n]:
        if left <= 0:
            truncated = True
            break
        excerpt = c.chunk.text
        context = c.chunk.parent_text if c.chunk.parent_text != c.chunk.text else ""
        if plan.max_context_doc_chars:
            excerpt, context, cut = _cap(excerpt, context, plan.max_context_doc_chars)
            truncated |= cut
        excerpt, context, cut = _cap(excerpt, context, left)
        truncated |= cut
        left -= len(excerpt) + len(context)
        out.append(Budgeted(c, excerpt, context))
    return out, truncated
