"""The client tests share one live server (tests/support/clients.py)."""

from tests.support.clients import client_server

__all__ = ["client_server"]
