"""Per-principal rate limits and concurrency quotas (transport-free: no grpc here).

Each principal has a token bucket (``requests_per_second`` refill, ``burst`` capacity) that
every RPC it makes is charged to, a ceiling on its concurrent attempts and ingest streams,
and a ceiling on a run's ``max_searches``. A caller over a limit gets ``Overloaded`` with
the time until it may retry, which the one status table maps to RESOURCE_EXHAUSTED with
google.rpc.RetryInfo and a ``retry-after-ms`` trailer.

Why not asyncio-throttle (the design's choice): its ``Throttler`` makes an over-limit caller
*wait* for a slot, which would hold that caller's request (and its memory and connection)
inside the server and offers no retry delay to hand back. A service shedding a flooding
caller must refuse at once and say when to come back; this bucket has the same shape
(rate over a period, refilled continuously) and answers "how long until a token" instead
of sleeping. Buckets are per process: N replicas admit N times the rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from service.errors import Overloaded

# Retry hint for a caller at its concurrency ceiling and no rate to derive one from.
_CONCURRENCY_RETRY_S = 0.1


@dataclass(frozen=True)
class Limits:
    """0 means unlimited for every field."""

    requests_per_second: float = 0.0
    burst: float = 0.0  # bucket capacity; 0: max(1, requests_per_second)
    max_concurrent: int = 0  # attempts (Retrieve/Lookup) and ingest streams in flight
    max_searches_per_run: int = 0  # ceiling on a run's budget.max_searches

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], base: Limits | None = None) -> Limits:
        """Read the limit keys of a key-file entry; keys it does not set keep ``base``'s."""
        base = base or cls()
        values: dict[str, Any] = {}
        for name, kind in (("requests_per_second", float), ("burst", float),
                           ("max_concurrent", int), ("max_searches_per_run", int)):
            if name in data:
                value = kind(data[name])
                if value < 0:
                    raise ValueError(f"{name} must be >= 0, not {value}")
                values[name] = value
        return replace(base, **values)


class TokenBucket:
    def __init__(self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._tokens = capacity
        self._at = clock()

    def take(self) -> float:
        """Take one token: 0.0 when granted, else the seconds until one is available."""
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0 - 1e-9:  # float refill arithmetic must not cost a whole wait
            self._tokens = max(0.0, self._tokens - 1.0)
            return 0.0
        return (1.0 - self._tokens) / self.rate


class Quotas:
    def __init__(self, limits: Mapping[str, Limits] | None = None, default: Limits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._limits = dict(limits or {})
        self.default = default or Limits()
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._concurrent: dict[str, int] = {}

    def limits_for(self, principal_name: str) -> Limits:
        return self._limits.get(principal_name, self.default)

    def charge(self, principal_name: str) -> None:
        """Charge one request to the principal's bucket; Overloaded when it is empty."""
        limits = self.limits_for(principal_name)
        if limits.requests_per_second <= 0:
            return
        bucket = self._buckets.get(principal_name)
        if bucket is None:
            capacity = limits.burst or max(1.0, limits.requests_per_second)
            bucket = self._buckets[principal_name] = TokenBucket(limits.requests_per_second, capacity, self._clock)
        wait_s = bucket.take()
        if wait_s > 0:
            raise Overloaded(f"principal {principal_name!r} is over its rate limit "
                             f"({limits.requests_per_second:g} requests/s)", wait_s)

    def check_concurrency(self, principal_name: str) -> None:
        limits = self.limits_for(principal_name)
        running = self._concurrent.get(principal_name, 0)
        if limits.max_concurrent and running >= limits.max_concurrent:
            retry = 1.0 / limits.requests_per_second if limits.requests_per_second > 0 else _CONCURRENCY_RETRY_S
            raise Overloaded(f"principal {principal_name!r} has {running} calls in flight "
                             f"(limit {limits.max_concurrent})", retry)

    def enter(self, principal_name: str) -> None:
        self._concurrent[principal_name] = self._concurrent.get(principal_name, 0) + 1

    def leave(self, principal_name: str) -> None:
        left = self._concurrent.get(principal_name, 0) - 1
        if left > 0:
            self._concurrent[principal_name] = left
        else:
            self._concurrent.pop(principal_name, None)

    def search_ceiling(self, principal_name: str, requested: int, default: int) -> int:
        """The run budget an attempt may create: what it asked (0: ``default``), capped by
        the principal's ceiling."""
        ceiling = self.limits_for(principal_name).max_searches_per_run
        asked = requested or default
        return min(asked, ceiling) if ceiling else requested
