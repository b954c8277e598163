"""Runs the golden scenarios through the Python client (clients/python) and prints the
transcript as JSON, like clients/go/cmd/golden and clients/ts/test/golden.ts.

    python tests/e2e/clients/golden_python.py --target 127.0.0.1:50051 --scenarios golden_scenarios.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from retrieval_client import Attempt, RetrievalClient, RetrievalError


def _request(raw: dict[str, Any], client_name: str) -> tuple[str, int, dict[str, Any]]:
    options = {k: v for k, v in raw.items() if k not in ("query", "top_k", "budget")}
    if "budget" in raw:
        options["max_searches"] = raw["budget"]["max_searches"]
    if "run_id" in options:
        options["run_id"] = f"{options['run_id']}-{client_name}"
    return raw["query"], int(raw.get("top_k", 10)), options


def _attempt(a: Attempt) -> dict[str, Any]:
    return {
        "outcome": a.outcome.value, "infrastructure_failure": a.outcome.is_infrastructure_failure,
        "relevance_level": a.relevance_level or "", "stopping_reason": a.stopping_reason,
        "degraded": a.degraded, "legs": {leg.kind: leg.status for leg in a.legs},
        "evidence": [{"rank": e.rank, "evidence_id": e.evidence_id, "quality": e.quality} for e in a.evidence],
    }


def _error(err: RetrievalError) -> dict[str, Any]:
    return {"code": err.code.name, "fields": sorted(getattr(err, "fields", [])),
            "attempt_recorded": bool(err.attempt_id)}


async def _step(client: RetrievalClient, step: dict[str, Any], client_name: str) -> dict[str, Any]:
    query, top_k, options = _request(step["request"], client_name)
    try:
        if step["call"] == "retrieve":
            return _attempt(await client.retrieve(query, top_k, **options))
        if step["call"] == "lookup":
            return {"tool_result": await client.lookup(query, top_k, **options)}
        if step["call"] == "cancel_after_first_event":
            seen: list[str] = []

            async def read() -> None:
                async for event in client.events(query, top_k, **options):
                    seen.append(str(event.WhichOneof("event")))
                    reader.cancel()  # the caller goes away after the first event
                    await asyncio.sleep(1)  # the cancellation lands here

            reader = asyncio.ensure_future(read())
            try:
                await reader
            except asyncio.CancelledError:
                # Python's idiom for a caller going away; gRPC cancels the call with it.
                return {"events_before_cancel": seen, "error": {"code": "CANCELLED", "fields": [],
                                                                "attempt_recorded": False}}
            return {"events_before_cancel": seen, "error": None}
    except RetrievalError as err:
        return {"error": _error(err)}
    raise ValueError(f"unknown call {step['call']}")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--scenarios", required=True)
    parser.add_argument("--client", default="python")
    args = parser.parse_args()
    with open(args.scenarios, encoding="utf-8") as fh:
        spec = json.load(fh)
    clients: dict[str, RetrievalClient] = {}
    out = []
    try:
        for scenario in spec["scenarios"]:
            steps = []
            for step in scenario["steps"]:
                principal = step.get("as", "public")
                if principal not in clients:
                    clients[principal] = RetrievalClient(args.target, api_key=spec["api_keys"].get(principal, ""))
                steps.append(await _step(clients[principal], step, args.client))
            out.append({"name": scenario["name"], "steps": steps})
    finally:
        for c in clients.values():
            await c.close()
    json.dump({"client": "python", "scenarios": out}, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    asyncio.run(main())
