"""Per-key token and request budgets over a moving one-minute window (pure; the clock is passed in).

A request's cost is known only when it ends (its usage), so the token budget is checked before a request starts
(a key whose window is already spent gets 429) and charged with the real usage afterwards: one request may
take a key past its budget, and the next one waits until enough of the window has slid by. The request budget
is the same window charged one per request as it starts (RequestBudget): a plain deque per key, where the model
server's limiter (the `limits` library's memory storage) starts a timer thread whenever its last one has expired,
which on the front cost more than the rest of a request's checks together (bench/bench_front_path.py).
"""

from __future__ import annotations

import threading
from collections import deque

WINDOW_S = 60.0


class TokenBudget:
    def __init__(self, tokens_per_minute: int, window_s: float = WINDOW_S) -> None:
        if tokens_per_minute < 1:
            raise ValueError("tokens_per_minute must be at least 1")
        self.limit = tokens_per_minute
        self.window_s = window_s
        self._spent: dict[str, deque[tuple[float, int]]] = {}
        # Each key's sum over its window, kept as charges come and go: a busy key's check stays O(1), not a sum
        # over every request of its last minute.
        self._totals: dict[str, int] = {}
        self._lock = threading.Lock()

    def _used(self, key: str, now: float) -> deque[tuple[float, int]]:
        entries = self._spent.setdefault(key, deque())
        while entries and entries[0][0] <= now - self.window_s:
            self._totals[key] -= entries.popleft()[1]
        return entries

    def check(self, key: str, now: float) -> float | None:
        """None when ``key`` may start a request now, else the seconds until it may."""
        with self._lock:
            return self._wait(key, now)

    def _wait(self, key: str, now: float) -> float | None:
        entries = self._used(key, now)
        used = self._totals.get(key, 0)
        if used < self.limit:
            return None
        # Wait until enough of the oldest charges slide out of the window to go under the limit.
        for at, tokens in entries:
            used -= tokens
            if used < self.limit:
                return max(0.0, at + self.window_s - now)
        return self.window_s  # unreachable: the loop always goes under the limit

    def take(self, key: str, tokens: int, now: float) -> float | None:
        """Check and, when ``key`` may start now, charge ``tokens`` at once (one lock: no two callers both take
        the last of a window); None when taken, else the seconds until it may."""
        with self._lock:
            wait = self._wait(key, now)
            if wait is None:
                self._charge(key, tokens, now)
            return wait

    def charge(self, key: str, tokens: int, now: float) -> None:
        with self._lock:
            self._charge(key, tokens, now)

    def _charge(self, key: str, tokens: int, now: float) -> None:
        if tokens <= 0:
            return
        self._used(key, now).append((now, tokens))
        self._totals[key] = self._totals.get(key, 0) + tokens


class RequestBudget:
    """At most ``requests_per_minute`` requests per key in any moving minute; each request counts as it starts."""

    def __init__(self, requests_per_minute: int, window_s: float = WINDOW_S) -> None:
        self._window = TokenBudget(requests_per_minute, window_s)

    def hit(self, key: str, now: float) -> float | None:
        """Count one request of ``key``; None when allowed, else the seconds until it may (not counted)."""
        return self._window.take(key, 1, now)
