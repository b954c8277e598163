"""ReplayAttempt: the evidence an attempt returned, at the exact versions observed, and
optionally the same request run again today (outside any run: a re-run never touches the
run's budget) compared with what the attempt returned."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.domain import AttemptRecord, LegKind, Outcome
from service.engines.base import ChunkRecord, Engine
from service.ledger.base import Ledger, chunk_key
from service.pipeline.attempt import AttemptRunner, EvidenceEvent, ResultEvent
from service.pipeline.request import AttemptRequest, Principal


def rerun_request(data: dict[str, Any]) -> AttemptRequest:
    """The stored request, outside any run and gap."""
    return AttemptRequest(
        query=str(data["query"]), top_k=int(data["top_k"]), collections=tuple(data.get("collections", ())),
        source_ids=tuple(data.get("source_ids", ())), metadata=dict(data.get("metadata", {})),
        legs=tuple(LegKind(v) for v in data.get("legs", ())), rerank=data.get("rerank"),
        min_quality=float(data.get("min_quality", 0.0)), max_context_chars=int(data.get("max_context_chars", 0)),
        version_pins=dict(data.get("version_pins", {})),
    )


@dataclass
class Changes:
    added: list[str] = field(default_factory=list)  # chunks returned today, not then
    dropped: list[str] = field(default_factory=list)  # chunks returned then, not today
    new_versions: list[tuple[str, str]] = field(default_factory=list)  # (then, today) of one chunk
    unchanged: list[str] = field(default_factory=list)


def compare(then: list[str], today: list[str]) -> Changes:
    """Exact ids first; a chunk of ``then`` that is back today only at another version is a
    new version (not a drop plus an add)."""
    then_set, today_set = set(then), set(today)
    out = Changes(unchanged=[e for e in then if e in today_set])
    taken: set[str] = set()
    for eid in then:
        if eid in today_set:
            continue
        newer = [t for t in today if chunk_key(t) == chunk_key(eid) and t not in then_set and t not in taken]
        if newer:
            out.new_versions.append((eid, newer[0]))
            taken.add(newer[0])
        else:
            out.dropped.append(eid)
    out.added = [t for t in today if t not in then_set and t not in taken]
    return out


@dataclass
class ReplayedItem:
    evidence_id: str
    chunk: ChunkRecord | None  # None: that exact version is gone (fidelity degraded)
    available_versions: list[str]


@dataclass
class Rerun:
    attempt_id: str
    outcome: Outcome
    changes: Changes


@dataclass
class Replay:
    record: AttemptRecord
    items: list[ReplayedItem]
    rerun: Rerun | None = None


async def replay(
    ledger: Ledger, engine: Engine, runner: AttemptRunner, attempt_id: str, *, rerun: bool,
    principal: Principal, deadline: float,
) -> Replay | None:
    """None when the ledger has no such attempt. Raises LedgerUnavailable, EngineError."""
    record = await ledger.get_attempt(attempt_id)
    if record is None or not principal.owns(record.principal):
        return None  # another principal's attempt (its query, what it saw) answers like an unknown id
    found = {c.chunk_id: c for c in await engine.get_chunks(record.evidence_ids)} if record.evidence_ids else {}
    items = []
    for eid in record.evidence_ids:
        chunk = found.get(eid)  # exactly this id (version included), or nothing
        if chunk is not None and not principal.may_read(chunk.acl):
            chunk = None  # a caller that may not read it gets no text
        items.append(ReplayedItem(eid, chunk, await engine.versions(chunk_key(eid).rpartition("#")[0])))
    out = Replay(record, items)
    if rerun:
        stored = await ledger.attempt_request(attempt_id)
        req = rerun_request(stored) if stored else AttemptRequest(query=record.query, top_k=record.requested_top_k)
        today: list[str] = []
        result = None
        async for event in runner.run(req, principal, deadline):
            if isinstance(event, EvidenceEvent):
                today.append(event.evidence.candidate.chunk.chunk_id)
            elif isinstance(event, ResultEvent):
                result = event.result
        assert result is not None
        out.rerun = Rerun(result.attempt_id, result.outcome, compare(record.evidence_ids, today))
    return out
