"""A bounded soak with periodic faults, then the recorded history checked for invariants.

    .venv/bin/pip install -e ".[bench]"; .venv/bin/python -m tests.load.soak [--minutes 10] [--rate 3] [--out .cache/soak]

Everything on loopback and started here: an OpenSearch node of our own
(deploy/opensearch/opensearch.sh, its own port), a TCP proxy in front of it
(tests/support/tcp_proxy.py), and ``python -m service serve`` on the proxy (the shipped
e5 int8 embedder and reranker). An open-loop client asks Retrieve at a fixed rate (demo
questions and off-topic ones, 2 s deadlines; one in ten cancels after its first event),
while an IngestStream writes one document at a time, and a fault schedule cycles through:
a black-holed proxy, a SIGSTOPped node, a burst that saturates the model pool, and clean
windows. Every call goes into the history (when it started and ended, the fault windows
it overlapped, what it saw); afterwards the ledger is read back and these invariants are
checked:

- every attempt has exactly one terminal outcome (one ``result`` event; the ledger holds
  the same outcome for it);
- no EMPTY while a leg failed (the ledger's legs say which);
- no EVIDENCE_FOUND delivered after the caller's deadline;
- the outcome mix matches the faults: a call that ran entirely inside an engine fault
  window ends TIMEOUT / BACKEND_ERROR (or a gRPC refusal), never EVIDENCE_FOUND or EMPTY;
  calls in clean windows mostly find evidence;
- no acknowledged document is lost (each is read back at its exact version);
- memory stays flat (server RSS at the end vs after warm-up).

Bounded in time and count; stops by itself; exits 1 on any violation. Not part of
``make test`` (it runs for minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import psutil

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc, types_pb2
from service.eval.answerability import GENERAL_OFF_TOPIC
from tests.load.loadgen import percentile
from tests.support.harness import demo_documents
from tests.support.demo_expectations import RANKING_CASES
from tests.support.service_live import ScriptNodes, ServiceProcess
from tests.support.tcp_proxy import TcpProxy

NODE_PORT = int(os.environ.get("OPENSEARCH_SOAK_PORT", "9297"))
DEADLINE_S = 2.0
ENGINE_FAULTS = ("blackhole", "sigstop")
# One cycle of the schedule: (window, seconds). Clean windows let the node recover.
CYCLE = (("clean", 12.0), ("blackhole", 5.0), ("clean", 12.0), ("sigstop", 5.0), ("clean", 12.0), ("burst", 4.0))
RECOVERY_S = 3.0  # after a fault ends, the engine reconnects and the node catches up
FAILURES = {"TIMEOUT", "BACKEND_ERROR"}


@dataclasses.dataclass
class Call:
    started: float
    ended: float = 0.0
    query: str = ""
    cancelled_by_us: bool = False
    status: str = ""  # OK or the gRPC status name
    results: int = 0  # `result` events seen
    outcome: str = ""
    attempt_id: str = ""
    degraded: bool = False
    burst: bool = False


@dataclasses.dataclass
class Window:
    kind: str
    start: float
    end: float


class Soak:
    def __init__(self, minutes: float, rate: float, seed: int) -> None:
        self.until = time.monotonic() + minutes * 60
        self.rate = rate
        self.rng = random.Random(seed)
        self.calls: list[Call] = []
        self.windows: list[Window] = []
        self.acked: dict[str, corpus_pb2.DocumentAck] = {}
        self.rss: list[tuple[float, int]] = []
        self.queries = [q for q, _ in RANKING_CASES] + [*GENERAL_OFF_TOPIC["en"][:4], *GENERAL_OFF_TOPIC["zh"][:4]]

    # -- the client ---------------------------------------------------------------------
    async def one(self, stub: retrieval_pb2_grpc.RetrievalServiceStub, burst: bool = False) -> None:
        call = Call(time.monotonic(), query=self.rng.choice(self.queries), burst=burst)
        call.cancelled_by_us = not burst and self.rng.random() < 0.1
        self.calls.append(call)
        stream = stub.Retrieve(retrieval_pb2.RetrieveRequest(query=call.query, top_k=5), timeout=DEADLINE_S)
        try:
            async for ev in stream:
                if call.cancelled_by_us:
                    stream.cancel()
                    break
                if ev.WhichOneof("event") == "result":
                    call.results += 1
                    call.outcome = types_pb2.AttemptOutcome.Name(ev.result.outcome).removeprefix("ATTEMPT_OUTCOME_")
                    call.attempt_id, call.degraded = ev.result.attempt_id, ev.result.degraded
            call.status = "CANCELLED" if call.cancelled_by_us else "OK"
        except grpc.aio.AioRpcError as err:
            call.status = err.code().name
        except asyncio.CancelledError:
            call.status = "CANCELLED"
        call.ended = time.monotonic()

    async def client(self, stub: retrieval_pb2_grpc.RetrievalServiceStub) -> None:
        tasks = []
        while time.monotonic() < self.until:
            tasks.append(asyncio.ensure_future(self.one(stub)))
            await asyncio.sleep(self.rng.expovariate(self.rate))
        await asyncio.gather(*tasks, return_exceptions=True)

    async def ingest(self, target: str) -> None:
        """One document at a time over one IngestStream, re-opened when a fault breaks it."""
        n = 0
        while time.monotonic() < self.until:
            async with grpc.aio.insecure_channel(target) as channel:
                stub = corpus_pb2_grpc.CorpusServiceStub(channel)

                async def docs() -> AsyncIterator[corpus_pb2.IngestStreamRequest]:
                    nonlocal n
                    while time.monotonic() < self.until:
                        n += 1
                        yield corpus_pb2.IngestStreamRequest(sequence=n, document=corpus_pb2.Document(
                            source_id=f"soak-{n}", version="v1", title=f"Soak note {n}",
                            text=f"Soak note {n}: kayak rental rules and pier hours. token soak{n}x",
                            collection=types_pb2.COLLECTION_DOC))
                        await asyncio.sleep(0.5)

                try:
                    async for resp in stub.IngestStream(docs(), timeout=self.until - time.monotonic() + 30):
                        for ack in resp.acks:
                            if ack.status == corpus_pb2.DOCUMENT_STATUS_INDEXED:
                                self.acked[ack.source_id] = ack
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(1.0)

    # -- the faults ---------------------------------------------------------------------
    async def faults(self, proxy: TcpProxy, node_pid: int, stub: retrieval_pb2_grpc.RetrievalServiceStub) -> None:
        i = 0
        while time.monotonic() < self.until:
            kind, seconds = CYCLE[i % len(CYCLE)]
            i += 1
            start = time.monotonic()
            seconds = min(seconds, max(0.0, self.until - start))
            if kind == "blackhole":
                proxy.blackhole()
            elif kind == "sigstop":
                os.kill(node_pid, signal.SIGSTOP)
            burst: list[asyncio.Future[None]] = []
            if kind == "burst":  # far more concurrent calls than the model pool takes
                burst = [asyncio.ensure_future(self.one(stub, burst=True)) for _ in range(48)]
            try:
                await asyncio.sleep(seconds)
            finally:
                if kind == "blackhole":
                    await proxy.resume()
                elif kind == "sigstop":
                    os.kill(node_pid, signal.SIGCONT)
                await asyncio.gather(*burst, return_exceptions=True)
            self.windows.append(Window(kind, start, time.monotonic()))

    async def memory(self, pid: int) -> None:
        proc = psutil.Process(pid)
        while time.monotonic() < self.until:
            self.rss.append((time.monotonic(), proc.memory_info().rss))
            await asyncio.sleep(5.0)

    # -- checks -------------------------------------------------------------------------
    def fault_during(self, c: Call) -> set[str]:
        return {w.kind for w in self.windows
                if w.kind != "clean" and w.start < c.ended + RECOVERY_S and c.started < w.end + RECOVERY_S}

    def inside_engine_fault(self, c: Call) -> bool:
        return any(w.kind in ENGINE_FAULTS and w.start <= c.started and c.ended <= w.end for w in self.windows)

    async def check(self, svc: ServiceProcess) -> dict[str, Any]:
        violations: list[str] = []
        stub = retrieval_pb2_grpc.RetrievalServiceStub(svc.channel)
        ledger_outcomes: dict[str, tuple[str, list[str]]] = {}
        for c in self.calls:
            if not c.attempt_id:
                continue
            try:
                got = await stub.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=c.attempt_id), timeout=10)
                a = got.attempt
                ledger_outcomes[c.attempt_id] = (types_pb2.AttemptOutcome.Name(a.outcome).removeprefix("ATTEMPT_OUTCOME_"),
                                                 [types_pb2.LegStatus.Name(leg.status) for leg in a.legs])
            except grpc.aio.AioRpcError as err:
                violations.append(f"attempt {c.attempt_id} ({c.outcome}) not in the ledger: {err.code().name}")
        for c in self.calls:
            if c.status == "OK" and c.results != 1:
                violations.append(f"{c.query!r}: {c.results} result events on a completed stream")
            if c.attempt_id in ledger_outcomes:
                outcome, legs = ledger_outcomes[c.attempt_id]
                if outcome != c.outcome:
                    violations.append(f"attempt {c.attempt_id}: client saw {c.outcome}, the ledger says {outcome}")
                if outcome == "EMPTY" and any(s in ("LEG_STATUS_TIMEOUT", "LEG_STATUS_ERROR") for s in legs):
                    violations.append(f"attempt {c.attempt_id}: EMPTY with a failed leg {legs}")
            if c.outcome == "EVIDENCE_FOUND" and c.ended - c.started > DEADLINE_S + 0.25:
                violations.append(f"{c.query!r}: EVIDENCE_FOUND {c.ended - c.started:.2f}s after the start "
                                  f"(deadline {DEADLINE_S}s)")
            if self.inside_engine_fault(c) and c.status == "OK" and c.outcome not in FAILURES:
                violations.append(f"{c.query!r}: {c.outcome} while the engine was unreachable")
        # Every acknowledged document, at its exact version.
        lost = []
        for source_id in sorted(self.acked):
            got = await svc.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id=f"{source_id}#0@v1"), timeout=10)
            if got.fidelity != corpus_pb2.FIDELITY_EXACT:
                lost.append(source_id)
        if lost:
            violations.append(f"{len(lost)} acknowledged documents lost: {lost[:5]}")
        warm = [r for t, r in self.rss if t > self.rss[0][0] + 60] or [r for _, r in self.rss]
        growth = (warm[-1] - warm[0]) / warm[0] if warm else 0.0
        if growth > 0.25:
            violations.append(f"server RSS grew {growth:.0%} after warm-up")

        def mix(calls: list[Call]) -> dict[str, int]:
            return dict(collections.Counter(c.outcome if c.status == "OK" else c.status for c in calls))

        clean = [c for c in self.calls if not self.fault_during(c) and not c.cancelled_by_us]
        found_clean = sum(c.outcome in ("EVIDENCE_FOUND", "INSUFFICIENT") for c in clean) / max(1, len(clean))
        if found_clean < 0.9:
            violations.append(f"clean windows: only {found_clean:.0%} of calls were answered")
        ok = [c.ended - c.started for c in self.calls if c.status == "OK"]
        return {
            "calls": len(self.calls), "windows": collections.Counter(w.kind for w in self.windows),
            "outcome_mix": mix(self.calls),
            "mix_by_window": {kind: mix([c for c in self.calls if kind in self.fault_during(c)])
                              for kind in ("blackhole", "sigstop", "burst")},
            "mix_clean": mix(clean), "answered_in_clean_windows": round(found_clean, 4),
            "p50_ms": round(percentile(ok, 50) * 1000, 1) if ok else None,
            "p99_ms": round(percentile(ok, 99) * 1000, 1) if ok else None,
            "acknowledged_documents": len(self.acked), "lost_documents": len(lost),
            "rss_mb_first_last": [round(warm[0] / 2**20), round(warm[-1] / 2**20)] if warm else [],
            "ledger_records_checked": len(ledger_outcomes),
            "violations": violations,
        }


async def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    nodes = ScriptNodes(port=NODE_PORT, nodes=1, heap="512m").start()
    proxy = await TcpProxy("127.0.0.1", NODE_PORT).start()
    data = Path(tempfile.mkdtemp(prefix="soak-"))
    svc = ServiceProcess.spawn(proxy.url, data, env={"RETRIEVAL_OPENSEARCH_INDEX_PREFIX": f"soak{int(time.time())}"})
    try:
        await svc.wait_serving(300)
        summary = await svc.ingest(demo_documents(), timeout=120)
        assert not summary.errors, summary.errors
        soak = Soak(args.minutes, args.rate, args.seed)
        stub = retrieval_pb2_grpc.RetrievalServiceStub(svc.channel)
        started = time.monotonic()
        await asyncio.gather(soak.client(stub), soak.ingest(svc.target), soak.faults(proxy, nodes.pids[0], stub),
                             soak.memory(svc.proc.pid))
        await asyncio.sleep(RECOVERY_S)
        report = await soak.check(svc)
        report["duration_s"] = round(time.monotonic() - started, 1)
        (out / "history.json").write_text(json.dumps([dataclasses.asdict(c) for c in soak.calls]))
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        print(json.dumps(report, indent=2, default=str))
        return 1 if report["violations"] else 0
    finally:
        await svc.stop()
        await proxy.close()
        nodes.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.load.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=3.0, help="Retrieve calls per second (open loop)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=".cache/soak")
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
