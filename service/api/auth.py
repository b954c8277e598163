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
    # optional, with mutual TLS: a client certificate with this subject (the full
    # "CN=...,O=..." string or just the common name) is this principal, no key needed
    client_subject = "support-agent"

    [defaults]            # optional: limits for principals that set none of their own
    requests_per_second = 50

Anonymous callers (auth off) get the ``anonymous_*`` limits of the service config. With
mutual TLS and no keys file, a client certificate's common name is the principal's name
(no groups: it sees public documents only).
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
    def __init__(self, principals: dict[str, Principal], quotas: Quotas | None = None,
                 by_subject: dict[str, Principal] | None = None, client_certs: bool = False) -> None:
        self._by_digest = principals  # sha256 hex digest -> principal
        self._by_subject = by_subject or {}  # client certificate subject or CN -> principal
        self.client_certs = client_certs  # mutual TLS: verified client certificates name callers
        self.quotas = quotas or Quotas()

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest or self._by_subject or self.client_certs)

    @classmethod
    def from_file(cls, path: str, anonymous: Limits | None = None, client_certs: bool = False) -> Authenticator:
        if not path:
            return cls({}, Quotas({}, anonymous), client_certs=client_certs)
        with Path(path).open("rb") as fh:
            data = tomllib.load(fh)
        table: dict[str, Principal] = {}
        by_subject: dict[str, Principal] = {}
        defaults = Limits.from_mapping(data.get("defaults", {}))
        limits: dict[str, Limits] = {}
        for entry in data.get("principals", []):
            principal = Principal(entry["name"], tuple(entry.get("groups", [])))
            if "api_key_sha256" in entry or "api_key" in entry:
                digest = entry.get("api_key_sha256") or hashlib.sha256(entry["api_key"].encode()).hexdigest()
                table[digest.lower()] = principal
            if entry.get("client_subject"):
                by_subject[str(entry["client_subject"])] = principal
            if not ("api_key_sha256" in entry or "api_key" in entry or entry.get("client_subject")):
                raise ValueError(f"principal {entry['name']!r} has no api_key, api_key_sha256 or client_subject")
            limits[entry["name"]] = Limits.from_mapping(entry, defaults)
        return cls(table, Quotas(limits, defaults), by_subject, client_certs)

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
        if key and self._by_digest:
            digest = hashlib.sha256(str(key).encode()).hexdigest()
            for known, principal in self._by_digest.items():
                if hmac.compare_digest(known, digest):
                    return principal
            raise Unauthenticated("unknown API key")
        subjects = peer_certificate_subjects(context) if self.client_certs else ()
        for subject in subjects:
            if subject in self._by_subject:
                return self._by_subject[subject]
        if subjects and not self._by_digest and not self._by_subject:
            return Principal(subjects[-1])  # mutual TLS without a keys file: the CN names the caller
        if subjects:
            raise Unauthenticated(f"client certificate {subjects[0]!r} is not a known principal "
                                  f"and no {API_KEY_HEADER} was sent")
        raise Unauthenticated(f"missing {API_KEY_HEADER} metadata")


def peer_certificate_subjects(context: grpc.aio.ServicerContext) -> tuple[str, ...]:  # type: ignore[type-arg]
    """The verified client certificate's full subject and common name (empty without one)."""
    auth = context.auth_context() or {}
    full = [v.decode() for v in auth.get("x509_subject", ())]
    common = [v.decode() for v in auth.get("x509_common_name", ())]
    return tuple(full[:1] + common[:1])
