"""Ledger rules without a store: resolution shapes and the re-run comparison."""

from __future__ import annotations

import pytest

from service.errors import InvalidArgument
from service.ledger.base import GapState
from service.ledger.rules import Resolution, validate_resolution
from service.pipeline.replay import compare


@pytest.mark.parametrize(("resolution", "fields"), [
    (Resolution(GapState.OPEN), {"resolution"}),
    (Resolution(GapState.RESOLVED), {"supporting_evidence_ids"}),
    (Resolution(GapState.PARTIAL, ("a#0@v1",), missing_subclaims=("  ",)), {"missing_subclaims"}),
    (Resolution(GapState.CONFLICTING, ("a#0@v1",)), {"contradicting_evidence_ids"}),
    (Resolution(GapState.RESOLVED, ("a#0@v1",), ("b#0@v1",)), {"contradicting_evidence_ids"}),
])
def test_malformed_resolutions_name_their_fields(resolution: Resolution, fields: set[str]) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_resolution(resolution)
    assert {v.field for v in err.value.violations} == fields


def test_unresolved_needs_no_evidence() -> None:
    validate_resolution(Resolution(GapState.UNRESOLVED, note="nothing in the KB"))


def test_rerun_comparison_by_chunk_and_version() -> None:
    then = ["a#0@v1", "b#0@v1", "c#1@v2"]
    today = ["a#0@v1", "b#0@v2", "d#0@v1", "b#0@v1x"]
    changes = compare(then, today)
    assert changes.unchanged == ["a#0@v1"]
    assert changes.new_versions == [("b#0@v1", "b#0@v2")]
    assert changes.dropped == ["c#1@v2"]
    assert changes.added == ["d#0@v1", "b#0@v1x"]
