"""The hung-test watchdog (tests/support/watchdog.py) must print every task's stack even
when one of them cannot be read from its thread (linecache raised TypeError on a running
frame's lineno None and the dump stopped there, in a CI run that needed it)."""

from __future__ import annotations

import asyncio
import io
import sys
from typing import Any

import pytest

from tests.support import watchdog


class _Unreadable:
    def print_stack(self, **_: Any) -> None:
        raise TypeError("'<=' not supported between instances of 'int' and 'NoneType'")


def test_a_task_whose_stack_cannot_be_read_does_not_end_the_dump(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.new_event_loop()
    try:
        async def waiting() -> None:
            await asyncio.sleep(3600)

        task = loop.create_task(waiting(), name="the-readable-one")
        loop.run_until_complete(asyncio.sleep(0))  # the task starts and waits
        monkeypatch.setattr(watchdog.asyncio, "all_tasks",
                            lambda lp=None: [_Unreadable(), task] if lp is loop else [])
        err = io.StringIO()
        monkeypatch.setattr(sys, "__stderr__", err)
        monkeypatch.setattr(watchdog.faulthandler, "dump_traceback", lambda **_: None)
        watchdog.dump_everything("probe")
        out = err.getvalue()
        assert "stack not readable from this thread" in out
        assert "the-readable-one" in out and "waiting" in out  # the next task's stack still printed
        assert out.rstrip().endswith("===== watchdog: end =====")
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
    finally:
        loop.close()
