"""Structured graph errors and the record of the steps a request ran.

Every error the router answers has this shape (``upstream_*`` only when a service answered)::

    {"error": "node 'root' step 'classify' (service classifier): upstream answered 500: boom",
     "code": "upstream_error", "graph": "g", "node": "root", "step": "classify",
     "service": "classifier", "upstream_status": 500, "upstream_message": "boom",
     "steps": [{"node": "root", "step": "embed", "outcome": "ok", "status": 200, "ms": 1.9}, ...]}

``error`` keeps the model server's ``{"error": message}`` shape, so clients written for one
InferenceService read a graph's errors too.

Codes and HTTP statuses:

| code | status | when |
|---|---|---|
| ``bad_request`` | 400 | the graph's request is not JSON where the router must read it |
| ``condition_error`` | 400 | a condition failed on this request (missing field, non-bool) |
| ``no_route`` | 404 | a Switch node where no step's condition holds (and no default step) |
| ``upstream_error`` | 400, 401, 403, 409, 413, 415, 422, 429, 503 kept; else 502 | a step answered an error |
| ``upstream_error_body`` | 502 | a step answered 200 with an ``{"error": ...}`` body |
| ``bad_upstream_response`` | 502 | a response the router had to combine is not OIP-shaped |
| ``upstream_unreachable`` | 502 | connecting to the step's service failed |
| ``step_timeout`` | 504 | the step's timeout passed |
| ``no_question`` | 400 | a retrieval step found no last user message with text |
| ``question_too_long`` | 400 | the question alone does not fit the retrieval step's ``promptBudgetChars`` |
| ``context_too_long`` | 400 | the documents do not fit the budget and the step's ``onOverflow`` is ``Refuse`` |
| ``retrieval_failed`` | 502 | embedding the question or searching the store failed (``onFailure: Fail``) |
| ``retrieval_timeout`` | 504 | retrieval did not answer within ``retrieve.timeoutMs`` (``onFailure: Fail``) |
| ``deadline_exceeded`` | 504 | the graph's overall deadline passed (never skipped, even for Soft steps) |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

StepOutcome = Literal["ok", "failed", "skipped", "not_taken"]

# Upstream 4xx statuses that describe the caller's request or credentials: passed on as they are.
_CALLER_STATUSES = frozenset({400, 401, 403, 409, 413, 415, 422, 429})
# Codes that stop the graph whatever the step's dependency says.
# The retrieval step's refusals of the question are the caller's to fix: no Soft dependency turns them into a skip.
FATAL_CODES = frozenset(
    {"deadline_exceeded", "condition_error", "bad_request", "no_question", "question_too_long", "context_too_long"}
)


def status_for_upstream(upstream_status: int) -> int:
    """The router's status for a step that answered ``upstream_status``.

    A caller error (bad input, missing API key, rate limit) is the caller's to fix and keeps its
    status; 503 (not ready, queue full) stays retryable; anything else, a 404 included (the graph
    names a model that is not there), is the graph's fault: 502 Bad Gateway.
    """
    if upstream_status in _CALLER_STATUSES or upstream_status == 503:
        return upstream_status
    return 502


@dataclass
class StepRecord:
    """One step as it ran (or did not) in one request."""

    node: str
    step: str
    outcome: StepOutcome
    service: str | None = None
    status: int | None = None
    ms: float | None = None
    code: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"node": self.node, "step": self.step, "outcome": self.outcome}
        for key in ("service", "status", "code"):
            value = getattr(self, key)
            if value is not None:
                doc[key] = value
        if self.ms is not None:
            doc["ms"] = round(self.ms, 3)
        return doc

    def header_value(self) -> str:
        return f"{self.node}.{self.step}={self.outcome}"


@dataclass
class GraphError(Exception):
    """A failure of one step (or node), with what the client needs to see which and why."""

    code: str
    status: int
    message: str
    node: str | None = None
    step: str | None = None
    service: str | None = None
    upstream_status: int | None = None
    upstream_message: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def fatal(self) -> bool:
        return self.code in FATAL_CODES

    def describe(self) -> str:
        where = []
        if self.node is not None:
            where.append(f"node {self.node!r}")
        if self.step is not None:
            where.append(f"step {self.step!r}")
        if self.service is not None:
            where.append(f"(service {self.service})")
        return f"{' '.join(where)}: {self.message}" if where else self.message

    def to_json(self, graph: str) -> dict[str, Any]:
        doc: dict[str, Any] = {"error": self.describe(), "code": self.code, "graph": graph}
        for key in ("node", "step", "service", "upstream_status", "upstream_message"):
            value = getattr(self, key)
            if value is not None:
                doc[key] = value
        doc["steps"] = [record.to_json() for record in self.steps]
        return doc
