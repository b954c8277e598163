"""Deterministic ledger rules: citation classes and gap resolutions. No model, no I/O:
the same observations always give the same answer, on either store."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from service.errors import FieldViolation, InvalidArgument
from service.ledger.base import GapRecord, GapState, Observation, chunk_key


class CitationStatus(enum.Enum):
    OBSERVED_IN_RUN = "OBSERVED_IN_RUN"
    OBSERVED_IN_OTHER_RUN = "OBSERVED_IN_OTHER_RUN"
    UNKNOWN = "UNKNOWN"
    VERSION_MISMATCH = "VERSION_MISMATCH"
    NOT_ADMISSIBLE = "NOT_ADMISSIBLE"


@dataclass(frozen=True)
class Citation:
    evidence_id: str
    status: CitationStatus
    # Attempts of this run that observed it (OBSERVED_IN_RUN, NOT_ADMISSIBLE).
    attempt_ids: tuple[str, ...] = ()
    # VERSION_MISMATCH: the ids of that chunk the run did observe.
    observed_ids: tuple[str, ...] = ()

    @property
    def valid(self) -> bool:
        return self.status is CitationStatus.OBSERVED_IN_RUN


def classify(evidence_id: str, in_run: Sequence[Observation], elsewhere: Sequence[Observation]) -> Citation:
    """Valid only when this run returned exactly this id as admissible evidence. Otherwise,
    in order: observed here but inadmissible; another version of the chunk observed here;
    observed by another run; unknown."""
    exact = [o for o in in_run if o.evidence_id == evidence_id]
    admitted = sorted({o.attempt_id for o in exact if o.admissible})
    if admitted:
        return Citation(evidence_id, CitationStatus.OBSERVED_IN_RUN, tuple(admitted))
    if exact:
        return Citation(evidence_id, CitationStatus.NOT_ADMISSIBLE, tuple(sorted({o.attempt_id for o in exact})))
    key = chunk_key(evidence_id)
    others = sorted({o.evidence_id for o in in_run if o.chunk_key == key})
    if others and "@" in evidence_id:
        return Citation(evidence_id, CitationStatus.VERSION_MISMATCH, observed_ids=tuple(others))
    if any(o.evidence_id == evidence_id for o in elsewhere):
        return Citation(evidence_id, CitationStatus.OBSERVED_IN_OTHER_RUN)
    return Citation(evidence_id, CitationStatus.UNKNOWN)


@dataclass(frozen=True)
class Resolution:
    """What a caller asks a gap to become."""

    state: GapState
    supporting_ids: tuple[str, ...] = ()
    contradicting_ids: tuple[str, ...] = ()
    missing_subclaims: tuple[str, ...] = ()
    note: str = ""
    principal: str = ""


@dataclass
class ResolutionOutcome:
    gap: GapRecord
    rejected: list[Citation] = field(default_factory=list)

    @property
    def applied(self) -> bool:
        return not self.rejected


def validate_resolution(r: Resolution) -> None:
    """Shape checks (INVALID_ARGUMENT naming the field) before the ledger is read."""
    bad: list[FieldViolation] = []
    if r.state is GapState.OPEN:
        bad.append(FieldViolation("resolution", "must be RESOLVED, PARTIAL, CONFLICTING or UNRESOLVED"))
    needs_support = r.state in (GapState.RESOLVED, GapState.PARTIAL, GapState.CONFLICTING)
    if needs_support and not r.supporting_ids:
        bad.append(FieldViolation("supporting_evidence_ids", f"{r.state.value} needs at least one supporting id"))
    if r.state is GapState.PARTIAL and not [s for s in r.missing_subclaims if s.strip()]:
        bad.append(FieldViolation("missing_subclaims", "PARTIAL needs the sub-claims still missing"))
    if r.state is GapState.CONFLICTING and not r.contradicting_ids:
        bad.append(FieldViolation("contradicting_evidence_ids", "CONFLICTING needs the evidence against"))
    if r.state is not GapState.CONFLICTING and r.contradicting_ids:
        bad.append(FieldViolation("contradicting_evidence_ids", "only a CONFLICTING resolution has evidence against"))
    if bad:
        raise InvalidArgument(bad)


def decide(gap: GapRecord, in_run: list[Observation], r: Resolution, now_ms: int) -> ResolutionOutcome:
    """Apply ``r`` when every cited id (for and against) was observed in this run as
    admissible evidence. Otherwise nothing the caller asked is applied: the gap keeps its
    state, and an OPEN gap becomes UNRESOLVED with reason ``support_rejected`` (so a draft
    that was retrieved can never resolve anything). Conflicting evidence keeps both sides."""
    cited = [*r.supporting_ids, *r.contradicting_ids]
    rejected = [c for c in (classify(i, in_run, ()) for i in dict.fromkeys(cited)) if not c.valid]
    if rejected:
        if gap.state is GapState.OPEN:
            gap.state = GapState.UNRESOLVED
        gap.reason = "support_rejected: " + ", ".join(f"{c.evidence_id} {c.status.value}" for c in rejected)
        gap.updated_at_ms = now_ms
        gap.resolved_by = r.principal
        return ResolutionOutcome(gap, rejected)
    gap.state = r.state
    gap.supporting_ids = list(dict.fromkeys(r.supporting_ids))
    gap.contradicting_ids = list(dict.fromkeys(r.contradicting_ids))
    gap.missing_subclaims = [s for s in r.missing_subclaims if s.strip()] if r.state is GapState.PARTIAL else []
    gap.reason = r.note
    gap.updated_at_ms = now_ms
    gap.resolved_by = r.principal
    return ResolutionOutcome(gap)


def open_critical(gaps: Sequence[GapRecord], threshold: float) -> int:
    """Critical gaps whose uncertainty is not gone: anything but RESOLVED (PARTIAL and
    CONFLICTING stay open)."""
    return sum(1 for g in gaps if g.criticality >= threshold and g.state is not GapState.RESOLVED)
