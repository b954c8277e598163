"""The project's gRPC load generator: closed loop (N callers, each sending its next request
when the last one answered) and open loop (requests started at a fixed arrival rate,
whatever the server's latency, so overload shows as queueing or shedding instead of
slowing the generator down).

It drives any ``Call``: an async function that runs one request and returns the outcome
the caller saw (an attempt outcome such as ``EVIDENCE_FOUND``, or a gRPC status name such
as ``RESOURCE_EXHAUSTED``). ``grpc_call`` builds one for Retrieve or Lookup on any server
that speaks retrieval.v1 (ours, or the baseline in tests/load/baseline.py).

    .venv/bin/python -m tests.load.loadgen --target 127.0.0.1:50051 --rpc retrieve \\
        --concurrency 1,8,32 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from service._gen.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc, types_pb2

Call = Callable[[str], Awaitable[str]]
# Outcomes for Lookup (which has no outcome field): found / not found, else the status.
LOOKUP_FOUND, LOOKUP_NONE = "EVIDENCE_FOUND", "NO_EVIDENCE"


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in [0, 100]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-p * len(ordered) // 100))))
    return ordered[rank - 1]


@dataclass
class RunStats:
    label: str
    mode: str  # "closed" or "open"
    concurrency: int = 0  # closed loop
    rate: float = 0.0  # open loop: offered requests per second
    requests: int = 0
    elapsed_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    outcomes: Counter[str] = field(default_factory=Counter)
    cpu_s: float = 0.0  # server CPU seconds over the run (filled by the caller)

    @property
    def throughput(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def goodput(self) -> float:
        """Requests per second that were admitted (anything but RESOURCE_EXHAUSTED)."""
        admitted = self.requests - self.outcomes["RESOURCE_EXHAUSTED"]
        return admitted / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def p(self, q: float) -> float:
        return percentile(self.latencies_ms, q)

    def admitted_p(self, q: float, since_s: float = 0.0) -> float:
        """Percentile of the admitted requests' latencies; with ``since_s`` (open loop), only
        those that arrived that long after the run began."""
        return percentile([lat for lat, o, t in zip(self.latencies_ms, self._order, self._arrivals)
                           if o != "RESOURCE_EXHAUSTED" and t >= since_s], q)

    _order: list[str] = field(default_factory=list, repr=False)
    _arrivals: list[float] = field(default_factory=list, repr=False)  # seconds after the run began (open loop)

    def record(self, latency_ms: float, outcome: str, arrival_s: float = 0.0) -> None:
        self.requests += 1
        self.latencies_ms.append(latency_ms)
        self._order.append(outcome)
        self._arrivals.append(arrival_s)
        self.outcomes[outcome] += 1

    @property
    def cpu_ms_per_query(self) -> float:
        return 1000 * self.cpu_s / self.requests if self.requests else 0.0

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("latencies_ms", "_order", "_arrivals", "outcomes")}
        out.update(throughput=round(self.throughput, 2), goodput=round(self.goodput, 2), p50_ms=round(self.p(50), 2), p95_ms=round(self.p(95), 2),
                   p99_ms=round(self.p(99), 2), cpu_ms_per_query=round(self.cpu_ms_per_query, 2),
                   outcomes=dict(self.outcomes))
        return out


async def closed_loop(call: Call, queries: Sequence[str], concurrency: int, *, duration_s: float = 0.0,
                      requests: int = 0, label: str = "") -> RunStats:
    """``concurrency`` callers back to back until ``requests`` were sent (if set) or
    ``duration_s`` passed; queries are taken round-robin."""
    stats = RunStats(label, "closed", concurrency=concurrency)
    source = itertools.cycle(queries)
    sent = 0
    started = time.monotonic()
    until = started + duration_s if duration_s else float("inf")

    async def caller() -> None:
        nonlocal sent
        while time.monotonic() < until and (not requests or sent < requests):
            sent += 1
            query = next(source)
            t0 = time.perf_counter()
            outcome = await call(query)
            stats.record((time.perf_counter() - t0) * 1000, outcome)

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    stats.elapsed_s = time.monotonic() - started
    return stats


async def open_loop(call: Call, queries: Sequence[str], rate: float, duration_s: float, *,
                    label: str = "") -> RunStats:
    """Start one request every 1/rate seconds for ``duration_s`` (on schedule, however
    many are still running), then wait for all of them."""
    stats = RunStats(label, "open", rate=rate)
    source = itertools.cycle(queries)
    tasks: list[asyncio.Task[None]] = []

    async def one(query: str, arrival_s: float) -> None:
        t0 = time.perf_counter()
        outcome = await call(query)
        stats.record((time.perf_counter() - t0) * 1000, outcome, arrival_s)

    started = time.monotonic()
    n = int(rate * duration_s)
    for i in range(n):
        delay = started + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(next(source), i / rate)))
    await asyncio.gather(*tasks)
    stats.elapsed_s = time.monotonic() - started
    return stats


def request_for(query: str, *, rerank: bool, top_k: int = 10) -> retrieval_pb2.RetrieveRequest:
    mode = types_pb2.RERANK_MODE_ON if rerank else types_pb2.RERANK_MODE_OFF
    return retrieval_pb2.RetrieveRequest(query=query, top_k=top_k, options=retrieval_pb2.RetrievalOptions(rerank=mode))


def grpc_call(channel: grpc.aio.Channel, rpc: str, *, rerank: bool, timeout_s: float = 10.0, top_k: int = 10,
              ranked: dict[str, list[str]] | None = None) -> Call:
    """One Retrieve (the stream read to its result) or Lookup per call. With ``ranked``,
    the returned source ids are kept per query (for nDCG)."""
    stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)

    async def retrieve(query: str) -> str:
        try:
            outcome, ids = "NO_RESULT", []
            async for ev in stub.Retrieve(request_for(query, rerank=rerank, top_k=top_k), timeout=timeout_s):
                kind = ev.WhichOneof("event")
                if kind == "evidence":
                    ids.append(ev.evidence.source_id)
                elif kind == "result":
                    outcome = types_pb2.AttemptOutcome.Name(ev.result.outcome).removeprefix("ATTEMPT_OUTCOME_")
            if ranked is not None:
                ranked[query] = ids
            return outcome
        except grpc.aio.AioRpcError as err:
            return err.code().name

    async def lookup(query: str) -> str:
        try:
            res = await stub.Lookup(request_for(query, rerank=rerank, top_k=top_k), timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            return err.code().name
        if ranked is not None:
            ranked[query] = [e.source for e in res.evidence]
        return LOOKUP_FOUND if res.evidence_status == types_pb2.EVIDENCE_STATUS_EVIDENCE_FOUND else LOOKUP_NONE

    if rpc not in ("retrieve", "lookup"):
        raise ValueError(f"rpc must be retrieve or lookup, not {rpc!r}")
    return retrieve if rpc == "retrieve" else lookup


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="closed/open-loop gRPC load against a retrieval.v1 server")
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--rpc", choices=["retrieve", "lookup"], default="retrieve")
    p.add_argument("--rerank", action="store_true")
    p.add_argument("--concurrency", default="1,8,32", help="closed loop levels (comma-separated)")
    p.add_argument("--rate", type=float, default=0.0, help="open loop at this many requests/s instead")
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--queries", default="", help="a file with one query per line (default: the demo questions)")
    args = p.parse_args(argv)
    if args.queries:
        with open(args.queries, encoding="utf-8") as fh:
            queries = [line.strip() for line in fh if line.strip()]
    else:
        from tests.support.demo_expectations import RANKING_CASES

        queries = [q for q, _ in RANKING_CASES]

    async def run() -> None:
        async with grpc.aio.insecure_channel(args.target) as channel:
            call = grpc_call(channel, args.rpc, rerank=args.rerank)
            if args.rate:
                runs = [await open_loop(call, queries, args.rate, args.duration, label=args.rpc)]
            else:
                runs = [await closed_loop(call, queries, int(c), duration_s=args.duration, label=args.rpc)
                        for c in args.concurrency.split(",")]
            for r in runs:
                print(json.dumps(r.summary()))

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
