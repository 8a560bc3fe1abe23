"""Failed S3 requests of the checkpoint client, seen as they happen.

botocore retries a failed request itself (standard mode: up to 10 attempts with jittered back-off), so an
S3 outage shows no error to the checkpoint thread for a minute or more. It announces every attempt's outcome
on its client's `needs-retry` event, though: listening there tells the trainer at once that the upload is
being retried, which it reports in its progress document (and the operator in a condition).

Only the error's class (or S3's error code) is kept: botocore's messages name the endpoint URL, which is no
one's business in a status.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# HTTP statuses botocore retries (throttling and server errors); other 4xx answers are S3 saying no, not failing.
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})


def failure_of(response: Any = None, caught_exception: BaseException | None = None) -> str | None:
    """What failed in one attempt, as a short name without secrets or URLs; None when it succeeded or S3
    answered a client error (404 on a probe is an answer)."""
    if caught_exception is not None:
        return type(caught_exception).__name__
    if not isinstance(response, tuple) or len(response) != 2:
        return None
    http, parsed = response
    status = getattr(http, "status_code", None)
    if status not in RETRIED_STATUSES:
        return None
    error = parsed.get("Error") if isinstance(parsed, dict) else None
    code = error.get("Code") if isinstance(error, dict) else None
    # S3 error codes are fixed identifiers (SlowDown, InternalError); anything else is shown as the status.
    if isinstance(code, str) and code.isalnum() and len(code) <= 64:
        return code
    return f"HTTP{status}"


def watch_failures(client: Any, on_failure: Callable[[str], None]) -> None:
    """Call `on_failure(error)` for every failed attempt of any S3 request `client` makes.

    The handler answers None, so botocore's own retry decision (the first non-None answer) is untouched.
    """

    def seen(response: Any = None, caught_exception: BaseException | None = None, **_: Any) -> None:
        error = failure_of(response, caught_exception)
        if error is not None:
            on_failure(error)

    client.meta.events.register("needs-retry.s3", seen)
