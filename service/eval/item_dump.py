"""The rows of ``service eval``'s item dumps (``runs/*.items.json``): one list per evidence
item, by position, so a dump of 1,000 questions stays small. The runner writes them; the
quality calibration fit and the rerank order fit read them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Position of each field in a row; None in a row = the leg missed the item (or it was not
# reranked). ``latin_dense`` came later: rows of older dumps end before it.
ITEM_COLUMNS = {"source_id": 0, "bm25": 1, "dense": 2, "fused": 3, "rerank": 4, "quality": 5, "latin_dense": 6}


def column(row: Sequence[Any], name: str) -> Any:
    """``row``'s value of ``name`` (None where an older row has no such column)."""
    i = ITEM_COLUMNS[name]
    return row[i] if i < len(row) else None
