"""Kopf validating handlers: thin wiring of the pure checks (graph, immutability, references) to the webhook.

Each kind has one handler whose id is its webhook path (`/validate-<kind>`, named in the chart's
ValidatingWebhookConfiguration). A handler judges only what the write changes: an UPDATE that leaves `spec` alone
(metadata, finalizers, labels) is always admitted, so an object that became invalid some other way can still be
edited and deleted. Rejections raise `kopf.AdmissionError` with every violation as `field: message`; missing
references become admission warnings or rejections as `settings.webhook_missing_references` says.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from ..api import API_VERSION, GROUP, VERSION
from ..core import client as kube
from ..settings import OperatorSettings
from . import Violation
from .graph import graph_violations
from .immutability import trainingjob_update_violations
from .references import MissingReferences, Reference, changed, graph_references, missing_violations, service_references

log = logging.getLogger("loom.operator.admission")
# What HTTP status a denial carries (the API server shows the message either way).
INVALID = 422


def verdict(
    errors: list[Violation], missing: list[Violation], policy: MissingReferences
) -> tuple[list[Violation], list[str]]:
    """(what to reject, what to warn about) for one write."""
    if policy == "Reject":
        return errors + missing, []
    return errors, [str(v) for v in missing]


def spec_unchanged(operation: str | None, old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    return operation == "UPDATE" and old is not None and old.get("spec") == new.get("spec")


async def _missing(namespace: str, references: list[Reference]) -> tuple[set[tuple[str, str]], list[str]]:
    """(kind, name) of the referenced objects known not to exist (or being deleted), and the lookups that failed:
    those become warnings, never rejections (an API hiccup must not refuse a good object)."""
    wanted = sorted({(r.kind, r.name) for r in references})
    found = await asyncio.gather(
        *(kube.get(API_VERSION, kind, namespace, name) for kind, name in wanted), return_exceptions=True
    )
    missing: set[tuple[str, str]] = set()
    failed: list[str] = []
    for key, result in zip(wanted, found, strict=True):
        if isinstance(result, BaseException):
            failed.append(f"could not check {key[0]} {key[1]!r}: {result}")
        elif result is None or result["metadata"].get("deletionTimestamp"):
            missing.add(key)
    return missing, failed


async def judge(
    *,
    operation: str | None,
    old: Mapping[str, Any] | None,
    new: Mapping[str, Any],
    namespace: str,
    errors: Callable[[Mapping[str, Any] | None, Mapping[str, Any]], list[Violation]],
    references: Callable[[Mapping[str, Any]], list[Reference]] | None,
    policy: MissingReferences,
    warnings: list[str],
) -> None:
    """Raise kopf.AdmissionError for a write to refuse; append warnings for one to admit with a note."""
    if spec_unchanged(operation, old, new):
        return
    found = errors(old, new)
    missing: list[Violation] = []
    if references is not None:
        wanted = changed(references(new.get("spec") or {}), references((old or {}).get("spec") or {}))
        if wanted:
            absent, failed = await _missing(namespace, wanted)
            missing = missing_violations([r for r in wanted if (r.kind, r.name) in absent], namespace)
            warnings.extend(failed)
    rejected, noted = verdict(found, missing, policy)
    warnings.extend(noted)
    if rejected:
        raise kopf.AdmissionError("; ".join(str(v) for v in rejected), code=INVALID)


def _graph_errors(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[Violation]:
    return graph_violations(new.get("spec") or {}, (new.get("metadata") or {}).get("name"))


def _trainingjob_errors(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[Violation]:
    return trainingjob_update_violations(old, new) if old is not None else []


def _no_errors(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[Violation]:
    return []


# plural -> (webhook path id, errors, references)
CHECKS: dict[
    str,
    tuple[
        str,
        Callable[[Mapping[str, Any] | None, Mapping[str, Any]], list[Violation]],
        Callable[[Mapping[str, Any]], list[Reference]] | None,
    ],
] = {
    "inferencegraphs": ("validate-inferencegraph", _graph_errors, graph_references),
    "trainingjobs": ("validate-trainingjob", _trainingjob_errors, None),
    "inferenceservices": ("validate-inferenceservice", _no_errors, service_references),
}


def _handler(
    errors: Callable[[Mapping[str, Any] | None, Mapping[str, Any]], list[Violation]],
    references: Callable[[Mapping[str, Any]], list[Reference]] | None,
    policy: MissingReferences,
) -> Callable[..., Any]:
    async def validate(
        body: kopf.Body, old: kopf.Body | None, operation: str | None, warnings: list[str], **_: Any
    ) -> None:
        await judge(
            operation=operation,
            old=old,
            new=body,
            namespace=str(body.metadata.namespace),
            errors=errors,
            references=references,
            policy=policy,
            warnings=warnings,
        )

    return validate


def register(settings: OperatorSettings) -> None:
    """Register one validating handler per kind (its id is its webhook path)."""
    for plural, (handler_id, errors, references) in CHECKS.items():
        kopf.on.validate(GROUP, VERSION, plural, id=handler_id, operations=["CREATE", "UPDATE"])(
            _handler(errors, references, settings.webhook_missing_references)
        )
