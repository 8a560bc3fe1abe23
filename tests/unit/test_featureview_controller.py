"""The FeatureView pass against an in-memory API server: one registry writer at a time, Jobs created once,
materialize-now by token, the finalizer-free deletion sweep. The test plays the Job controller (`finish`).
Rendering and status details have their own tests; the real stack runs e2e/tests/test_featureview.py.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from loom.devstack.images import IMAGE_SETTINGS
from loom.e2e.stack_images import DISTINCT_IMAGE_SETTINGS, pod_images
from loom.operator.kinds.featureview import controller
from loom.operator.kinds.featureview.config import delete_job_name
from loom.operator.kinds.featureview.render import MATERIALIZE_NOW, REGISTERED_VIEWS
from loom.operator.settings import OperatorSettings

Key = tuple[str, str, str | None, str]
NS = "ml"
SETTINGS = OperatorSettings(**{**IMAGE_SETTINGS, "features_image": "localhost/loom/features:test"})


class FakeApi:
    def __init__(self) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.created: list[str] = []
        self.events: list[tuple[str, str]] = []
        self.clock = 0

    async def apply(self, manifest: dict[str, Any], **_: Any) -> dict[str, Any]:
        meta = manifest["metadata"]
        key = (manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"])
        if key not in self.objects:
            self.created.append(f"{manifest['kind']}/{meta['name']}")
            self.clock += 1
            manifest = copy.deepcopy(manifest)
            manifest["metadata"]["creationTimestamp"] = f"2026-01-01T00:00:{self.clock:02d}Z"
            if manifest["kind"] == "Job":
                manifest["status"] = {"active": 1}
        else:
            manifest = {**copy.deepcopy(manifest), "status": self.objects[key].get("status", {})}
        self.objects[key] = manifest
        return copy.deepcopy(manifest)

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        found = self.objects.get((api_version, kind, namespace, name))
        return copy.deepcopy(found) if found else None

    async def list_objects(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        wanted = dict(part.split("=", 1) for part in label_selector.split(",")) if label_selector else {}
        return [
            copy.deepcopy(o)
            for (a, k, ns, _), o in self.objects.items()
            if (a, k, ns) == (api_version, kind, namespace)
            and wanted.items() <= (o["metadata"].get("labels") or {}).items()
        ]

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str, **_: Any) -> bool:
        return self.objects.pop((api_version, kind, namespace, name), None) is not None

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> None:
        obj = self.objects[(api_version, kind, namespace, name)]
        merged = {**obj.get("status", {}), **status}
        obj["status"] = {k: v for k, v in merged.items() if v is not None}

    # ---- the test plays the Job controller and the kubelet
    def jobs(self, command: str | None = None) -> list[str]:
        return sorted(
            name
            for (_, kind, _, name), o in self.objects.items()
            if kind == "Job" and command in (None, o["metadata"]["labels"].get("loom.dev/feast-command"))
        )

    def finish(self, job_name: str, result: dict[str, Any], exit_code: int = 0) -> None:
        job = self.objects[("batch/v1", "Job", NS, job_name)]
        if exit_code == 0:
            job["status"] = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
        else:
            job["status"] = {
                "failed": 1,
                "conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}],
            }
        pod_labels = {**job["spec"]["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": job_name}
        self.objects[("v1", "Pod", NS, f"{job_name}-pod")] = {
            "metadata": {"name": f"{job_name}-pod", "labels": pod_labels, "creationTimestamp": "2026-01-01T00:01:00Z"},
            "status": {
                "containerStatuses": [
                    {
                        "name": "feast",
                        "state": {
                            "terminated": {
                                "exitCode": exit_code,
                                "message": json.dumps({"exitCode": exit_code, **result}),
                            }
                        },
                    }
                ]
            },
        }


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    fake = FakeApi()
    for name in ("apply", "get", "list_objects", "delete", "patch_status"):
        monkeypatch.setattr(controller.kube, name, getattr(fake, name))
    monkeypatch.setattr(
        controller.kopf, "event", lambda body, *, type, reason, message: fake.events.append((type, reason))
    )
    return fake


def put_view(api: FakeApi, name: str, created: str, annotations: dict[str, str] | None = None, **spec: Any) -> None:
    wire = {
        "project": "rides",
        "entities": [{"name": "driver_id"}],
        "features": [{"name": f"{name.replace('-', '_')}_value", "dtype": "Float32"}],
        "source": {"path": "/data/x.parquet"},
        **spec,
    }
    api.objects[("loom.dev/v1alpha1", "FeatureView", NS, name)] = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "FeatureView",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "generation": 1,
            "creationTimestamp": created,
            "annotations": annotations or {},
        },
        "spec": wire,
    }


def status(api: FakeApi, name: str) -> dict[str, Any]:
    return dict(api.objects[("loom.dev/v1alpha1", "FeatureView", NS, name)].get("status") or {})


def cond(api: FakeApi, name: str, ctype: str) -> tuple[str, str]:
    found = next(c for c in status(api, name)["conditions"] if c["type"] == ctype)
    return found["status"], found["reason"]


APPLIED = {"command": "apply", "outcome": "Applied", "featureViews": []}


async def test_one_registry_writer_at_a_time_and_jobs_are_created_once(api: FakeApi) -> None:
    put_view(api, "a", "2026-01-01T00:00:00Z")
    put_view(api, "b", "2026-01-01T00:00:01Z")
    await controller.reconcile(NS, "a", SETTINGS)
    await controller.reconcile(NS, "b", SETTINGS)
    [apply_a] = api.jobs("apply")
    assert apply_a.startswith("a-apply-")
    assert cond(api, "b", "Registered") == ("Unknown", "WaitingForWriter")
    assert {"ConfigMap/rides-features", "Service/rides-features", "Deployment/rides-features"} <= set(api.created)
    api.finish(apply_a, APPLIED)
    await controller.reconcile(NS, "b", SETTINGS)
    await controller.reconcile(NS, "a", SETTINGS)
    assert len(api.jobs("apply")) == 2
    assert cond(api, "a", "Registered") == ("True", "Applied")
    created = list(api.created)
    await controller.reconcile(NS, "a", SETTINGS)
    assert api.created == created  # a repeated pass creates nothing


async def test_materialize_now_runs_once_per_token_after_registration(api: FakeApi) -> None:
    put_view(api, "a", "2026-01-01T00:00:00Z", annotations={MATERIALIZE_NOW: "t1"})
    await controller.reconcile(NS, "a", SETTINGS)
    assert api.jobs("materialize") == []  # not registered yet: materialize would fail with NotFound
    [apply_a] = api.jobs("apply")
    api.finish(apply_a, APPLIED)
    await controller.reconcile(NS, "a", SETTINGS)
    [run] = api.jobs("materialize")
    api.finish(run, {"outcome": "Succeeded", "rowsWritten": 7, "window": {"start": "s", "end": "e"}})
    await controller.reconcile(NS, "a", SETTINGS)
    assert api.jobs("materialize") == [run]
    last = status(api, "a")["lastMaterialization"]
    assert (last["rowsWritten"], last["outcome"], last["job"]) == (7, "Succeeded", run)
    assert ("Normal", "Materialized") in api.events


async def test_a_feast_refusal_is_not_retried(api: FakeApi) -> None:
    put_view(api, "a", "2026-01-01T00:00:00Z")
    await controller.reconcile(NS, "a", SETTINGS)
    [apply_a] = api.jobs("apply")
    api.finish(apply_a, {"reason": "InvalidSource", "message": "no column 'ts'"}, exit_code=3)
    await controller.reconcile(NS, "a", SETTINGS)
    await controller.reconcile(NS, "a", SETTINGS)
    assert api.jobs("apply") == [apply_a]
    assert cond(api, "a", "Registered") == ("False", "InvalidSource")
    assert status(api, "a")["phase"] == "Failed"


async def test_a_deleted_view_is_removed_from_the_registry_by_a_remaining_one(api: FakeApi) -> None:
    put_view(api, "a", "2026-01-01T00:00:00Z")
    put_view(api, "gone", "2026-01-01T00:00:01Z")
    await controller.reconcile(NS, "a", SETTINGS)
    api.finish(api.jobs("apply")[0], APPLIED)
    config_key = ("v1", "ConfigMap", NS, "rides-features")
    assert json.loads(api.objects[config_key]["metadata"]["annotations"][REGISTERED_VIEWS]) == ["a", "gone"]
    del api.objects[("loom.dev/v1alpha1", "FeatureView", NS, "gone")]  # deleted while nobody watched
    await controller.reconcile(NS, "a", SETTINGS)
    delete_job = delete_job_name("rides", "gone")
    assert api.jobs("delete") == [delete_job]
    # Until it has succeeded the project remembers the name, so a crash cannot lose the deletion.
    assert "gone" in json.loads(api.objects[config_key]["metadata"]["annotations"][REGISTERED_VIEWS])
    api.finish(delete_job, {"command": "delete", "outcome": "Deleted", "deleted": ["gone"]})
    await controller.reconcile(NS, "a", SETTINGS)
    assert json.loads(api.objects[config_key]["metadata"]["annotations"][REGISTERED_VIEWS]) == ["a"]


async def test_an_invalid_spec_is_a_condition(api: FakeApi) -> None:
    put_view(api, "a", "2026-01-01T00:00:00Z", ttl="forever")
    await controller.reconcile(NS, "a", SETTINGS)
    assert cond(api, "a", "Registered") == ("False", "InvalidSpec")
    assert api.jobs() == []


async def test_every_feast_pod_runs_the_features_image_the_operator_was_given(api: FakeApi) -> None:
    """LOOM_FEATURES_IMAGE (the chart's <image.registry>/features) is what the Feast Jobs, the materialization
    CronJob and the feature server run."""
    settings = OperatorSettings(**DISTINCT_IMAGE_SETTINGS)
    put_view(api, "a", "2026-01-01T00:00:00Z", annotations={MATERIALIZE_NOW: "t1"})
    await controller.reconcile(NS, "a", settings)
    [apply_a] = api.jobs("apply")
    api.finish(apply_a, APPLIED)
    await controller.reconcile(NS, "a", settings)
    kinds = {"Job", "CronJob", "Deployment"}
    workloads = [o for (_, kind, _, _), o in api.objects.items() if kind in kinds]
    assert {o["kind"] for o in workloads} == kinds, [o["kind"] for o in workloads]
    assert set().union(*map(pod_images, workloads)) == {DISTINCT_IMAGE_SETTINGS["features_image"]}
