from __future__ import annotations

import pytest

from service.config import Config
from service.domain import LegKind
from service.errors import InvalidArgument
from service.pipeline.request import AttemptRequest, validate

CFG = Config()


def fields_of(req: AttemptRequest, reranker: bool = False) -> list[str]:
    with pytest.raises(InvalidArgument) as err:
        validate(req, CFG, reranker)
    return [v.field for v in err.value.violations]


def test_valid_request_passes() -> None:
    validate(AttemptRequest(query="hello", top_k=5), CFG, False)


@pytest.mark.parametrize("req,field", [
    (AttemptRequest(query="", top_k=5), "query"),
    (AttemptRequest(query="   ", top_k=5), "query"),
    (AttemptRequest(query="x" * (CFG.max_query_chars + 1), top_k=5), "query"),
    (AttemptRequest(query="q", top_k=0), "top_k"),
    (AttemptRequest(query="q", top_k=CFG.max_top_k + 1), "top_k"),
    (AttemptRequest(query="q", top_k=1, collections=("wiki",)), "filters.collections[0]"),
    (AttemptRequest(query="q", top_k=1, legs=(LegKind.RERANK,)), "options.legs[0]"),
    (AttemptRequest(query="q", top_k=1, min_quality=1.5), "options.min_quality"),
    (AttemptRequest(query="q", top_k=1, rerank=True), "options.rerank"),
])
def test_each_bad_field_is_named(req: AttemptRequest, field: str) -> None:
    assert field in fields_of(req)


def test_all_violations_reported_at_once() -> None:
    assert fields_of(AttemptRequest(query="", top_k=0)) == ["query", "top_k"]
