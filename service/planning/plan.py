"""The RetrievalPlan as the pipeline executes it, and the checks on a caller's own plan."""

from __future__ import annotations

from dataclasses import dataclass

from service.errors import FieldViolation


@dataclass(frozen=True)
class RetrievalPlan:
    run_faq: bool = True
    run_doc: bool = True
    faq_top_k: int = 20
    doc_top_k: int = 20
    rerank: bool = True
    faq_direct_threshold: float = 0.72
    faq_direct_exact_only: bool = False
    final_context_top_n: int = 4
    min_context_score: float = 0.0
    max_context_chars: int = 6000  # 0: the server's max_context_chars
    max_context_doc_chars: int = 0  # 0: no per-item limit
    use_query_variants: bool = False
    question_category: str = ""
    prefer_table: bool = False
    intent_rule_score: float = 0.0
    intent_decision_score: float = 0.0
    reason: str = ""
    intent: str = ""  # a classifier.Intent name; "" for a caller's plan that names none


def plan_violations(plan: RetrievalPlan, max_top_k: int, prefix: str = "plan") -> list[FieldViolation]:
    """What is wrong with a caller's explicit plan (field paths as the proto spells them)."""
    v: list[FieldViolation] = []
    if not plan.run_faq and not plan.run_doc:
        v.append(FieldViolation(f"{prefix}.run_faq", "a plan must search at least one collection (run_faq or run_doc)"))
    limit = 500
    for name, on in (("faq_top_k", plan.run_faq), ("doc_top_k", plan.run_doc)):
        value = getattr(plan, name)
        if on and not 1 <= value <= limit:
            v.append(FieldViolation(f"{prefix}.{name}", f"must be between 1 and {limit} when the collection is searched"))
    if not 1 <= plan.final_context_top_n <= max_top_k:
        v.append(FieldViolation(f"{prefix}.final_context_top_n", f"must be between 1 and {max_top_k}"))
    for name in ("faq_direct_threshold", "min_context_score", "intent_rule_score", "intent_decision_score"):
        if not 0.0 <= getattr(plan, name) <= 1.0:
            v.append(FieldViolation(f"{prefix}.{name}", "must be within [0, 1]"))
    return v
