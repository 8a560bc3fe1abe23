"""When the API server refuses an object a controller renders (a spec that admission accepted produces a child
Kubernetes cannot take: a Secret key or an env name it does not allow), retrying cannot help. The object gets
Ready=False with reason ChildRejected and the API server's message, for the generation it has, so the user sees
why instead of an object without status. The controller's next pass still runs (a fixed spec converges)."""

from __future__ import annotations

import logging

from . import client as kube
from .model import API_VERSION, Condition, set_condition

log = logging.getLogger("loom.operator.refusal")

MAX_MESSAGE = 1024


def refused_status(
    status: kube.Manifest, generation: int | None, message: str, reason: str = "ChildRejected"
) -> kube.Manifest:
    """The status patch: the Ready condition replaced, the other conditions kept. ChildRejected: the API server's
    message; NameTaken: a child's name is another object's child (client.NameTaken)."""
    conditions = [Condition.model_validate(c) for c in status.get("conditions") or []]
    ready = Condition(
        type="Ready",
        status="False",
        reason=reason,
        message=(f"the API server refused an object rendered for this one: {message}" if reason == "ChildRejected"
                 else message)[:MAX_MESSAGE],
        observed_generation=generation,
    )
    merged = set_condition(conditions, ready)
    return {"conditions": [c.to_wire() for c in merged], "observedGeneration": generation}


async def report_refusal(kind: str, namespace: str, name: str, message: str, reason: str = "ChildRejected") -> None:
    try:
        body = await kube.get(API_VERSION, kind, namespace, name)
        if body is None:
            return
        patch = refused_status(body.get("status") or {}, body["metadata"].get("generation"), message, reason)
        await kube.patch_status(API_VERSION, kind, namespace, name, patch)
    except Exception:  # reporting is best effort: the pass has failed already and is logged
        log.exception("could not report the refusal on %s %s/%s", kind, namespace, name)
