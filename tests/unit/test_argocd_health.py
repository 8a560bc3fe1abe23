"""The Argo CD health check (docs/argocd-health.lua), run as Argo CD runs it: the script on Lua 5.1 (Argo CD's
gopher-lua implements 5.1) with the object as the global `obj`, returning {status, message}. Status objects are
built from the operator's own API models, so the field names are the ones the operator writes; the e2e test
(e2e/tests/test_gitops.py) runs it on status objects read from the real API server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from lupa import lua51

from loom.operator.core.model import Condition, StatusBase
from loom.operator.kinds.featureview.api import FeatureViewStatus
from loom.operator.kinds.inferencegraph.api import InferenceGraphStatus
from loom.operator.kinds.inferenceservice.api import InferenceServiceStatus
from loom.operator.kinds.trainingjob.api import TrainingJobStatus

DOCS = Path(__file__).resolve().parents[2] / "docs"
SCRIPT = (DOCS / "argocd-health.lua").read_text()


def health(obj: dict[str, Any]) -> tuple[str, str]:
    """What Argo CD would show for this object."""
    lua = lua51.LuaRuntime()
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(SCRIPT)
    return str(result["status"]), str(result["message"])


def loom_object(kind: str, status: StatusBase | None, generation: int = 3) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": "x", "namespace": "team-a", "generation": generation},
        "spec": {},
    }
    if status is not None:
        obj["status"] = status.model_dump(by_alias=True, mode="json", exclude_none=True)
    return obj


def ready(status: str, reason: str = "", message: str = "") -> list[Condition]:
    return [
        Condition(type="Other", status="True", reason="Whatever"),
        Condition(type="Ready", status=status, reason=reason, message=message, observed_generation=3),  # type: ignore[arg-type]
    ]


STATUS: dict[str, type[StatusBase]] = {
    "TrainingJob": TrainingJobStatus,
    "InferenceService": InferenceServiceStatus,
    "InferenceGraph": InferenceGraphStatus,
    "FeatureView": FeatureViewStatus,
}
NO_READY = ("", "")

# (kind, phase, Ready (status, reason[, message]), observedGeneration, Argo CD health, what its message holds);
# objects are at generation 3.
CASES: list[tuple[str, str, tuple[str, ...], int, str, str]] = [
    ("TrainingJob", "Running", ("True", "WorkersRunning"), 2, "Progressing", "observe generation 3"),
    ("TrainingJob", "Running", ("True", "WorkersRunning"), 3, "Healthy", "Running"),
    ("TrainingJob", "Succeeded", ("True", "Succeeded"), 3, "Healthy", "Succeeded"),
    ("TrainingJob", "Failed", ("False", "BackoffLimitExceeded", "3 restarts"), 3, "Degraded", "3 restarts"),
    ("TrainingJob", "Suspended", ("False", "Suspended"), 3, "Suspended", "Suspended"),
    ("TrainingJob", "Pending", ("False", "Unschedulable", "0/4 nodes have 8 GPUs"), 3, "Degraded", "0/4 nodes"),
    ("TrainingJob", "Pending", ("False", "WaitingForWorkers", "1/2 up"), 3, "Progressing", "WaitingForWorkers: 1/2"),
    ("InferenceService", "Loading", ("False", "RollingOut", "0 ready"), 3, "Progressing", "RollingOut"),
    ("InferenceService", "Ready", ("True", "Serving", "2 replica(s) ready"), 3, "Healthy", "2 replica(s) ready"),
    ("InferenceService", "Degraded", ("True", "Serving", "1 replica(s) ready"), 3, "Degraded", "1 replica(s)"),
    ("InferenceService", "Pending", ("False", "ScaledToZero", "no replica runs"), 3, "Healthy", "ScaledToZero"),
    ("InferenceService", "Pending", ("False", "InvalidSpec", "spec.model: no uri"), 3, "Degraded", "no uri"),
    ("InferenceService", "Loading", ("False", "FetchFailed", "s3://m: 403"), 3, "Degraded", "FetchFailed"),
    ("InferenceService", "Loading", ("False", "CrashLoopBackOff", "server exits"), 3, "Degraded", "server exits"),
    ("InferenceGraph", "Pending", ("False", "ServiceNotFound", "chargpt-current"), 3, "Progressing", "NotFound"),
    ("InferenceGraph", "Failed", ("False", "InvalidGraph", "cycle a -> b -> a"), 3, "Degraded", "cycle"),
    ("InferenceGraph", "Ready", ("True", "Serving"), 3, "Healthy", "Ready"),
    ("FeatureView", "Materializing", ("False", "NotYetMaterialized"), 3, "Progressing", "NotYetMaterialized"),
    ("FeatureView", "Ready", ("True", "Ready", "ok"), 3, "Healthy", "ok"),
    ("FeatureView", "Pending", NO_READY, 3, "Progressing", "No Ready condition yet (phase Pending)"),
]


def status_of(kind: str, phase: str, ready_args: tuple[str, ...], observed: int) -> StatusBase:
    conditions = ready(*ready_args) if ready_args != NO_READY else []
    return STATUS[kind](observed_generation=observed, phase=phase, conditions=conditions)  # type: ignore[call-arg]


def test_an_object_the_operator_has_not_seen_is_progressing() -> None:
    assert health(loom_object("TrainingJob", None)) == ("Progressing", "Waiting for the Loom operator")


@pytest.mark.parametrize(("kind", "phase", "ready_args", "observed", "expected", "message"), CASES)
def test_health_of_each_kind(
    kind: str, phase: str, ready_args: tuple[str, ...], observed: int, expected: str, message: str
) -> None:
    got, said = health(loom_object(kind, status_of(kind, phase, ready_args, observed)))
    assert got == expected and message in said, (got, said)


def test_an_object_without_generation_is_judged_on_its_status() -> None:
    obj = loom_object("TrainingJob", TrainingJobStatus(phase="Running", conditions=ready("True", "WorkersRunning")))
    del obj["metadata"]["generation"]
    assert "observedGeneration" not in obj["status"]
    assert health(obj)[0] == "Healthy"


def test_the_argocd_cm_patch_carries_the_script_for_every_kind() -> None:
    patch = yaml.safe_load((DOCS / "argocd-cm-loom-health.yaml").read_text())
    keys = {f"resource.customizations.health.loom.dev_{k}" for k in ("TrainingJob", "InferenceService",
                                                                      "InferenceGraph", "FeatureView")}  # fmt: skip
    assert set(patch["data"]) == keys
    assert all(value == SCRIPT for value in patch["data"].values())
