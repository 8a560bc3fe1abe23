"""API keys and per-key rate limits of the model server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loom.workloads.server.config import AuthConfig, RateLimitConfig
from loom.workloads.server.flow import ApiKeys, RateLimiter, key_id, parse_keys, presented_key, retry_after_header


def test_parse_keys_ignores_comments_blanks_and_splits_commas() -> None:
    assert parse_keys("# team keys\nalpha\n\n beta , gamma # old\n") == ["alpha", "beta", "gamma"]


def test_keys_from_a_file_are_checked_and_reported_by_id_only(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("s3cret-one\ns3cret-two\n")
    keys = ApiKeys(AuthConfig(api_keys_file=str(keys_file)))
    caller = keys.check("s3cret-two")
    assert caller == key_id("s3cret-two")
    assert caller is not None and "s3cret" not in caller
    assert keys.check("s3cret-tw") is None
    assert keys.check("s3cret-two ") is None
    assert keys.check(None) is None


def test_a_rotated_key_file_is_picked_up(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("old-key\n")
    keys = ApiKeys(AuthConfig(api_keys_file=str(keys_file)))
    assert keys.check("old-key") is not None
    keys_file.write_text("new-key\n")
    os.utime(keys_file, (1, 1))  # a different mtime, as the kubelet's atomic symlink swap gives
    keys.RECHECK_SECONDS = 0.0
    assert keys.check("new-key") is not None
    assert keys.check("old-key") is None


def test_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODEL_KEYS", "k1,k2")
    keys = ApiKeys(AuthConfig(api_keys_env="MODEL_KEYS"))
    assert keys.check("k2") == key_id("k2")
    assert keys.check("k3") is None


def test_configured_but_empty_keys_refuse_to_start(tmp_path: Path) -> None:
    empty = tmp_path / "keys"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="none were found"):
        ApiKeys(AuthConfig(api_keys_file=str(empty)))


def test_no_keys_configured_means_auth_disabled() -> None:
    assert ApiKeys(AuthConfig()).enabled is False


@pytest.mark.parametrize(
    ("authorization", "x_api_key", "expected"),
    [
        ("Bearer abc", None, "abc"),
        ("bearer  abc ", None, "abc"),
        ("Basic abc", None, None),
        (None, "xyz", "xyz"),
        ("Basic abc", "xyz", "xyz"),
        (None, None, None),
    ],
)
def test_presented_key(authorization: str | None, x_api_key: str | None, expected: str | None) -> None:
    assert presented_key(authorization, x_api_key) == expected


def test_rate_limit_allows_the_burst_then_refuses_with_a_wait() -> None:
    limiter = RateLimiter(RateLimitConfig(requests_per_second=1, burst=3))
    assert [limiter.hit("a") for _ in range(3)] == [None, None, None]
    wait = limiter.hit("a")
    assert wait is not None and 0 < wait <= 3
    # Another key has its own budget.
    assert limiter.hit("b") is None


@pytest.mark.parametrize(
    ("rps", "burst", "amount", "window"),
    [(1, 3, 3, 3), (10, 20, 20, 2), (100, 10, 100, 1), (0.5, 1, 1, 2), (2.5, 5, 5, 2)],
)
def test_rate_limit_window_keeps_the_average_rate(rps: float, burst: int, amount: int, window: int) -> None:
    item = RateLimiter(RateLimitConfig(requests_per_second=rps, burst=burst)).item
    assert (item.amount, item.multiples) == (amount, window)


@pytest.mark.parametrize(("seconds", "header"), [(0.0, "1"), (0.2, "1"), (1.0, "1"), (1.01, "2"), (7.5, "8")])
def test_retry_after_is_whole_seconds_and_never_zero(seconds: float, header: str) -> None:
    assert retry_after_header(seconds) == header
