"""Fixtures shared by every tier: the live-server harness (see tests/support/harness.py)."""

import os

from tests.support.harness import bge_embedder, demo, e5_embedder, start_server

# Stacks of every thread and asyncio task when a test hangs (then pytest-timeout fails it).
pytest_plugins = ["tests.support.watchdog"]

# Hermetic runs: servers started by tests (in process or as `python -m service serve`
# subprocesses) never pick up the "auto" reranker from this machine's model cache; tests
# that want a reranker name one. The "auto" resolution itself is unit-tested.
os.environ.setdefault("RETRIEVAL_RERANKER_MODEL", "")

__all__ = ["bge_embedder", "demo", "e5_embedder", "start_server"]
