"""Fixtures shared by every tier: the live-server harness (see tests/support/harness.py)."""

from tests.support.harness import demo, e5_embedder, start_server

__all__ = ["demo", "e5_embedder", "start_server"]
