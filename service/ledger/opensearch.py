"""The OpenSearch ledger: one ledger for every replica, on the cluster the engine uses.

Five indices under ``{prefix}-ledger-``: runs, attempts, observations, gaps, purges (one
shard, ``replicas`` replicas, so a 2-node cluster keeps the ledger when a node goes).

Budgets: the run document holds ``searches_used``. A reservation writes ``used + 1`` with
``if_seq_no``/``if_primary_term`` of the state it read, and on a version conflict reads the
run again and retries, so replicas on several hosts can never spend more than the budget.
Each process keeps the last state it saw (one lock per run inside the process), so the
common case costs one round trip, and a run it has seen exhausted is refused without any:
``searches_used`` only grows and the limit never changes.

Attempt writes are one ``_bulk`` (attempt, observations, gap upsert) with
``refresh=wait_for``, issued off the caller's path by ``service.ledger.writer``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from opensearchpy import AsyncOpenSearch
from opensearchpy.exceptions import ConflictError, NotFoundError, TransportError
from opensearchpy.exceptions import ConnectionError as OSConnectionError

from service.domain import AttemptRecord, Outcome
from service.ledger import codec
from service.ledger.base import (
    BUDGET_EXHAUSTED,
    AttemptEntry,
    BudgetDecision,
    GapDecision,
    GapRecord,
    Ledger,
    LedgerUnavailable,
    Observation,
    PurgeReport,
    RunState,
    budget_decision,
    chunk_key,
    registered_gap,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
JSON = dict[str, Any]

# Version conflicts a reservation rides out before it reports the ledger unavailable.
_MAX_CONFLICT_RETRIES = 64
_REFRESH_INTERVAL = "250ms"
# Most observations/gaps one run read returns (a run of 500 attempts x 20 evidence fits).
_MAX_READ = 10000

_KEYWORD = {"type": "keyword"}
_LONG = {"type": "long"}
_OPAQUE = {"type": "object", "enabled": False}
_MAPPINGS: dict[str, JSON] = {
    "runs": {"run_id": _KEYWORD, "max_searches": _LONG, "max_results_per_search": _LONG,
             "searches_used": _LONG, "require_gap": {"type": "boolean"}, "created_at_ms": _LONG,
             "owner": _KEYWORD},
    "attempts": {"run_id": _KEYWORD, "gap_id": _KEYWORD, "attempt_id": _KEYWORD, "outcome": _KEYWORD,
                 "created_at_ms": _LONG, "record": _OPAQUE, "request": _OPAQUE},
    "observations": {"run_id": _KEYWORD, "evidence_id": _KEYWORD, "chunk_key": _KEYWORD, "attempt_id": _KEYWORD,
                     "gap_id": _KEYWORD, "admissible": {"type": "boolean"}, "observed_at_ms": _LONG},
    "gaps": {"run_id": _KEYWORD, "gap_id": _KEYWORD, "state": _KEYWORD, "created_at_ms": _LONG, "gap": _OPAQUE},
    "purges": {"run_id": _KEYWORD, "purged_at_ms": _LONG, "report": _OPAQUE},
}

# An attempt refused for budget turns an OPEN gap UNRESOLVED (base.registered_gap, in painless).
_GAP_SCRIPT = (
    "if (params.denied && ctx._source.state == 'OPEN') {"
    " ctx._source.state = 'UNRESOLVED'; ctx._source.gap.state = 'UNRESOLVED';"
    " ctx._source.gap.reason = params.reason; ctx._source.gap.updated_at_ms = params.now;"
    "} else { ctx.op = 'none'; }"
)


@dataclass
class _RunSeen:
    state: RunState
    seq_no: int
    primary_term: int


def _run_doc(s: RunState) -> JSON:
    return {"run_id": s.run_id, "max_searches": s.max_searches, "max_results_per_search": s.max_results_per_search,
            "searches_used": s.searches_used, "require_gap": s.require_gap, "created_at_ms": s.created_at_ms,
            "owner": s.owner}


def _run_from(src: JSON) -> RunState:
    return RunState(src["run_id"], int(src["max_searches"]), int(src["max_results_per_search"]),
                    int(src["searches_used"]), bool(src.get("require_gap", False)), int(src["created_at_ms"]),
                    str(src.get("owner", "")))


def _obs_from(src: JSON) -> Observation:
    return Observation(src["run_id"], src["evidence_id"], src["attempt_id"], src.get("gap_id", ""),
                       bool(src["admissible"]), int(src["observed_at_ms"]))


class OpenSearchLedger(Ledger):
    kind = "opensearch"

    def __init__(self, url: str, index_prefix: str = "retrieval", replicas: int = 0, timeout_s: float = 2.0) -> None:
        self.url = url
        self.prefix = f"{index_prefix}-ledger"
        self.replicas = replicas
        self.timeout_s = timeout_s
        self._client = AsyncOpenSearch(hosts=[url], max_retries=0, retry_on_timeout=False, timeout=timeout_s,
                                       maxsize=32, http_compress=False)
        self._ready = False
        self._ready_lock = asyncio.Lock()
        self._runs: dict[str, _RunSeen] = {}
        self._run_locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    def index(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    async def _call(self, call: Awaitable[T], what: str, timeout_s: float | None = None) -> T:
        try:
            return await asyncio.wait_for(call, timeout_s or self.timeout_s)
        except (TimeoutError, OSConnectionError) as exc:  # ConnectionTimeout is an OSConnectionError
            raise LedgerUnavailable(f"opensearch ledger {what}: {type(exc).__name__} {exc}") from exc
        except (ConflictError, NotFoundError):
            raise
        except TransportError as exc:
            raise LedgerUnavailable(f"opensearch ledger {what}: HTTP {exc.status_code} {exc.error}") from exc

    async def _ensure(self) -> None:
        if self._ready:
            return
        async with self._ready_lock:
            if self._ready:
                return
            for name, props in _MAPPINGS.items():
                # Records are written with refresh=wait_for: a short interval keeps that wait (and
                # the writer's batches) small; the indices are small, so refreshing is cheap.
                body = {"settings": {"number_of_shards": 1, "number_of_replicas": self.replicas,
                                     "refresh_interval": _REFRESH_INTERVAL},
                        "mappings": {"dynamic": "strict", "properties": props}}
                try:
                    await self._call(self._client.indices.create(index=self.index(name), body=body), "create index",
                                     max(self.timeout_s, 30.0))
                except LedgerUnavailable as exc:
                    if "resource_already_exists" not in str(exc):
                        raise
                    # An index from an older version: add the fields it lacks (strict mappings
                    # refuse unknown fields; adding one in place is allowed).
                    await self._call(self._client.indices.put_mapping(index=self.index(name), body={"properties": props}),
                                     "update mapping", max(self.timeout_s, 30.0))
            self._ready = True

    async def start(self) -> None:
        if self._closed:
            raise LedgerUnavailable("ledger closed")
        try:
            await self._ensure()
        except LedgerUnavailable as exc:  # a node that comes up later is found on first use
            log.warning("opensearch ledger not ready at start: %s", exc)

    async def close(self) -> None:
        self._closed = True
        await self._client.close()

    async def drop(self) -> None:
        """Delete every ledger index (tests and benchmarks)."""
        await self._client.indices.delete(index=f"{self.prefix}-*", ignore_unavailable=True)
        self._ready = False

    # -- budget -----------------------------------------------------------------------------

    async def _read_run(self, run_id: str) -> _RunSeen | None:
        try:
            doc = await self._call(self._client.get(index=self.index("runs"), id=run_id), "read run")
        except NotFoundError:
            self._runs.pop(run_id, None)
            return None
        seen = _RunSeen(_run_from(doc["_source"]), int(doc["_seq_no"]), int(doc["_primary_term"]))
        self._runs[run_id] = seen
        return seen

    async def reserve_search(
        self, run_id: str, max_searches: int, max_results_per_search: int, *,
        require_gap: bool = False, has_gap: bool = True, owner: str = "", sees_all: bool = False,
    ) -> BudgetDecision:
        await self._ensure()
        lock = self._run_locks.setdefault(run_id, asyncio.Lock())
        async with lock:  # one reservation per run at a time inside this process
            for attempt in range(_MAX_CONFLICT_RETRIES):
                seen = self._runs.get(run_id)
                if seen is None:
                    state = RunState(run_id, max_searches, max_results_per_search, 0, require_gap,
                                     int(time.time() * 1000), owner)
                    decision = budget_decision(max_searches, 0, max_results_per_search, require_gap, has_gap)
                    if decision.allowed:
                        state = RunState(**{**state.__dict__, "searches_used": 1})
                    try:
                        resp = await self._call(self._client.index(
                            index=self.index("runs"), id=run_id, body=_run_doc(state), op_type="create"), "create run")
                    except ConflictError:  # another replica created it first: read and retry
                        await self._read_run(run_id)
                        continue
                    self._runs[run_id] = _RunSeen(state, int(resp["_seq_no"]), int(resp["_primary_term"]))
                    return decision
                s = seen.state
                decision = budget_decision(s.max_searches, s.searches_used, s.max_results_per_search,
                                           s.require_gap, has_gap, s.visible_to(owner, sees_all))
                if not decision.allowed:
                    return decision
                spent = RunState(**{**s.__dict__, "searches_used": s.searches_used + 1})
                try:
                    resp = await self._call(self._client.index(
                        index=self.index("runs"), id=run_id, body=_run_doc(spent),
                        params={"if_seq_no": seen.seq_no, "if_primary_term": seen.primary_term}), "reserve")
                except (ConflictError, NotFoundError):  # someone else spent first: read the new state
                    await self._read_run(run_id)
                    await asyncio.sleep(random.uniform(0, 0.002 * min(attempt, 10)))
                    continue
                self._runs[run_id] = _RunSeen(spent, int(resp["_seq_no"]), int(resp["_primary_term"]))
                return decision
        raise LedgerUnavailable(f"run {run_id}: budget still contended after {_MAX_CONFLICT_RETRIES} tries")

    async def get_run(self, run_id: str) -> RunState | None:
        await self._ensure()
        seen = await self._read_run(run_id)
        return seen.state if seen else None

    # -- attempts ---------------------------------------------------------------------------

    async def record(self, entries: Sequence[AttemptEntry]) -> None:
        await self._ensure()
        now = int(time.time() * 1000)
        ops: list[JSON] = []
        for e in entries:
            r = e.record
            if e.run is not None:  # exists already (409) in the common case: that is fine
                ops += [{"create": {"_index": self.index("runs"), "_id": e.run.run_id}}, _run_doc(e.run)]
            ops += [{"index": {"_index": self.index("attempts"), "_id": r.attempt_id}},
                    {"run_id": r.run_id, "gap_id": r.gap_id, "attempt_id": r.attempt_id, "outcome": r.outcome.value,
                     "created_at_ms": r.created_at_ms, "record": codec.record_to_dict(r), "request": e.request}]
            for o in e.observations:
                ops += [{"index": {"_index": self.index("observations"),
                                   "_id": f"{o.run_id}|{o.evidence_id}|{o.attempt_id}"}},
                        {"run_id": o.run_id, "evidence_id": o.evidence_id, "chunk_key": chunk_key(o.evidence_id),
                         "attempt_id": o.attempt_id, "gap_id": o.gap_id, "admissible": o.admissible,
                         "observed_at_ms": o.observed_at_ms}]
            if e.gap is not None and r.run_id:
                denied = r.outcome is Outcome.BUDGET_DENIED
                first = registered_gap(None, e.gap, denied, now)
                ops += [{"update": {"_index": self.index("gaps"), "_id": f"{r.run_id}|{e.gap.gap_id}",
                                    "retry_on_conflict": 10}},
                        {"script": {"source": _GAP_SCRIPT, "lang": "painless",
                                    "params": {"denied": denied, "reason": BUDGET_EXHAUSTED, "now": now}},
                         "upsert": self._gap_doc(first)}]
        if not ops:
            return
        resp = await self._call(self._client.bulk(body=ops, params={"refresh": "wait_for"}), "record",
                                max(self.timeout_s, 10.0))
        if resp.get("errors"):
            failed = [op for op in (next(iter(i.values())) for i in resp["items"])
                      if op.get("error") and not (op.get("status") == 409 and op.get("_index") == self.index("runs"))]
            if failed:
                raise LedgerUnavailable(
                    f"opensearch ledger record: {len(failed)} writes failed, first: {failed[0]['error']}")

    def _gap_doc(self, gap: GapRecord) -> JSON:
        return {"run_id": gap.run_id, "gap_id": gap.gap_id, "state": gap.state.value,
                "created_at_ms": gap.created_at_ms, "gap": codec.gap_to_dict(gap)}

    async def _get_source(self, index: str, doc_id: str, what: str) -> JSON | None:
        await self._ensure()
        try:
            doc = await self._call(self._client.get(index=self.index(index), id=doc_id), what)
        except NotFoundError:
            return None
        src: JSON = doc["_source"]
        return src

    async def get_attempt(self, attempt_id: str) -> AttemptRecord | None:
        src = await self._get_source("attempts", attempt_id, "read attempt")
        return codec.record_from_dict(src["record"]) if src else None

    async def attempt_request(self, attempt_id: str) -> dict[str, Any] | None:
        src = await self._get_source("attempts", attempt_id, "read attempt")
        return dict(src.get("request") or {}) if src else None

    async def _search(self, index: str, body: JSON, what: str) -> list[JSON]:
        await self._ensure()
        resp = await self._call(self._client.search(index=self.index(index), body=body), what)
        hits: list[JSON] = resp["hits"]["hits"]
        return hits

    async def list_attempts(self, run_id: str, after: str, limit: int) -> tuple[list[AttemptRecord], str]:
        body: JSON = {"query": {"term": {"run_id": run_id}}, "size": limit + 1,
                      "sort": [{"created_at_ms": "asc"}, {"attempt_id": "asc"}]}
        if after:
            ms, last = codec.parse_cursor(after)
            body["search_after"] = [ms, last]
        hits = await self._search("attempts", body, "list attempts")
        more = len(hits) > limit
        hits = hits[:limit]
        nxt = codec.cursor(int(hits[-1]["sort"][0]), str(hits[-1]["sort"][1])) if more and hits else ""
        return [codec.record_from_dict(h["_source"]["record"]) for h in hits], nxt

    # -- gaps and observations --------------------------------------------------------------

    async def gaps(self, run_id: str) -> list[GapRecord]:
        hits = await self._search("gaps", {"query": {"term": {"run_id": run_id}}, "size": _MAX_READ}, "read gaps")
        return sorted((codec.gap_from_dict(h["_source"]["gap"]) for h in hits), key=lambda g: (g.created_at_ms, g.gap_id))

    async def observations(self, run_id: str) -> list[Observation]:
        hits = await self._search("observations", {"query": {"term": {"run_id": run_id}}, "size": _MAX_READ,
                                                   "sort": [{"observed_at_ms": "asc"}]}, "read observations")
        return [_obs_from(h["_source"]) for h in hits]

    async def observations_elsewhere(self, run_id: str, evidence_ids: Sequence[str]) -> list[Observation]:
        ids = list(dict.fromkeys(evidence_ids))
        if not ids:
            return []
        body = {"query": {"bool": {"filter": [{"terms": {"evidence_id": ids}}],
                                   "must_not": [{"term": {"run_id": run_id}}]}}, "size": _MAX_READ}
        return [_obs_from(h["_source"]) for h in await self._search("observations", body, "read observations")]

    async def resolve_gap(self, run_id: str, gap_id: str, decide: GapDecision) -> GapRecord | None:
        await self._ensure()
        doc_id = f"{run_id}|{gap_id}"
        for _ in range(_MAX_CONFLICT_RETRIES):
            try:
                doc = await self._call(self._client.get(index=self.index("gaps"), id=doc_id), "read gap")
            except NotFoundError:
                return None
            gap = decide(codec.gap_from_dict(doc["_source"]["gap"]), await self.observations(run_id))
            try:
                await self._call(self._client.index(
                    index=self.index("gaps"), id=doc_id, body=self._gap_doc(gap),
                    params={"if_seq_no": doc["_seq_no"], "if_primary_term": doc["_primary_term"],
                            "refresh": "wait_for"}), "resolve gap", max(self.timeout_s, 10.0))
            except ConflictError:  # an attempt or another resolver changed it: decide again
                continue
            return gap
        raise LedgerUnavailable(f"gap {gap_id}: still contended after {_MAX_CONFLICT_RETRIES} tries")

    # -- purge ------------------------------------------------------------------------------

    async def purge_run(self, run_id: str, reason: str, principal: str, now_ms: int) -> PurgeReport | None:
        await self._ensure()
        seen = await self._read_run(run_id)
        if seen is None:
            return None
        counts: dict[str, int] = {}
        for name in ("attempts", "gaps", "observations"):
            resp = await self._call(self._client.delete_by_query(
                index=self.index(name), body={"query": {"term": {"run_id": run_id}}},
                params={"refresh": "true", "conflicts": "proceed"}), f"purge {name}", max(self.timeout_s, 30.0))
            counts[name] = int(resp.get("deleted", 0))
        try:
            await self._call(self._client.delete(index=self.index("runs"), id=run_id, params={"refresh": "true"}),
                             "purge run")
        except NotFoundError:
            pass
        self._runs.pop(run_id, None)
        report = PurgeReport(run_id, now_ms, reason, principal, counts["attempts"], counts["gaps"],
                             counts["observations"], seen.state.owner)
        await self._call(self._client.index(index=self.index("purges"), id=run_id, params={"refresh": "true"},
                                            body={"run_id": run_id, "purged_at_ms": now_ms, "report": report.__dict__}),
                         "record purge")
        return report

    async def purge_record(self, run_id: str) -> PurgeReport | None:
        src = await self._get_source("purges", run_id, "read purge")
        return PurgeReport(**src["report"]) if src else None

    async def runs_created_before(self, cutoff_ms: int, limit: int) -> list[str]:
        await self._ensure()
        # Reservations do not refresh; retention is rare, so it makes new runs searchable itself.
        await self._call(self._client.indices.refresh(index=self.index("runs")), "refresh runs")
        hits = await self._search("runs", {"query": {"range": {"created_at_ms": {"lt": cutoff_ms}}}, "size": limit,
                                           "sort": [{"created_at_ms": "asc"}]}, "expired runs")
        return [str(h["_source"]["run_id"]) for h in hits]

