"""The golden test: the same scenarios (golden_scenarios.json: en, zh, a filter, an
ACL-restricted caller, an empty result, a bad request, an unauthenticated caller, a
budget-denied attempt, a cancelled stream) through the Python, Go and TypeScript clients
give the same evidence ids, ranks, qualities, outcomes, tool-result JSON and error codes,
and those are the right ones."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from tests.support.clients import GO_CLIENT, ROOT, SCENARIOS, ClientServer, need, run, ts_built

pytestmark = pytest.mark.slow


async def _transcript(client: str, server: ClientServer) -> dict[str, Any]:
    if client == "python":
        ran = await run(sys.executable, str(SCENARIOS.with_name("golden_python.py")), "--target", server.target,
                        "--scenarios", str(SCENARIOS), cwd=ROOT)
    elif client == "go":
        ran = await run(need("go"), "run", "./cmd/golden", "-target", server.target, "-scenarios", str(SCENARIOS),
                        cwd=GO_CLIENT)
    else:
        dist = await ts_built()
        ran = await run(need("node"), str(dist / "test" / "golden.js"), "--target", server.target,
                        "--scenarios", str(SCENARIOS), cwd=ROOT)
    ran.check(f"the {client} golden runner")
    transcript: dict[str, Any] = json.loads(ran.stdout)
    assert transcript["client"] == client
    return transcript


def _steps(transcript: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return {s["name"]: s["steps"] for s in transcript["scenarios"]}


def _ids(step: dict[str, Any]) -> list[str]:
    return [e["evidence_id"] for e in step["evidence"]]


async def test_python_go_and_typescript_clients_agree(client_server: ClientServer) -> None:
    transcripts = {c: await _transcript(c, client_server) for c in ("python", "go", "typescript")}
    golden = _steps(transcripts["python"])
    names = [s["name"] for s in json.loads(SCENARIOS.read_text())["scenarios"]]
    assert list(golden) == names

    # The golden transcript is right, not merely shared.
    en = golden["english"][0]
    assert en["outcome"] == "EVIDENCE_FOUND" and _ids(en)[0].startswith("kb-password-reset#")
    assert [e["rank"] for e in en["evidence"]] == [1, 2, 3]
    zh, zh_lookup = golden["chinese"]
    assert _ids(zh)[0].startswith("faq-invoice-zh#")
    tool = zh_lookup["tool_result"]
    assert tool["evidence_status"] == "EVIDENCE_FOUND" and tool["tool_call_id"] == "call-zh"
    assert tool["evidence"][0]["source"] == "faq-invoice-zh" and tool["returned_count"] == 1
    flt = golden["filter"][0]
    assert flt["outcome"] == "EVIDENCE_FOUND" and flt["legs"] == {"BM25": "OK", "KNN": "SKIPPED", "KNN_LATIN": "SKIPPED",
                                                          "RERANK": "SKIPPED"}
    assert {i.split("#")[0] for i in _ids(flt)} <= {"kb-billing", "kb-refund-zh"}
    public, support = golden["acl"]
    assert not any(i.startswith("internal-escalation#") for i in _ids(public))
    assert _ids(support)[0].startswith("internal-escalation#")
    empty, none = golden["empty"]
    assert empty["outcome"] == "EMPTY" and empty["evidence"] == [] and not empty["infrastructure_failure"]
    assert none["tool_result"]["evidence_status"] == "NO_EVIDENCE" and "relevance_level" not in none["tool_result"]
    assert golden["bad-request"][0]["error"] == {
        "code": "INVALID_ARGUMENT", "fields": ["filters.collections[0]", "query", "top_k"], "attempt_recorded": False}
    assert golden["unauthenticated"][0]["error"]["code"] == "UNAUTHENTICATED"
    first, denied, denied_lookup = golden["budget-denied"]
    assert first["outcome"] == "EVIDENCE_FOUND"
    assert denied["outcome"] == "BUDGET_DENIED" and denied["evidence"] == [] and denied["stopping_reason"] == "budget_exhausted"
    assert denied_lookup["error"]["code"] == "FAILED_PRECONDITION"
    cancelled = golden["cancelled-stream"][0]
    assert cancelled["events_before_cancel"] == ["leg"] and cancelled["error"]["code"] == "CANCELLED"

    for client in ("go", "typescript"):
        steps = _steps(transcripts[client])
        assert list(steps) == names, client
        for name in names:
            assert json.dumps(steps[name], sort_keys=True, ensure_ascii=False, indent=1) == json.dumps(
                golden[name], sort_keys=True, ensure_ascii=False, indent=1), f"{client} differs from python in {name!r}"
