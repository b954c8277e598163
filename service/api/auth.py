"""API keys -> principals. A caller never asserts its own groups: they come from the
server's key file.

Key file (TOML)::

    [[principals]]
    name = "support-agent"
    api_key_sha256 = "<hex sha256 of the key>"   # or api_key = "plain" for local use
    groups = ["support", "billing"]
    # optional limits (service/api/quotas.py); 0 or absent = unlimited
    requests_per_second = 20
    burst = 40
    max_concurrent = 8
    max_searches_per_run = 10

    [defaults]            # optional: limits for principals that set none of their own
    requests_per_second = 50

Anonymous callers (auth off) get the ``anonymous_*`` limits of the service config.
"""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from pathlib import Path

import grpc

from service.api.quotas import Limits, Quotas
from service.errors import Unauthenticated
from service.pipeline.request import ANONYMOUS, Principal

API_KEY_HEADER = "x-api-key"


class Authenticator:
    def __init__(self, principals: dict[str, Principal], quotas: Quotas | None = None) -> None:
        self._by_digest = principals  # sha256 hex digest -> principal
        self.quotas = quotas or Quotas()

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    @classmethod
    def from_file(cls, path: str, anonymous: Limits | None = None) -> Authenticator:
        if not path:
            return cls({}, Quotas({}, anonymous))
        with Path(path).open("rb") as fh:
            data = tomllib.load(fh)
        table: dict[str, Principal] = {}
        defaults = Limits.from_mapping(data.get("defaults", {}))
        limits: dict[str, Limits] = {}
        for entry in data.get("principals", []):
            digest = entry.get("api_key_sha256") or hashlib.sha256(entry["api_key"].encode()).hexdigest()
            table[digest.lower()] = Principal(entry["name"], tuple(entry.get("groups", [])))
            limits[entry["name"]] = Limits.from_mapping(entry, defaults)
        return cls(table, Quotas(limits, defaults))

    def authenticate(self, context: grpc.aio.ServicerContext) -> Principal:  # type: ignore[type-arg]
        """Who is calling, with one request charged to its rate limit (Overloaded when the
        principal is over it, before any work is done for the call)."""
        principal = self._identify(context)
        self.quotas.charge(principal.name)
        return principal

    def _identify(self, context: grpc.aio.ServicerContext) -> Principal:  # type: ignore[type-arg]
        if not self.enabled:
            return ANONYMOUS
        key = next((v for k, v in context.invocation_metadata() or () if k == API_KEY_HEADER), None)
        if not key:
            raise Unauthenticated(f"missing {API_KEY_HEADER} metadata")
        digest = hashlib.sha256(str(key).encode()).hexdigest()
        for known, principal in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return principal
        raise Unauthenticated("unknown API key")
