"""Flow control: API keys and per-key rate limits.

Keys come from a mounted Secret file (re-read when the kubelet updates it) or an environment
variable. A presented key is compared against every known key with ``hmac.compare_digest`` so the
time taken says nothing about how much of a key matched. Keys never leave this module: callers get
a short, non-reversible key id (for rate-limit buckets and logs).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import threading
import time
from pathlib import Path

from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from .config import AuthConfig, RateLimitConfig

ANONYMOUS = "anonymous"


def key_id(key: str) -> str:
    """A stable id for a key that does not reveal it (safe for logs and limiter buckets)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_keys(text: str) -> list[str]:
    """One key per line (or comma-separated); blank lines and '#' comments ignored."""
    keys: list[str] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        keys.extend(part.strip() for part in line.split(",") if part.strip())
    return keys


class ApiKeys:
    """The set of accepted keys; ``check`` returns the caller's key id or None."""

    # How often the key file's mtime is looked at; a rotated Secret is picked up within this.
    RECHECK_SECONDS = 2.0

    def __init__(self, config: AuthConfig):
        self._file = Path(config.api_keys_file) if config.api_keys_file else None
        self._env = config.api_keys_env
        self._lock = threading.Lock()
        self._keys: list[bytes] = []
        self._mtime: float | None = None
        self._checked = 0.0
        self.enabled = config.enabled
        if self.enabled:
            self._reload(force=True)
            if not self._keys:
                raise ValueError("API keys are configured but none were found (file empty or env unset)")

    def _reload(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < self.RECHECK_SECONDS:
            return
        self._checked = now
        keys: list[str] = []
        if self._env:
            keys.extend(parse_keys(os.environ.get(self._env, "")))
        if self._file is not None:
            try:
                mtime = self._file.stat().st_mtime
            except FileNotFoundError:
                mtime = None
            if not force and mtime == self._mtime:
                return
            self._mtime = mtime
            if mtime is not None:
                keys.extend(parse_keys(self._file.read_text()))
        with self._lock:
            self._keys = [key.encode() for key in keys]

    def check(self, presented: str | None) -> str | None:
        """The key id when ``presented`` is a known key, else None."""
        if presented is None:
            return None
        self._reload()
        candidate = presented.encode()
        matched = False
        with self._lock:
            keys = list(self._keys)
        for key in keys:
            # No early exit: every key is compared, whatever matched.
            matched |= hmac.compare_digest(candidate, key)
        return key_id(presented) if matched else None


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key from ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``."""
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    if x_api_key:
        return x_api_key.strip()
    return None


class RateLimiter:
    """Per-key limit built on the ``limits`` library's moving window.

    A token bucket promises two things: at most ``burst`` requests at once and ``requests_per_second``
    on average. A moving window of ``burst`` hits per ``burst / requests_per_second`` seconds keeps
    both; ``limits`` windows are whole seconds, so the window is rounded and the amount scaled to keep
    the average rate (a burst below one second's worth of requests becomes one second's worth).
    """

    def __init__(self, config: RateLimitConfig):
        window = max(1, round(config.burst / config.requests_per_second))
        amount = max(config.burst, math.floor(config.requests_per_second * window))
        self.item = RateLimitItemPerSecond(amount, window)
        self._limiter = MovingWindowRateLimiter(MemoryStorage())

    def hit(self, key: str) -> float | None:
        """Take one request from ``key``'s budget; None when allowed, else seconds until retry."""
        if self._limiter.hit(self.item, key):
            return None
        stats = self._limiter.get_window_stats(self.item, key)
        return max(0.0, stats.reset_time - time.time())


def retry_after_header(seconds: float) -> str:
    """Retry-After is whole seconds; never 0, or clients would retry in a tight loop."""
    return str(max(1, math.ceil(seconds)))
