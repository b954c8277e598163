"""The SQLite ledger (the embedded default): one file, one host.

Budgets are reserved in one ``BEGIN IMMEDIATE`` transaction, so two concurrent attempts of
a run can never both spend its last search; SQLite's file lock extends that to several
service processes sharing one file on one host (``ledger_path``). Replicas on several
hosts need the OpenSearch ledger.

Every call runs on one dedicated thread (never the event loop). A lock held longer than
``timeout_s`` or an unreadable file raises ``LedgerUnavailable``.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from service.domain import AttemptRecord, Outcome
from service.ledger import codec
from service.ledger.base import (
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
    registered_gap,
    run_visible,
)
from service.threads import niced_pool

T = TypeVar("T")

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
CREATE INDEX IF NOT EXISTS attempts_by_run ON attempts(run_id, created_at_ms, attempt_id);
CREATE TABLE IF NOT EXISTS observations (
  run_id TEXT NOT NULL,
  evidence_id TEXT NOT NULL,
  attempt_id TEXT NOT NULL,
  gap_id TEXT NOT NULL,
  admissible INTEGER NOT NULL,
  observed_at_ms INTEGER NOT NULL,
  PRIMARY KEY (run_id, evidence_id, attempt_id)
);
CREATE INDEX IF NOT EXISTS observations_by_id ON observations(evidence_id);
CREATE TABLE IF NOT EXISTS gaps (
  run_id TEXT NOT NULL,
  gap_id TEXT NOT NULL,
  gap_json TEXT NOT NULL,
  PRIMARY KEY (run_id, gap_id)
);
CREATE TABLE IF NOT EXISTS purges (
  run_id TEXT PRIMARY KEY,
  purged_at_ms INTEGER NOT NULL,
  report_json TEXT NOT NULL
);
"""
# Columns added after the first release; older files gain them on open.
_MIGRATIONS = (
    ("runs", "require_gap", "INTEGER NOT NULL DEFAULT 0"),
    ("attempts", "request_json", "TEXT NOT NULL DEFAULT '{}'"),
    ("runs", "owner", "TEXT NOT NULL DEFAULT ''"),
)


