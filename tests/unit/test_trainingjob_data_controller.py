"""The training-data I/O of the TrainingJob controller against an in-memory API server: it creates the retrieval Job
once (a pass repeated after an operator crash finds it and waits), and never before the view is registered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from loom.operator.core import client as kube
from loom.operator.kinds.trainingjob.api import TrainingJobSpec
from loom.operator.kinds.trainingjob.data.io import observe_training_data

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class FakeApi:
    """Objects by (kind, name); label selectors of the form k=v,k=v; apply creates or replaces."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.applied: list[str] = []

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, name))

    async def list_objects(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        wanted = dict(part.split("=", 1) for part in (label_selector or "").split(",") if part)
        return [
            obj
            for (k, _), obj in self.objects.items()
            if k == kind and all((obj["metadata"].get("labels") or {}).get(a) == b for a, b in wanted.items())
        ]

    async def apply(self, manifest: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.applied.append(f"{manifest['kind']}/{manifest['metadata']['name']}")
        self.objects[(manifest["kind"], manifest["metadata"]["name"])] = manifest
        return manifest


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    fake = FakeApi()
    for name in ("get", "list_objects", "apply"):
        monkeypatch.setattr(kube, name, getattr(fake, name))
    return fake


def training_job() -> tuple[dict[str, Any], TrainingJobSpec]:
    doc = yaml.safe_load((EXAMPLES / "trainingjob-tabular-features.yaml").read_text())
    doc["metadata"].update(namespace="ns", uid="tj-uid")
    return doc, TrainingJobSpec.model_validate(doc["spec"])


def feature_view(registered: bool) -> dict[str, Any]:
    doc = yaml.safe_load((EXAMPLES / "featureview-driver-stats.yaml").read_text())
    doc["metadata"].update(namespace="ns", uid="fv-uid", creationTimestamp="2026-01-01T00:00:00Z")
    doc["status"] = {"conditions": [{"type": "Registered", "status": "True" if registered else "False",
                                     "reason": "Registered" if registered else "Applying", "message": ""}]}  # fmt: skip
    return dict(doc)


async def test_retrieval_job_is_created_once_and_only_for_a_registered_view(api: FakeApi) -> None:
    job, spec = training_job()
    missing = await observe_training_data(job, spec, "loom/features:1")
    assert missing is not None and missing.reason == "FeatureViewNotFound"
    api.objects[("FeatureView", "driver-stats")] = feature_view(registered=False)
    waiting = await observe_training_data(job, spec, "loom/features:1")
    assert waiting is not None and waiting.reason == "FeatureViewNotRegistered"
    assert api.applied == []

    api.objects[("FeatureView", "driver-stats")] = feature_view(registered=True)
    first = await observe_training_data(job, spec, "loom/features:1")
    assert first is not None and first.state == "Running"
    assert api.applied == ["Job/driver-conversion-training-data"]
    # An operator killed after creating it: the next pass (any replica) finds the Job and creates nothing.
    again = await observe_training_data(job, spec, "loom/features:1")
    assert again is not None and again.state == "Running"
    assert api.applied == ["Job/driver-conversion-training-data"]

    # The Job finished: its pod's termination message is the result.
    created = api.objects[("Job", "driver-conversion-training-data")]
    created["status"] = {"succeeded": 1, "completionTime": "2026-03-01T12:01:00Z"}
    message = {"exitCode": 0, "outcome": "Succeeded", "rows": 235, "rowsWithoutFeatures": 0,
               "output": "s3://loom-features/loom-training-data/ns/driver-conversion.parquet"}  # fmt: skip
    api.objects[("Pod", "driver-conversion-training-data-x")] = {
        "metadata": {"name": "driver-conversion-training-data-x", "creationTimestamp": "2026-03-01T12:00:00Z",
                     "labels": {"batch.kubernetes.io/job-name": "driver-conversion-training-data"}},
        "status": {"containerStatuses": [{"name": "feast", "state": {"terminated": {
            "exitCode": 0, "message": json.dumps(message)}}}]},
    }  # fmt: skip
    done = await observe_training_data(job, spec, "loom/features:1")
    assert done is not None and done.state == "Succeeded"
    assert (done.status.rows, done.status.output) == (235, message["output"])
    assert api.applied == ["Job/driver-conversion-training-data"]
