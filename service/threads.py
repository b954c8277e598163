"""Background-priority worker threads: ingest work that must never starve queries.

Ingest's model calls and the embedded engine's writes run on threads of their own whose
scheduling priority is lowered (a positive nice value, per thread on Linux). On a machine
with few cores the scheduler then gives queries the CPU whenever both want it, and the
background threads take what queries leave idle: a bulk ingest on a quiet server still uses
every core (README "Queries during a bulk ingest").
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)


def lower_this_thread(nice: int) -> bool:
    """Add ``nice`` to the calling thread's nice value (Linux: one task per thread). Raising
    it needs no privilege; False where the platform cannot (the thread runs as before)."""
    if nice <= 0:
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        return True
    except (AttributeError, OSError) as exc:  # not Linux, or a sandbox that forbids it
        log.warning("could not lower a background thread's priority: %s", exc)
        return False


def thread_nice(tid: int) -> int:
    """The nice value of the thread with native id ``tid`` (tests)."""
    return os.getpriority(os.PRIO_PROCESS, tid)


def background_pool(workers: int, name: str, nice: int) -> ThreadPoolExecutor:
    """A thread pool whose threads run ``nice`` steps below normal priority."""
    initializer: Callable[[], object] | None = (lambda: lower_this_thread(nice)) if nice > 0 else None
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=initializer)