class SqliteLedger(Ledger):
    kind = "sqlite"

    def __init__(self, path: Path, timeout_s: float = 2.0, nice: int = 0) -> None:
        self._path = path
        self._timeout_s = timeout_s
        self._executor = niced_pool(1, "ledger", nice)
        self._conn: sqlite3.Connection | None = None

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except sqlite3.Error as exc:
            raise LedgerUnavailable(f"sqlite ledger {self._path}: {exc}") from exc

    def _open(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self._path, check_same_thread=False, timeout=self._timeout_s, isolation_level=None)
        # Two processes opening a new shared ledger at once: switching the file to WAL takes
        # an exclusive lock and SQLite can answer "database is locked" at once instead of
        # calling its busy handler, so retry within the ledger's timeout.
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(_SCHEMA)
        for table, column, decl in _MIGRATIONS:
            have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                try:
                    conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
                except sqlite3.OperationalError as exc:  # another process migrated first
                    if "duplicate column" not in str(exc):
                        raise
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
        if self._conn is None:
            raise sqlite3.OperationalError("ledger not started or closed")
        return self._conn

    def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            out = fn(conn)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return out

    # -- budget -----------------------------------------------------------------------------

    async def reserve_search(
        self, run_id: str, max_searches: int, max_results_per_search: int, *,
        require_gap: bool = False, has_gap: bool = True, owner: str = "", sees_all: bool = False,
    ) -> BudgetDecision:
        def reserve(conn: sqlite3.Connection) -> BudgetDecision:
            conn.execute(
                "INSERT OR IGNORE INTO runs(run_id, max_searches, max_results_per_search, searches_used,"
                " created_at_ms, require_gap, owner) VALUES (?, ?, ?, 0, ?, ?, ?)",
                (run_id, max_searches, max_results_per_search, int(time.time() * 1000), int(require_gap), owner))
            row = conn.execute("SELECT max_searches, max_results_per_search, searches_used, require_gap, owner"
                               " FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            decision = budget_decision(int(row[0]), int(row[2]), int(row[1]), bool(row[3]), has_gap,
                                       run_visible(str(row[4]), owner, sees_all))
            if decision.allowed:
                conn.execute("UPDATE runs SET searches_used = searches_used + 1 WHERE run_id = ?", (run_id,))
            return decision

        return await self._call(self._tx, reserve)

    async def get_run(self, run_id: str) -> RunState | None:
        def get() -> RunState | None:
            row = self.conn.execute(
                "SELECT max_searches, max_results_per_search, searches_used, require_gap, created_at_ms, owner"
                " FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                return None
            return RunState(run_id, int(row[0]), int(row[1]), int(row[2]), bool(row[3]), int(row[4]), str(row[5]))

        return await self._call(get)

    # -- attempts ---------------------------------------------------------------------------

    async def record(self, entries: Sequence[AttemptEntry]) -> None:
        def write(conn: sqlite3.Connection) -> None:
            now = int(time.time() * 1000)
            for e in entries:
                r = e.record
                if e.run is not None:
                    s = e.run
                    conn.execute(
                        "INSERT OR IGNORE INTO runs(run_id, max_searches, max_results_per_search, searches_used,"
                        " created_at_ms, require_gap, owner) VALUES (?, ?, ?, 0, ?, ?, ?)",
                        (s.run_id, s.max_searches, s.max_results_per_search, s.created_at_ms, int(s.require_gap),
                         s.owner))
                conn.execute(
                    "INSERT OR REPLACE INTO attempts(attempt_id, run_id, gap_id, channel, query, requested_top_k,"
                    " outcome, stopping_reason, principal, created_at_ms, record_json, request_json)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                    (r.attempt_id, r.run_id, r.gap_id, r.channel, r.query, r.requested_top_k, r.outcome.value,
                     r.stopping_reason, r.principal, r.created_at_ms, codec.record_to_json(r),
                     json.dumps(e.request, ensure_ascii=False)))
                conn.executemany(
                    "INSERT OR IGNORE INTO observations VALUES (?, ?, ?, ?, ?, ?)",
                    [(o.run_id, o.evidence_id, o.attempt_id, o.gap_id, int(o.admissible), o.observed_at_ms)
                     for o in e.observations])
                if e.gap is not None and r.run_id:
                    row = conn.execute("SELECT gap_json FROM gaps WHERE run_id = ? AND gap_id = ?",
                                       (r.run_id, e.gap.gap_id)).fetchone()
                    existing = codec.gap_from_dict(json.loads(row[0])) if row else None
                    gap = registered_gap(existing, e.gap, r.outcome is Outcome.BUDGET_DENIED, now)
                    conn.execute("INSERT OR REPLACE INTO gaps VALUES (?, ?, ?)",
                                 (r.run_id, gap.gap_id, json.dumps(codec.gap_to_dict(gap), ensure_ascii=False)))

        await self._call(self._tx, write)

    async def get_attempt(self, attempt_id: str) -> AttemptRecord | None:
        def get() -> AttemptRecord | None:
            row = self.conn.execute("SELECT record_json FROM attempts WHERE attempt_id = ?", (attempt_id,)).fetchone()
            return codec.record_from_json(row[0]) if row else None

        return await self._call(get)

    async def attempt_request(self, attempt_id: str) -> dict[str, Any] | None:
        def get() -> dict[str, Any] | None:
            row = self.conn.execute("SELECT request_json FROM attempts WHERE attempt_id = ?", (attempt_id,)).fetchone()
            return dict(json.loads(row[0])) if row else None

        return await self._call(get)

    async def list_attempts(self, run_id: str, after: str, limit: int) -> tuple[list[AttemptRecord], str]:
        ms, last = codec.parse_cursor(after) if after else (-1, "")

        def page() -> tuple[list[AttemptRecord], str]:
            rows = self.conn.execute(
                "SELECT record_json, created_at_ms, attempt_id FROM attempts WHERE run_id = ?"
                " AND (created_at_ms, attempt_id) > (?, ?) ORDER BY created_at_ms, attempt_id LIMIT ?",
                (run_id, ms, last, limit + 1)).fetchall()
            more = len(rows) > limit
            rows = rows[:limit]
            nxt = codec.cursor(int(rows[-1][1]), str(rows[-1][2])) if more and rows else ""
            return [codec.record_from_json(r[0]) for r in rows], nxt

        return await self._call(page)

    # -- gaps and observations --------------------------------------------------------------

    async def gaps(self, run_id: str) -> list[GapRecord]:
        def get() -> list[GapRecord]:
            rows = self.conn.execute("SELECT gap_json FROM gaps WHERE run_id = ?", (run_id,)).fetchall()
            return sorted((codec.gap_from_dict(json.loads(r[0])) for r in rows), key=lambda g: (g.created_at_ms, g.gap_id))

        return await self._call(get)

    def _observations(self, conn: sqlite3.Connection, run_id: str) -> list[Observation]:
        rows = conn.execute("SELECT run_id, evidence_id, attempt_id, gap_id, admissible, observed_at_ms"
                            " FROM observations WHERE run_id = ? ORDER BY observed_at_ms", (run_id,)).fetchall()
        return [Observation(r[0], r[1], r[2], r[3], bool(r[4]), int(r[5])) for r in rows]

    async def observations(self, run_id: str) -> list[Observation]:
        return await self._call(lambda: self._observations(self.conn, run_id))

    async def observations_elsewhere(self, run_id: str, evidence_ids: Sequence[str]) -> list[Observation]:
        ids = list(dict.fromkeys(evidence_ids))

        def get() -> list[Observation]:
            out: list[Observation] = []
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                rows = self.conn.execute(
                    "SELECT run_id, evidence_id, attempt_id, gap_id, admissible, observed_at_ms FROM observations"
                    f" WHERE run_id != ? AND evidence_id IN ({','.join('?' * len(chunk))})", (run_id, *chunk)).fetchall()
                out += [Observation(r[0], r[1], r[2], r[3], bool(r[4]), int(r[5])) for r in rows]
            return out

        return await self._call(get)

    async def resolve_gap(self, run_id: str, gap_id: str, decide: GapDecision) -> GapRecord | None:
        def resolve(conn: sqlite3.Connection) -> GapRecord | None:
            row = conn.execute("SELECT gap_json FROM gaps WHERE run_id = ? AND gap_id = ?", (run_id, gap_id)).fetchone()
            if row is None:
                return None
            gap = decide(codec.gap_from_dict(json.loads(row[0])), self._observations(conn, run_id))
            conn.execute("UPDATE gaps SET gap_json = ? WHERE run_id = ? AND gap_id = ?",
                         (json.dumps(codec.gap_to_dict(gap), ensure_ascii=False), run_id, gap_id))
            return gap

        return await self._call(self._tx, resolve)

    # -- purge ------------------------------------------------------------------------------

    async def purge_run(self, run_id: str, reason: str, principal: str, now_ms: int) -> PurgeReport | None:
        def purge(conn: sqlite3.Connection) -> PurgeReport | None:
            row = conn.execute("SELECT owner FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                return None
            conn.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))
            attempts = conn.execute("DELETE FROM attempts WHERE run_id = ?", (run_id,)).rowcount
            gaps = conn.execute("DELETE FROM gaps WHERE run_id = ?", (run_id,)).rowcount
            observations = conn.execute("DELETE FROM observations WHERE run_id = ?", (run_id,)).rowcount
            report = PurgeReport(run_id, now_ms, reason, principal, attempts, gaps, observations, str(row[0]))
            conn.execute("INSERT OR REPLACE INTO purges VALUES (?, ?, ?)",
                         (run_id, now_ms, json.dumps(report.__dict__, ensure_ascii=False)))
            return report

        return await self._call(self._tx, purge)

    async def purge_record(self, run_id: str) -> PurgeReport | None:
        def get() -> PurgeReport | None:
            row = self.conn.execute("SELECT report_json FROM purges WHERE run_id = ?", (run_id,)).fetchone()
            return PurgeReport(**json.loads(row[0])) if row else None

        return await self._call(get)

    async def runs_created_before(self, cutoff_ms: int, limit: int) -> list[str]:
        def get() -> list[str]:
            rows = self.conn.execute("SELECT run_id FROM runs WHERE created_at_ms < ? ORDER BY created_at_ms LIMIT ?",
                                     (cutoff_ms, limit)).fetchall()
            return [str(r[0]) for r in rows]

        return await self._call(get)
