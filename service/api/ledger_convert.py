"""Proto <-> domain conversion for LedgerService (kept apart from convert.py, which
serves the retrieval and corpus services)."""

from __future__ import annotations

from service._gen.retrieval.v1 import corpus_pb2, ledger_pb2, types_pb2
from service.api.convert import chunk_to_pb, leg_to_pb, outcome_to_pb
from service.domain import AttemptRecord
from service.ledger.base import GapRecord, GapState, PurgeReport
from service.ledger.operations import RunView
from service.ledger.rules import Citation, Resolution
from service.pipeline.replay import Replay

_GAP_KIND = {"USER_INFORMATION": types_pb2.GAP_KIND_USER_INFORMATION,
             "EXTERNAL_KNOWLEDGE": types_pb2.GAP_KIND_EXTERNAL_KNOWLEDGE}


def gap_state_to_pb(state: GapState) -> ledger_pb2.GapState.ValueType:
    return ledger_pb2.GapState.Value(f"GAP_STATE_{state.value}")


def citation_to_pb(c: Citation) -> ledger_pb2.CitationCheck:
    return ledger_pb2.CitationCheck(
        evidence_id=c.evidence_id, classification=ledger_pb2.CitationClass.Value(f"CITATION_CLASS_{c.status.value}"),
        attempt_ids=c.attempt_ids, observed_evidence_ids=c.observed_ids)


def gap_to_pb(g: GapRecord, critical_threshold: float, rejected: list[Citation] | None = None) -> ledger_pb2.Gap:
    return ledger_pb2.Gap(
        gap_id=g.gap_id, kind=_GAP_KIND.get(g.kind, types_pb2.GAP_KIND_UNSPECIFIED), question=g.question,
        rationale=g.rationale, criticality=g.criticality, targeted_query=g.targeted_query,
        state=gap_state_to_pb(g.state), reason=g.reason, supporting_evidence_ids=g.supporting_ids,
        contradicting_evidence_ids=g.contradicting_ids, missing_subclaims=g.missing_subclaims,
        created_at_ms=g.created_at_ms, updated_at_ms=g.updated_at_ms, resolved_by=g.resolved_by,
        rejected=[citation_to_pb(c) for c in rejected or []], critical=g.criticality >= critical_threshold)


def evidence_ref(evidence_id: str) -> ledger_pb2.EvidenceRef:
    head, _, version = evidence_id.rpartition("@")
    source, _, chunk = head.rpartition("#")
    return ledger_pb2.EvidenceRef(evidence_id=evidence_id, source_id=source,
                                  chunk_index=int(chunk) if chunk.isdigit() else 0, version=version)


def attempt_to_pb(a: AttemptRecord) -> ledger_pb2.RunAttempt:
    msg = ledger_pb2.RunAttempt(
        attempt_id=a.attempt_id, gap_id=a.gap_id, query=a.query,
        # The plan's reason once attempts run under retrieval plans (a field the record may not have yet).
        plan_reason=a.plan_reason,
        evidence=[evidence_ref(e) for e in a.evidence_ids], retrieved_count=a.retrieved_count,
        admissible_count=a.admissible_count, outcome=outcome_to_pb(a.outcome), stopping_reason=a.stopping_reason,
        legs=[leg_to_pb(x) for x in a.legs], principal=a.principal, model_ids=a.model_ids,
        created_at_ms=a.created_at_ms, total_ms=a.total_ms, requested_top_k=a.requested_top_k)
    if a.budget_before is not None:
        msg.budget_before = a.budget_before
    if a.budget_after is not None:
        msg.budget_after = a.budget_after
    return msg


def run_to_pb(v: RunView) -> ledger_pb2.Run:
    r = v.run
    return ledger_pb2.Run(
        run_id=r.run_id, created_at_ms=r.created_at_ms, require_gap=r.require_gap,
        budget=ledger_pb2.RunBudgetState(max_searches=r.max_searches, max_results_per_search=r.max_results_per_search,
                                         searches_used=r.searches_used, searches_left=r.searches_left),
        gaps=[gap_to_pb(g, v.critical_threshold) for g in v.gaps], open_critical_gaps=v.open_critical_gaps,
        attempts=[attempt_to_pb(a) for a in v.attempts], next_page_token=v.next_page_token)


def resolution_from_pb(m: ledger_pb2.ResolveGapRequest, principal: str) -> Resolution:
    name = ledger_pb2.GapState.Name(m.resolution) if m.resolution in ledger_pb2.GapState.values() else ""
    state = GapState(name.removeprefix("GAP_STATE_")) if name and name != "GAP_STATE_UNSPECIFIED" else GapState.OPEN
    return Resolution(state, tuple(m.supporting_evidence_ids), tuple(m.contradicting_evidence_ids),
                      tuple(m.missing_subclaims), m.note, principal)


def purge_to_pb(p: PurgeReport) -> ledger_pb2.PurgeRecord:
    return ledger_pb2.PurgeRecord(run_id=p.run_id, purged_at_ms=p.purged_at_ms, reason=p.reason,
                                  principal=p.principal, attempts_deleted=p.attempts, gaps_deleted=p.gaps,
                                  observations_deleted=p.observations)


def replay_to_pb(r: Replay) -> ledger_pb2.ReplayAttemptResponse:
    msg = ledger_pb2.ReplayAttemptResponse(attempt_id=r.record.attempt_id, run_id=r.record.run_id, query=r.record.query)
    for item in r.items:
        out = msg.evidence.add(evidence_id=item.evidence_id, available_versions=item.available_versions)
        if item.chunk is not None:
            out.fidelity = corpus_pb2.FIDELITY_EXACT
            out.evidence.CopyFrom(chunk_to_pb(item.chunk))
        else:
            out.fidelity = corpus_pb2.FIDELITY_DEGRADED
    if r.rerun is not None:
        c = r.rerun.changes
        msg.rerun.CopyFrom(ledger_pb2.RerunReport(
            rerun_attempt_id=r.rerun.attempt_id, outcome=outcome_to_pb(r.rerun.outcome), added=c.added,
            dropped=c.dropped, unchanged=c.unchanged,
            new_versions=[ledger_pb2.VersionChange(observed_evidence_id=a, current_evidence_id=b)
                          for a, b in c.new_versions]))
    return msg
