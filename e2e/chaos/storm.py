"""The real-create half of the spec fuzz: accepted fuzzed objects created for real, with a valid TrainingJob in
the middle of the storm, then every one must be reported (a Ready condition with a reason for its generation) and
the valid one must become Ready. Shared by e2e/tests/test_chaos_fuzz_specs.py and `make chaos`."""

from __future__ import annotations

import base64
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.nodes import KWOK_TOLERATION, kwok_placement
from loom.operator.core.model import GROUP, VERSION

from .admission import Outcome, submit, submit_all
from .kwok_only import kwok_only
from .specs import Case, kind_named, tame

SENTINEL = "sentinel"
SENTINEL_SECRET = "sentinel-s3"


def sentinel_case() -> Case:
    """A valid TrainingJob on kwok nodes whose checkpoints name an S3 Secret (its keys must never leak)."""
    return Case(
        "TrainingJob",
        {
            "engine": "fsdp",
            "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task"},
            "maxSteps": 100,
            "workers": {"replicas": 2, **kwok_placement()},
            "checkpoint": {"uri": "s3://loom-chaos/sentinel", "secretRef": {"name": SENTINEL_SECRET}},
        },
        None,
    )


def sample(outcomes: dict[str, list[Outcome]], per_kind: int) -> list[tuple[str, Case]]:
    """Per kind, accepted objects alternating mutated (nulls dropped, odd free-form values) and valid, tamed."""
    chosen: list[tuple[str, Case]] = []
    for kind, kind_outcomes in outcomes.items():
        accepted = [o for o in kind_outcomes if o.accepted]
        odd = [o for o in accepted if o.case.mutation is not None]
        valid = [o for o in accepted if o.case.mutation is None]
        mixed = [o for o in itertools.chain.from_iterable(itertools.zip_longest(odd, valid)) if o is not None]
        chosen += [(o.name, Case(kind, tame(o.case, KWOK_TOLERATION), o.case.mutation)) for o in mixed[:per_kind]]
    return chosen


def ready_condition(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The Ready condition when the operator has reported this generation with a reason, else None."""
    status = obj.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    current = status.get("observedGeneration") == obj["metadata"].get("generation")
    if ready is None or not ready.get("reason") or not current:
        return None
    return dict(ready)


@dataclass
class StormResult:
    created: list[Outcome]
    sentinel_ready_s: float | None = None  # from its creation
    reported_s: float | None = None  # from the first creation until every object was reported
    reasons: dict[str, int] = field(default_factory=dict)  # "Kind:Reason" -> count
    pending: list[tuple[str, str]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


def _put_secret(api: client.ApiClient, namespace: str) -> None:
    values = {"AWS_ACCESS_KEY_ID": f"chaos-{secrets.token_hex(4)}", "AWS_SECRET_ACCESS_KEY": secrets.token_urlsafe(24)}
    data = {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}
    client.CoreV1Api(api).create_namespaced_secret(
        namespace, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SENTINEL_SECRET}, "data": data}
    )


def storm(api: client.ApiClient, namespace: str, objects: list[tuple[str, Case]], timeout_s: float) -> StormResult:
    custom = client.CustomObjectsApi(api)

    def get(kind: str, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, kind_named(kind).plural, name
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return obj

    _put_secret(api, namespace)
    with kwok_only(api, namespace):
        started = time.monotonic()
        half = len(objects) // 2
        created = submit_all(api, namespace, objects[:half], dry_run=False)
        sentinel = submit(api, namespace, sentinel_case(), SENTINEL, dry_run=False)
        sentinel_at = time.monotonic()
        created += submit_all(api, namespace, objects[half:], dry_run=False)
        refused = [f"{o.name}: {o.message}" for o in [*created, sentinel] if not o.accepted]
        result = StormResult(created, refused=refused)
        if result.refused:
            return result

        def sentinel_ready() -> bool:
            ready = ready_condition(get("TrainingJob", SENTINEL) or {"metadata": {}})
            return ready is not None and ready["status"] == "True"

        pending = {(o.case.kind, o.name) for o in created}

        def all_reported() -> bool:
            for key in list(pending):
                obj = get(*key)
                if obj is not None and ready_condition(obj) is not None:
                    pending.discard(key)
            return not pending

        try:
            wait_until(sentinel_ready, timeout=timeout_s, what="the valid TrainingJob created mid-storm to be Ready")
            result.sentinel_ready_s = time.monotonic() - sentinel_at
        except TimeoutError:
            pass
        try:
            wait_until(all_reported, timeout=timeout_s, what="a Ready condition on every accepted object")
            result.reported_s = time.monotonic() - started
        except TimeoutError:
            result.pending = sorted(pending)
        for outcome in created:
            ready = ready_condition(get(outcome.case.kind, outcome.name) or {"metadata": {}}) or {}
            key = f"{outcome.case.kind}:{ready.get('reason')}"
            result.reasons[key] = result.reasons.get(key, 0) + 1
    return result
