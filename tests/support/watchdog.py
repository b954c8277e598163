"""A hung test must fail with a diagnosis, not eat the whole CI budget.

CI once stopped at its 90-minute limit with one test of tests/integration hanging and no
trace of where. Two layers, registered in tests/conftest.py:

- this watchdog: when a test (setup, call and teardown together) has run ``WATCHDOG_DUMP_S``
  seconds, it prints every thread's stack and every asyncio task's stack (the awaits a
  thread dump cannot show: the session event loop runs every async test) to stderr,
  once, and lets the test go on;
- pytest-timeout (``timeout`` in pyproject.toml) then fails the test, so the run reports
  it and carries on instead of hanging until CI is killed.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import os
import sys
import threading
from collections.abc import Generator

import pytest

DUMP_AFTER_S = float(os.environ.get("WATCHDOG_DUMP_S", "240"))


def dump_everything(title: str) -> None:
    err = sys.__stderr__ or sys.stderr
    print(f"\n===== watchdog: {title} =====", file=err, flush=True)
    faulthandler.dump_traceback(file=err, all_threads=True)
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and not o.is_closed()]
    for loop in loops:
        try:
            tasks = list(asyncio.all_tasks(loop))
        except RuntimeError:  # the set changed under us (another thread's loop): try once more
            tasks = list(asyncio.all_tasks(loop))
        print(f"--- event loop {loop!r}: {len(tasks)} tasks", file=err, flush=True)
        for task in tasks:
            try:
                task.print_stack(limit=12, file=err)
            except Exception as exc:  # noqa: BLE001 - a frame the loop is running changes under us
                # (linecache then gets lineno None): report it and go on to the other tasks.
                print(f"{task!r}: stack not readable from this thread ({exc!r})", file=err, flush=True)
    print("===== watchdog: end =====", file=err, flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    timer = threading.Timer(DUMP_AFTER_S, dump_everything,
                            args=(f"{item.nodeid} still running after {DUMP_AFTER_S:.0f}s",))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
