"""JSON forms of ledger records, shared by both stores (one schema on disk and in
OpenSearch), and the opaque page cursor."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import Any

from service.domain import AttemptRecord, LegKind, LegReport, LegStatus, LegTiming, Outcome
from service.ledger.base import GapRecord, GapState

_RECORD_FIELDS = {f.name for f in fields(AttemptRecord)}


def record_to_dict(record: AttemptRecord) -> dict[str, Any]:
    data = asdict(record)
    data["outcome"] = record.outcome.value
    data["legs"] = [{**asdict(leg), "kind": leg.kind.value, "status": leg.status.value} for leg in record.legs]
    return data


def record_from_dict(data: dict[str, Any]) -> AttemptRecord:
    data = dict(data)
    legs = []
    for leg in data.pop("legs", []):
        leg = dict(leg)
        timing = leg.pop("timing", None)
        legs.append(LegReport(kind=LegKind(leg.pop("kind")), status=LegStatus(leg.pop("status")),
                              timing=LegTiming(**timing) if timing else None, **leg))
    outcome = Outcome(data.pop("outcome"))
    # Fields a newer build wrote and this one does not know are ignored, not fatal.
    known = {k: v for k, v in data.items() if k in _RECORD_FIELDS}
    return AttemptRecord(outcome=outcome, legs=legs, **known)


def record_to_json(record: AttemptRecord) -> str:
    return json.dumps(record_to_dict(record), ensure_ascii=False)


def record_from_json(text: str) -> AttemptRecord:
    return record_from_dict(json.loads(text))


def gap_to_dict(gap: GapRecord) -> dict[str, Any]:
    data = asdict(gap)
    data["state"] = gap.state.value
    return data


def gap_from_dict(data: dict[str, Any]) -> GapRecord:
    data = dict(data)
    state = GapState(data.pop("state"))
    known = {f.name for f in fields(GapRecord)}
    return GapRecord(state=state, **{k: v for k, v in data.items() if k in known})


def cursor(created_at_ms: int, attempt_id: str) -> str:
    return f"{created_at_ms}:{attempt_id}"


def parse_cursor(token: str) -> tuple[int, str]:
    """Raises ValueError on a token this ledger did not issue."""
    ms, sep, attempt_id = token.partition(":")
    if not sep or not attempt_id:
        raise ValueError(token)
    return int(ms), attempt_id
