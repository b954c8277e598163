"""The ledger contract on SQLite, plus what only a file can do wrong."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from service.ledger.base import Ledger, LedgerUnavailable
from service.ledger.sqlite import SqliteLedger
from tests.unit.ledger.contract import LedgerContract, OpenLedger, rid


@pytest.fixture
async def open_ledger(tmp_path: Path) -> AsyncIterator[OpenLedger]:
    opened: list[Ledger] = []

    async def make() -> Ledger:
        ledger = SqliteLedger(tmp_path / "ledger.sqlite3", timeout_s=2.0)
        await ledger.start()
        opened.append(ledger)
        return ledger

    yield make
    for ledger in opened:
        with contextlib.suppress(Exception):  # a test may have closed it already
            await ledger.close()


class TestSqliteLedger(LedgerContract):
    pass


async def test_a_locked_file_is_unavailable_not_empty(tmp_path: Path) -> None:
    ledger = SqliteLedger(tmp_path / "l.sqlite3", timeout_s=0.3)
    await ledger.start()
    holder = sqlite3.connect(tmp_path / "l.sqlite3", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
    started = time.monotonic()
    with pytest.raises(LedgerUnavailable, match="locked"):
        await ledger.reserve_search(rid(), 2, 2)
    assert time.monotonic() - started < 2.0  # bounded by timeout_s, not SQLite's default
    holder.execute("ROLLBACK")
    holder.close()
    assert (await ledger.reserve_search(rid(), 2, 2)).allowed  # and it recovers
    await ledger.close()


async def test_a_file_of_the_first_release_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE runs (run_id TEXT PRIMARY KEY, max_searches INTEGER NOT NULL, max_results_per_search"
        " INTEGER NOT NULL, searches_used INTEGER NOT NULL DEFAULT 0, created_at_ms INTEGER NOT NULL);"
        "INSERT INTO runs VALUES ('old', 3, 5, 1, 7);")
    conn.close()
    ledger = SqliteLedger(path)
    await ledger.start()
    state = await ledger.get_run("old")
    assert state is not None and state.searches_left == 2 and not state.require_gap
    await ledger.close()
