"""Send fuzzed objects to the real API server and judge each answer: rejected at admission with a field path,
or accepted (and then the operator must report it through a condition with a reason)."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from loom.operator.core.model import GROUP, VERSION

from .specs import Case, cel_messages, k8s_path, kind_named, manifest


@dataclass(frozen=True)
class Outcome:
    case: Case
    name: str
    accepted: bool
    status: int  # HTTP status of the answer (201 or 200 when accepted)
    message: str = ""
    fields: tuple[str, ...] = ()  # details.causes[].field of a 422


def submit(api: client.ApiClient, namespace: str, case: Case, name: str, *, dry_run: bool) -> Outcome:
    """Create one object (server-side dry run when `dry_run`), with strict field validation so an unknown field is
    refused rather than silently pruned."""
    kind = kind_named(case.kind)
    custom = client.CustomObjectsApi(api)
    extra: dict[str, Any] = {"field_validation": "Strict"}
    if dry_run:
        extra["dry_run"] = "All"
    try:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, kind.plural, manifest(case, name), **extra)
    except ApiException as error:
        try:
            body = json.loads(error.body or "{}")
        except json.JSONDecodeError:
            body = {"message": str(error.body)}
        causes = (body.get("details") or {}).get("causes") or []
        fields = tuple(str(c.get("field", "")) for c in causes if c.get("field"))
        return Outcome(case, name, False, int(error.status or 0), str(body.get("message", "")), fields)
    return Outcome(case, name, True, 201)


def submit_all(
    api: client.ApiClient, namespace: str, cases: Iterable[tuple[str, Case]], *, dry_run: bool, workers: int = 4
) -> list[Outcome]:
    items = list(cases)
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda item: submit(api, namespace, item[1], item[0], dry_run=dry_run), items))


def refused_by_cel(outcome: Outcome) -> bool:
    """Refused by a cross-field CEL rule of the kind (which the draw's repairs may not know yet), and by nothing
    else: then a valid-by-schema object is rightly refused."""
    messages = cel_messages(outcome.case.kind)
    return not outcome.accepted and any(message in outcome.message for message in messages) and all(
        any(message in part for message in messages) or "some validation rules were not checked" in part
        for part in _parts(outcome)
    )


def _parts(outcome: Outcome) -> list[str]:
    text = outcome.message.split(" is invalid: ", 1)[-1].strip("[]")
    return [part for part in re.split(r", (?=spec\.|<nil>)", text) if part]


def problem(outcome: Outcome) -> str | None:
    """What is wrong with an answer, or None. A rejection must be a 4xx naming a spec field; a mutation the schema
    alone forbids must be rejected, and at its own path (or, for an unknown field, inside the object that got it); a
    valid object (schema and CEL rules) must be accepted."""
    case = outcome.case
    if outcome.accepted:
        if case.schema_breaking:
            return f"accepted a {case.label()} at {k8s_path(case.mutation.path) if case.mutation else ''}"
        return None
    if case.mutation is None and not refused_by_cel(outcome):
        # The structural schema comes from the same models as the draw: a refusal means the two disagree.
        return f"refused a valid object ({outcome.status}): {outcome.message[:400]}"
    if not 400 <= outcome.status < 500:
        return f"answered {outcome.status}: {outcome.message[:300]}"
    text = outcome.message + " " + " ".join(outcome.fields)
    if "spec" not in text:
        return f"rejection names no field: {outcome.message[:300]}"
    if case.schema_breaking and case.mutation is not None:
        expected = k8s_path(case.mutation.path)
        if expected not in text:
            return f"rejection of {case.label()} does not name {expected}: {outcome.message[:400]}"
    return None


@dataclass
class Tally:
    """Figures for one kind: how many of each case label were accepted or rejected, and the problems."""

    kind: str
    accepted: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def add(self, outcome: Outcome) -> None:
        label = outcome.case.label()
        if label == "valid" and refused_by_cel(outcome):
            label = "valid-refused-by-cel"
        (self.accepted if outcome.accepted else self.rejected)[label] += 1
        issue = problem(outcome)
        if issue:
            self.problems.append(f"{outcome.name} ({outcome.case.label()}): {issue}")

    @property
    def total(self) -> int:
        return sum(self.accepted.values()) + sum(self.rejected.values())

    def line(self) -> str:
        return (
            f"{self.kind}: {self.total} sent, {sum(self.accepted.values())} accepted "
            f"({self.accepted['valid']} of them valid), {sum(self.rejected.values())} rejected with a field path "
            f"({self.rejected['valid-refused-by-cel']} valid by schema but refused by a CEL rule), "
            f"{len(self.problems)} problems"
        )
