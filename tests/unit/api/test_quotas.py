"""Token buckets, concurrency quotas and run-budget ceilings per principal (fake clock)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.api.auth import Authenticator
from service.api.quotas import Limits, Quotas, TokenBucket
from service.errors import Overloaded


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_bucket_grants_its_burst_then_says_how_long_until_the_next_token() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=10.0, capacity=3.0, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.1)
    clock.t += 0.05
    assert bucket.take() == pytest.approx(0.05)
    clock.t += 0.05
    assert bucket.take() == 0.0
    clock.t += 60  # refills to the capacity, never beyond
    assert [bucket.take() for _ in range(4)][-1] > 0


def test_over_the_rate_is_overloaded_with_a_retry_delay_and_other_principals_are_untouched() -> None:
    clock = Clock()
    quotas = Quotas({"flood": Limits(requests_per_second=2, burst=2)}, Limits(), clock=clock)
    quotas.charge("flood")
    quotas.charge("flood")
    with pytest.raises(Overloaded) as err:
        quotas.charge("flood")
    assert err.value.retry_after_s == pytest.approx(0.5) and "flood" in str(err.value)
    for _ in range(1000):  # the default (unlimited) principal never waits on flood's bucket
        quotas.charge("calm")


def test_concurrency_quota_counts_per_principal() -> None:
    quotas = Quotas({"a": Limits(max_concurrent=2)})
    quotas.enter("a")
    quotas.check_concurrency("a")
    quotas.enter("a")
    with pytest.raises(Overloaded):
        quotas.check_concurrency("a")
    quotas.check_concurrency("b")
    quotas.leave("a")
    quotas.check_concurrency("a")


def test_search_ceiling_caps_the_run_budget() -> None:
    quotas = Quotas({"capped": Limits(max_searches_per_run=3)})
    assert quotas.search_ceiling("capped", 0, 20) == 3
    assert quotas.search_ceiling("capped", 10, 20) == 3
    assert quotas.search_ceiling("capped", 2, 20) == 2
    assert quotas.search_ceiling("free", 0, 20) == 0  # unchanged: the server default applies


def test_keys_file_limits_with_defaults(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[defaults]\nrequests_per_second = 50\n\n'
                    '[[principals]]\nname = "a"\napi_key = "ka"\nmax_concurrent = 4\nmax_searches_per_run = 5\n\n'
                    '[[principals]]\nname = "b"\napi_key = "kb"\nrequests_per_second = 5\nburst = 10\n')
    auth = Authenticator.from_file(str(keys))
    assert auth.quotas.limits_for("a") == Limits(50, 0, 4, 5)
    assert auth.quotas.limits_for("b") == Limits(5, 10, 0, 0)
    keys.write_text('[[principals]]\nname = "a"\napi_key = "ka"\nburst = -1\n')
    with pytest.raises(ValueError, match="burst"):
        Authenticator.from_file(str(keys))


def test_anonymous_limits_apply_when_auth_is_off() -> None:
    auth = Authenticator.from_file("", Limits(requests_per_second=1))
    assert auth.quotas.limits_for("anonymous").requests_per_second == 1
