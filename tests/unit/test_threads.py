"""Background-priority pools (service/threads.py)."""

from __future__ import annotations

import threading

from service.threads import niced_pool, lower_this_thread, thread_nice


def test_niced_pool_threads_run_below_the_callers_priority() -> None:
    base = thread_nice(threading.get_native_id())
    pool = niced_pool(2, "bg", nice=7)
    try:
        nices = set(pool.map(lambda _: thread_nice(threading.get_native_id()), range(8)))
    finally:
        pool.shutdown()
    assert nices == {min(19, base + 7)}


def test_zero_nice_leaves_the_thread_alone() -> None:
    base = thread_nice(threading.get_native_id())
    pool = niced_pool(1, "fg", nice=0)
    try:
        assert pool.submit(lambda: (lower_this_thread(0), thread_nice(threading.get_native_id()))).result() == (False, base)
    finally:
        pool.shutdown()
