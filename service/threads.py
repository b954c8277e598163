"""Worker threads at a lowered priority (a positive nice value, per thread on Linux).

Two uses, two levels:
- Ingest's model calls and the embedded engine's writes (``ingest_nice``, 19): work that must
  never starve queries. On a machine with few cores the scheduler gives queries the CPU
  whenever both want it, and ingest takes what queries leave idle: a bulk ingest on a quiet
  server still uses every core (README "Queries during a bulk ingest").
- Query-time workers (``worker_nice``, 10): the model pool, the embedded engine's searches and
  the ledger's thread. The event loop is the one serial stage, and it holds the GIL while it
  runs: preempted by the OS in favour of a worker's GIL-free inference, it stalls every other
  request with it (README "Event-loop lag"). Below the loop and above ingest.
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


def niced_pool(workers: int, name: str, nice: int) -> ThreadPoolExecutor:
    """A thread pool whose threads run ``nice`` steps below their creator's priority (0:
    the same)."""
    initializer: Callable[[], object] | None = (lambda: lower_this_thread(nice)) if nice > 0 else None
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=initializer)
