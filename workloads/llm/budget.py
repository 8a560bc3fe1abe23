"""Per-key token budget over a moving one-minute window (pure; the clock is passed in).

A request's cost is known only when it ends (its usage), so the budget is checked before a request starts
(a key whose window is already spent gets 429) and charged with the real usage afterwards: one request may
take a key past its budget, and the next one waits until enough of the window has slid by.
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

    def charge(self, key: str, tokens: int, now: float) -> None:
        if tokens <= 0:
            return
        with self._lock:
            self._used(key, now).append((now, tokens))
            self._totals[key] = self._totals.get(key, 0) + tokens
