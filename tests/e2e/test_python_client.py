"""The Python client (clients/python) against the live demo server: typed results,
typed errors, the agent JSON, async and sync."""

from __future__ import annotations

import asyncio

import pytest

from retrieval_client import (
    InvalidArgumentError,
    NotFoundError,
    Outcome,
    RetrievalClient,
    SyncRetrievalClient,
)
from tests.support.harness import Live

pytestmark = pytest.mark.slow


async def test_async_client_typed_attempts_and_errors(demo: Live) -> None:
    async with RetrievalClient(demo.target) as client:
        attempt = await client.retrieve("how do I reset my password", top_k=2)
        assert attempt.found and attempt.outcome is Outcome.EVIDENCE_FOUND
        assert attempt.evidence[0].source_id == "kb-password-reset"
        assert {leg.kind for leg in attempt.legs} == {"BM25", "KNN", "RERANK"}
        # Calibrated quality: the hybrid alone (this server has no reranker) rarely reaches a level.
        assert attempt.relevance_level in ("PRECISE", "REFERENCE", None, "")
        empty = await client.retrieve("password", source_ids=["nope"])
        assert empty.outcome is Outcome.EMPTY and not empty.outcome.is_infrastructure_failure
        with pytest.raises(InvalidArgumentError) as err:
            await client.retrieve("", top_k=0, collections=["wiki"])
        assert set(err.value.fields) == {"query", "top_k", "filters.collections[0]"}
        with pytest.raises(NotFoundError):
            await client.get_attempt("missing")
        record = await client.get_attempt(attempt.attempt_id)
        assert record.query == "how do I reset my password"


async def test_lookup_json_is_ready_for_an_llm(demo: Live) -> None:
    async with RetrievalClient(demo.target) as client:
        found = await client.lookup("如何开具发票", top_k=1, tool_call_id="t1")
        assert found["evidence_status"] == "EVIDENCE_FOUND" and found["tool_call_id"] == "t1"
        assert found.get("relevance_level") in ("PRECISE", "REFERENCE", None)
        assert found["evidence"][0]["source"] == "faq-invoice-zh"
        none = await client.lookup("zebra", top_k=1, min_quality=0.99)
        assert none["evidence_status"] == "NO_EVIDENCE" and "relevance_level" not in none
        assert none["evidence"] == [] and none["returned_count"] == 0


async def test_sync_client(demo: Live) -> None:
    def work() -> tuple[str, str]:
        with SyncRetrievalClient(demo.target) as client:
            attempt = client.retrieve("what is new in v2.4", top_k=1)
            return attempt.outcome.value, attempt.evidence[0].version

    # The server shares this event loop, so the blocking client runs in a thread.
    assert await asyncio.to_thread(work) == ("EVIDENCE_FOUND", "v2.4")
