"""The attempt ledger and run budgets, in SQLite under the data dir.

Budgets are reserved with one conditional UPDATE, so two concurrent attempts of one run
can never both spend the last search; SQLite's file lock extends that to several service
processes sharing one data dir on one host. (Replicas on several hosts need a shared
store; see README "Scaling out".)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from service.domain import AttemptRecord, LegKind, LegReport, LegStatus, LegTiming, Outcome

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  run_id TEXT PRIMARY KEY,
  max_searches INTEGER NOT NULL,
  max_results_per_search INTEGER NOT NULL,
  searches_used INTEGER NOT NULL DEFAULT 0,
  created_at_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS attempts (
  attempt_id TEXT PRIMARY KEY,
  run_id TEXT NOT NULL,
  gap_id TEXT NOT NULL,
  channel TEXT NOT NULL,
  query TEXT NOT NULL,
  requested_top_k INTEGER NOT NULL,
  outcome TEXT NOT NULL,
  stopping_reason TEXT NOT NULL,
  principal TEXT NOT NULL,
  created_at_ms INTEGER NOT NULL,
  record_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS attempts_by_run ON attempts(run_id, created_at_ms);
CREATE TABLE IF NOT EXISTS observed_evidence (
  run_id TEXT NOT NULL,
  evidence_id TEXT NOT NULL,
  attempt_id TEXT NOT NULL,
  PRIMARY KEY (run_id, evidence_id)
);
"""


@dataclass(frozen=True)
class BudgetDecision:
    allowed: bool
    before: int  # searches left before this attempt
    after: int  # searches left after it
    max_results_per_search: int


def _record_to_json(record: AttemptRecord) -> str:
    data = asdict(record)
    data["outcome"] = record.outcome.value
    data["legs"] = [
        {**asdict(leg), "kind": leg.kind.value, "status": leg.status.value} for leg in record.legs
    ]
    return json.dumps(data, ensure_ascii=False)


def _record_from_json(text: str) -> AttemptRecord:
    data: dict[str, Any] = json.loads(text)
    legs = []
    for leg in data.pop("legs"):
        timing = leg.pop("timing")
        legs.append(
            LegReport(
                kind=LegKind(leg.pop("kind")),
                status=LegStatus(leg.pop("status")),
                timing=LegTiming(**timing) if timing else None,
                **leg,
            )
        )
    outcome = Outcome(data.pop("outcome"))
    return AttemptRecord(outcome=outcome, legs=legs, **data)


class Ledger:
    """Async facade; every SQLite call runs on one dedicated thread (never the loop)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ledger")
        self._conn: sqlite3.Connection | None = None

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _open(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self._path, check_same_thread=False, timeout=30, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(_SCHEMA)
        self._conn = conn

    async def start(self) -> None:
        await self._call(self._open)

    async def close(self) -> None:
        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        await self._call(shut)
        self._executor.shutdown(wait=True)

    @property
    def conn(self) -> sqlite3.Connection:
        assert self._conn is not None, "ledger not started"
        return self._conn

    def _reserve(self, run_id: str, max_searches: int, max_results: int) -> BudgetDecision:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "INSERT OR IGNORE INTO runs(run_id, max_searches, max_results_per_search,"
                " searches_used, created_at_ms) VALUES (?, ?, ?, 0, ?)",
                (run_id, max_searches, max_results, int(time.time() * 1000)),
            )
            row = conn.execute(
                "SELECT max_searches, max_results_per_search, searches_used FROM runs"
                " WHERE run_id = ?",
                (run_id,),
            ).fetchone()
            limit, per_search, used = int(row[0]), int(row[1]), int(row[2])
            before = max(0, limit - used)
            if before == 0:
                conn.execute("COMMIT")
                return BudgetDecision(False, 0, 0, per_search)
            conn.execute(
                "UPDATE runs SET searches_used = searches_used + 1 WHERE run_id = ?", (run_id,)
            )
            conn.execute("COMMIT")
            return BudgetDecision(True, before, before - 1, per_search)
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    async def reserve_search(
        self, run_id: str, max_searches: int, max_results_per_search: int
    ) -> BudgetDecision:
        """Spend one search of the run (creating it with this budget on first use)."""
        result: BudgetDecision = await self._call(
            self._reserve, run_id, max_searches, max_results_per_search
        )
        return result

    def _record(self, record: AttemptRecord) -> None:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "INSERT OR REPLACE INTO attempts VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    record.attempt_id, record.run_id, record.gap_id, record.channel,
                    record.query, record.requested_top_k, record.outcome.value,
                    record.stopping_reason, record.principal, record.created_at_ms,
                    _record_to_json(record),
                ),
            )
            if record.run_id:
                conn.executemany(
                    "INSERT OR IGNORE INTO observed_evidence VALUES (?, ?, ?)",
                    [(record.run_id, eid, record.attempt_id) for eid in record.evidence_ids],
                )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    async def record_attempt(self, record: AttemptRecord) -> None:
        await self._call(self._record, record)

    def _get(self, attempt_id: str) -> AttemptRecord | None:
        row = self.conn.execute(
            "SELECT record_json FROM attempts WHERE attempt_id = ?", (attempt_id,)
        ).fetchone()
        return _record_from_json(row[0]) if row else None

    async def get_attempt(self, attempt_id: str) -> AttemptRecord | None:
        result: AttemptRecord | None = await self._call(self._get, attempt_id)
        return result

    def _observed(self, run_id: str) -> set[str]:
        rows = self.conn.execute(
            "SELECT evidence_id FROM observed_evidence WHERE run_id = ?", (run_id,)
        ).fetchall()
        return {str(r[0]) for r in rows}

    async def observed_evidence(self, run_id: str) -> set[str]:
        """Evidence ids the runtime returned in this run (for citation validation)."""
        result: set[str] = await self._call(self._observed, run_id)
        return result
