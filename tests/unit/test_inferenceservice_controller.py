"""The reconcile pass against an in-memory API server: create, canary, promotion, rollback, train-to-serve.

The fake stores what is applied (bumping metadata.generation when the spec changes, as the API server does) and
lets a test play the Deployment controller (`settle`). It checks the controller's sequencing: what it applies,
what it deletes and when, and what status it writes. Rendering details are covered by the render tests; the real
API server is exercised in e2e/tests/test_inferenceservice.py.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import kopf
import pytest

from loom.devstack.images import IMAGE_SETTINGS
from loom.e2e.stack_images import DISTINCT_IMAGE_SETTINGS, pod_images
from loom.operator.kinds.inferenceservice import controller
from loom.operator.kinds.inferenceservice.llm import io as llm_io
from loom.operator.kinds.inferenceservice.source.model import MODEL_ANNOTATION, ModelRef
from loom.operator.settings import OperatorSettings

Key = tuple[str, str, str | None, str]


class FakeApi:
    def __init__(self) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.deleted: list[Key] = []
        self.events: list[tuple[str, str]] = []

    @staticmethod
    def key(api_version: str, kind: str, namespace: str | None, name: str) -> Key:
        return (api_version, kind, namespace, name)

    async def apply(self, manifest: dict[str, Any], **_: Any) -> dict[str, Any]:
        meta = manifest["metadata"]
        key = self.key(manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"])
        old = self.objects.get(key)
        new = copy.deepcopy(manifest)
        generation = 1
        if old is not None:
            generation = old["metadata"]["generation"] + (old.get("spec") != new.get("spec"))
            new["status"] = old.get("status", {})
        new["metadata"]["generation"] = generation
        self.objects[key] = new
        return copy.deepcopy(new)

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        found = self.objects.get(self.key(api_version, kind, namespace, name))
        return copy.deepcopy(found) if found else None

    async def list_objects(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(o)
            for (a, k, ns, _), o in self.objects.items()
            if (a, k, ns) == (api_version, kind, namespace)
        ]

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str, **_: Any) -> bool:
        key = self.key(api_version, kind, namespace, name)
        self.deleted.append(key)
        return self.objects.pop(key, None) is not None

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> None:
        obj = self.objects[self.key(api_version, kind, namespace, name)]
        merged = {**obj.get("status", {}), **status}
        obj["status"] = {k: v for k, v in merged.items() if v is not None}

    # ---- helpers for the test, playing the Deployment controller
    def deployment(self, name: str) -> dict[str, Any] | None:
        return self.objects.get(("apps/v1", "Deployment", "ml", name))

    def settle(self, name: str) -> None:
        """The Deployment controller finished: every wanted replica runs the current template and is ready."""
        dep = self.objects[("apps/v1", "Deployment", "ml", name)]
        n = dep["spec"]["replicas"]
        dep["status"] = {
            "observedGeneration": dep["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
            "readyReplicas": n, "availableReplicas": n,
        }  # fmt: skip

    def model(self, name: str) -> str | None:
        dep = self.deployment(name)
        if dep is None:
            return None
        ref = ModelRef.from_annotation(dep["metadata"]["annotations"][MODEL_ANNOTATION])
        return ref.version if ref else None

    def isvc(self) -> dict[str, Any]:
        return self.objects[("loom.dev/v1alpha1", "InferenceService", "ml", "gpt")]


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    fake = FakeApi()
    for name in ("apply", "get", "list_objects", "delete", "patch_status"):
        monkeypatch.setattr(controller.kube, name, getattr(fake, name))
    monkeypatch.setattr(
        kopf, "event", lambda body, *, type, reason, message: fake.events.append((type, reason))
    )
    return fake


SETTINGS = OperatorSettings(**{**IMAGE_SETTINGS, "server_image": "localhost/loom/server:test"})


def put_isvc(api: FakeApi, spec: dict[str, Any]) -> dict[str, Any]:
    key = ("loom.dev/v1alpha1", "InferenceService", "ml", "gpt")
    old = api.objects.get(key)
    generation = 1 if old is None else old["metadata"]["generation"] + 1
    body = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "gpt", "namespace": "ml", "uid": "uid-1", "generation": generation},
        "spec": spec,
        "status": (old or {}).get("status", {}),
    }
    api.objects[key] = body
    return body


async def reconcile(api: FakeApi) -> dict[str, Any]:
    await controller.reconcile("ml", "gpt", SETTINGS)
    return dict(api.isvc()["status"])


def spec(version: str, canary: int | None = None, replicas: int = 5) -> dict[str, Any]:
    wire: dict[str, Any] = {"model": {"uri": f"s3://models/gpt/{version}"}, "handler": "noop", "replicas": replicas}
    if canary is not None:
        wire["rollout"] = {"canaryPercent": canary}
    return wire


def cond(status: dict[str, Any], ctype: str) -> tuple[str, str]:
    found = next(c for c in status["conditions"] if c["type"] == ctype)
    return found["status"], found["reason"]


async def test_create_renders_children_and_becomes_ready(api: FakeApi) -> None:
    put_isvc(api, spec("v1"))
    status = await reconcile(api)
    assert api.objects[("v1", "Service", "ml", "gpt")]["spec"]["ports"][0]["port"] == 80
    assert ("v1", "ConfigMap", "ml", "gpt-config") in api.objects
    assert api.model("gpt") == "v1" and api.deployment("gpt")["spec"]["replicas"] == 5  # type: ignore[index]
    assert status["phase"] == "Loading"
    assert cond(status, "Ready") == ("False", "Pending")
    api.settle("gpt")
    status = await reconcile(api)
    assert cond(status, "RolledOut") == ("True", "RolledOut")
    assert cond(status, "Ready") == ("True", "Serving")
    assert (status["readyReplicas"], status["modelVersion"], status["url"]) == (5, "v1", "http://gpt.ml.svc")
    assert ("Normal", "Serving") in api.events
    # A second pass changes nothing and posts no new event.
    before = copy.deepcopy(api.objects)
    events = len(api.events)
    await reconcile(api)
    assert api.objects == before and len(api.events) == events


async def test_canary_promotion_and_rollback(api: FakeApi) -> None:
    put_isvc(api, spec("v1"))
    await reconcile(api)
    api.settle("gpt")
    await reconcile(api)

    # New model with 20% canary: v1 stays stable on 4 replicas, v2 runs on 1.
    put_isvc(api, spec("v2", canary=20))
    status = await reconcile(api)
    assert (api.model("gpt"), api.deployment("gpt")["spec"]["replicas"]) == ("v1", 4)  # type: ignore[index]
    assert (api.model("gpt-canary"), api.deployment("gpt-canary")["spec"]["replicas"]) == ("v2", 1)  # type: ignore[index]
    api.settle("gpt")
    api.settle("gpt-canary")
    status = await reconcile(api)
    assert status["canary"] == {"percent": 20, "modelVersion": "v2", "replicas": 1, "readyReplicas": 1}
    assert status["modelVersion"] == "v1"
    assert cond(status, "RolledOut") == ("True", "CanaryRolledOut")

    # Promote: stable rolls to v2; the canary keeps serving until the stable track is rolled out.
    put_isvc(api, spec("v2"))
    status = await reconcile(api)
    assert (api.model("gpt"), api.deployment("gpt")["spec"]["replicas"]) == ("v2", 5)  # type: ignore[index]
    assert api.deployment("gpt-canary") is not None
    assert cond(status, "RolledOut") == ("False", "Promoting")
    api.settle("gpt")
    status = await reconcile(api)
    assert api.deployment("gpt-canary") is None
    assert ("v1", "ConfigMap", "ml", "gpt-canary-config") not in api.objects
    assert "canary" not in status and status["modelVersion"] == "v2"
    assert cond(status, "RolledOut") == ("True", "RolledOut")

    # Another canary, then roll back by setting the model back to the stable one.
    put_isvc(api, spec("v3", canary=20))
    await reconcile(api)
    assert api.model("gpt-canary") == "v3"
    put_isvc(api, spec("v2", canary=20))
    status = await reconcile(api)
    assert api.model("gpt") == "v2"
    assert cond(status, "RolledOut") == ("False", "RollingBack")
    api.settle("gpt")
    status = await reconcile(api)
    assert api.deployment("gpt-canary") is None
    assert cond(status, "RolledOut") == ("True", "RolledOut")


async def test_operator_restart_mid_canary_keeps_the_previous_version(api: FakeApi) -> None:
    put_isvc(api, spec("v1"))
    await reconcile(api)
    api.settle("gpt")
    put_isvc(api, spec("v2", canary=20))
    await reconcile(api)
    # A fresh process: the pass reads everything it needs from the cluster, nothing from memory.
    await reconcile(api)
    assert (api.model("gpt"), api.model("gpt-canary")) == ("v1", "v2")


async def test_invalid_rollout_is_a_condition_and_touches_nothing(api: FakeApi) -> None:
    put_isvc(api, {**spec("v1"), "rollout": {"maxSurge": 0, "maxUnavailable": 0}})
    status = await reconcile(api)
    assert cond(status, "Ready") == ("False", "InvalidSpec")
    assert status["phase"] == "Failed"
    assert api.deployment("gpt") is None
    assert ("Warning", "InvalidSpec") in api.events


async def test_an_unusable_change_keeps_the_running_model_and_says_why(api: FakeApi) -> None:
    put_isvc(api, spec("v1"))
    await reconcile(api)
    api.settle("gpt")
    await reconcile(api)
    before = copy.deepcopy(api.deployment("gpt"))
    put_isvc(api, {**spec("v2"), "rollout": {"maxSurge": "0%", "maxUnavailable": 0}})
    status = await reconcile(api)
    assert api.deployment("gpt") == before  # nothing applied
    assert cond(status, "RolledOut") == ("False", "InvalidSpec")
    assert cond(status, "Ready") == ("True", "Serving")
    assert (status["phase"], status["modelVersion"]) == ("Degraded", "v1")


async def test_a_handler_the_server_refuses_is_an_invalid_spec(api: FakeApi) -> None:
    put_isvc(api, {**spec("v1"), "handler": "not a handler"})
    status = await reconcile(api)
    assert cond(status, "Ready") == ("False", "InvalidSpec")
    assert "handler" in next(c for c in status["conditions"] if c["type"] == "Ready")["message"]
    assert api.deployment("gpt") is None


def training_job(api: FakeApi, latest: str | None, step: int | None) -> None:
    api.objects[("loom.dev/v1alpha1", "TrainingJob", "ml", "train")] = {
        "apiVersion": "loom.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "train", "namespace": "ml", "generation": 1},
        "spec": {"checkpoint": {"uri": "s3://ckpt/train", "secretRef": {"name": "s3"}}},
        "status": {"phase": "Running", "checkpoint": {"latest": latest, "step": step} if latest else None},
    }  # fmt: skip


async def test_from_training_job_waits_for_a_checkpoint_then_follows_new_ones(api: FakeApi) -> None:
    put_isvc(api, {"model": {"fromTrainingJob": {"name": "train"}}, "replicas": 1})
    status = await reconcile(api)
    assert cond(status, "ModelLoaded") == ("False", "TrainingJobNotFound")
    assert api.deployment("gpt") is None

    training_job(api, None, None)
    status = await reconcile(api)
    assert cond(status, "ModelLoaded") == ("False", "NoCheckpointYet")
    assert status["phase"] == "Pending"

    training_job(api, "s3://ckpt/train/step-100/", 100)
    await reconcile(api)
    assert api.model("gpt") == "step-100"
    env = api.deployment("gpt")["spec"]["template"]["spec"]["containers"][0]["env"]  # type: ignore[index]
    assert {
        "name": "AWS_ACCESS_KEY_ID",
        "valueFrom": {"secretKeyRef": {"name": "s3", "key": "AWS_ACCESS_KEY_ID"}},
    } in env
    api.settle("gpt")

    # The job writes a newer checkpoint: the same pass rolls it out, no spec change needed.
    training_job(api, "s3://ckpt/train/step-200/", 200)
    status = await reconcile(api)
    assert api.model("gpt") == "step-200"
    assert cond(status, "RolledOut") == ("False", "RollingOut")

    # The job disappears: keep serving what was loaded, say why nothing new rolls out.
    del api.objects[("loom.dev/v1alpha1", "TrainingJob", "ml", "train")]
    api.settle("gpt")
    status = await reconcile(api)
    assert api.model("gpt") == "step-200"
    assert cond(status, "Ready") == ("True", "Serving")
    assert cond(status, "RolledOut") == ("False", "TrainingJobNotFound")


def feature_view(api: FakeApi, ready: bool) -> None:
    api.objects[("loom.dev/v1alpha1", "FeatureView", "ml", "driver-stats")] = {
        "apiVersion": "loom.dev/v1alpha1", "kind": "FeatureView",
        "metadata": {"name": "driver-stats", "namespace": "ml", "generation": 1},
        "spec": {
            "project": "rides", "entities": [{"name": "driver_id"}],
            "features": [{"name": "conv_rate", "dtype": "Float32"}, {"name": "trips", "dtype": "Int64"}],
            "source": {"path": "s3://data/driver_stats.parquet"},
        },
        "status": {
            "url": "http://rides-features.ml.svc",
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "Ready", "message": "serving"} if ready
                else {"type": "Ready", "status": "False", "reason": "ServerStarting", "message": "0/1 ready"}
            ],
        },
    }  # fmt: skip


async def test_features_wait_for_a_ready_feature_view_then_reach_the_server_config(api: FakeApi) -> None:
    put_isvc(api, {**spec("v1"), "features": {"featureView": "driver-stats", "entityKeys": ["driver_id"]}})
    status = await reconcile(api)
    assert cond(status, "Ready") == ("False", "FeatureViewNotFound")
    assert (status["phase"], api.deployment("gpt")) == ("Pending", None)
    assert ("Warning", "FeatureViewNotFound") in api.events
    feature_view(api, ready=False)
    status = await reconcile(api)
    assert cond(status, "Ready") == ("False", "FeatureViewNotReady")
    assert "ServerStarting" in next(c for c in status["conditions"] if c["type"] == "Ready")["message"]
    assert api.deployment("gpt") is None

    feature_view(api, ready=True)
    await reconcile(api)
    server = json.loads(api.objects[("v1", "ConfigMap", "ml", "gpt-config")]["data"]["server.json"])
    assert server["features"] == {
        "url": "http://rides-features.ml.svc",
        "featureView": "driver_stats",
        "features": [{"name": "conv_rate", "dtype": "Float32"}, {"name": "trips", "dtype": "Int64"}],
        "entityKeys": ["driver_id"],
        "timeoutMs": 2000.0,
        "connectRetries": 2,
    }
    api.settle("gpt")
    assert cond(await reconcile(api), "Ready") == ("True", "Serving")

    # The view stops being Ready: the running server keeps what it was given, and the condition says why.
    before = copy.deepcopy(api.deployment("gpt"))
    feature_view(api, ready=False)
    status = await reconcile(api)
    assert api.deployment("gpt") == before
    assert cond(status, "RolledOut") == ("False", "FeatureViewNotReady")
    assert (cond(status, "Ready"), status["phase"]) == (("True", "Serving"), "Degraded")


async def test_every_pod_runs_the_server_image_the_operator_was_given(api: FakeApi) -> None:
    """LOOM_SERVER_IMAGE (the chart's <image.registry>/server) is what the model server pods run."""
    settings = OperatorSettings(**DISTINCT_IMAGE_SETTINGS)
    put_isvc(api, spec("v1"))
    await controller.reconcile("ml", "gpt", settings)
    api.settle("gpt")
    await controller.reconcile("ml", "gpt", settings)
    put_isvc(api, spec("v2", canary=20))
    await controller.reconcile("ml", "gpt", settings)
    deployments = [o for (_, kind, _, _), o in api.objects.items() if kind == "Deployment"]
    assert len(deployments) == 2  # stable and canary
    assert set().union(*map(pod_images, deployments)) == {DISTINCT_IMAGE_SETTINGS["server_image"]}


async def test_runtime_vllm_pods_run_the_vllm_image_the_operator_was_given(api: FakeApi) -> None:
    """LOOM_VLLM_IMAGE (the chart's <image.registry>/vllm) is what a runtime vllm service's pods run, fetch step
    included; the server image is not used for them."""
    settings = OperatorSettings(**DISTINCT_IMAGE_SETTINGS)
    put_isvc(api, {**spec("v1"), "handler": "auto", "runtime": "vllm"})
    await controller.reconcile("ml", "gpt", settings)
    deployments = {name: o for (_, kind, _, name), o in api.objects.items() if kind == "Deployment"}
    assert set(deployments) == {"gpt", "gpt-picker"}  # 5 replicas: the endpoint picker in front of them
    assert pod_images(deployments["gpt"]) == {DISTINCT_IMAGE_SETTINGS["vllm_image"]}
    # The picker needs no engine: it runs the server image, as the activator does.
    assert pod_images(deployments["gpt-picker"]) == {DISTINCT_IMAGE_SETTINGS["server_image"]}
    # Status names the OpenAI base URL (the Service's /v1) for vllm only.
    assert api.isvc()["status"]["openaiBaseUrl"] == "http://gpt.ml.svc/v1"
    put_isvc(api, spec("v1"))
    assert "openaiBaseUrl" not in await reconcile(api)


async def test_the_activators_pods_come_from_the_pod_watch_cache_only_when_it_runs(api: FakeApi) -> None:
    """At zero the activator answers for the service: its pods (for why one cannot start) are read from the pod
    index handed in, never LISTed, and only when the service scales to zero through it."""
    from loom.operator.core.kit import owner_of
    from loom.operator.core.reconcile import Pass, parse

    def pod(name: str, component: str) -> dict[str, Any]:
        labels = {"app.kubernetes.io/name": "inferenceservice", "app.kubernetes.io/instance": "gpt",
                  "app.kubernetes.io/component": component, "loom.dev/inferenceservice": "gpt"}  # fmt: skip
        return {"metadata": {"name": name, "namespace": "ml", "labels": labels}, "status": {}}

    index = {
        ("ml", "gpt"): [
            pod("gpt-activator-b", "activator"),
            pod("gpt-x", "server"),
            pod("gpt-activator-a", "activator"),
        ]
    }
    reconciler = controller.ServiceReconciler(SETTINGS, index)
    to_zero = {**spec("v1"), "autoscaling": {"minReplicas": 0, "maxReplicas": 3, "metric": "queue-depth", "target": 4}}
    for wire, expected in ((to_zero, ["gpt-activator-a", "gpt-activator-b"]), (spec("v1"), [])):
        body = put_isvc(api, wire)
        parsed, invalid = parse(reconciler, body)
        assert invalid is None
        observed = await reconciler.observe(Pass("ml", "gpt", body, owner_of(body, "InferenceService"), parsed, None))
        assert [p["metadata"]["name"] for p in observed.activator_pods] == expected


async def test_adapters_reach_the_configmap_in_place_and_their_states_reach_status(
    api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spec.adapters: the resolved list is written into the track's ConfigMap, never into the pod template (the
    running pods load it in place); a TrainingJob's adapter joins once the job succeeded; status shows what the
    replicas report, read from them each pass."""
    from loom.workloads.llm.adapters import AdapterList

    reports: dict[str, Any] = {}

    async def read_reports(pods: list[dict[str, Any]]) -> dict[str, Any]:
        return {p["metadata"]["name"]: reports.get(p["metadata"]["name"], "unreachable") for p in pods}

    monkeypatch.setattr(llm_io, "read_reports", read_reports)
    job_key = ("loom.dev/v1alpha1", "TrainingJob", "ml", "tune")
    api.objects[job_key] = {"metadata": {"name": "tune", "uid": "job-uid-1"},
                            "spec": {"checkpoint": {"uri": "s3://ckpt/tune"}}, "status": {"phase": "Running"}}
    wire = {"model": {"uri": "s3://models/llama/v1", "name": "llama"}, "runtime": "vllm", "replicas": 1,
            "adapters": [{"name": "pirate", "uri": "s3://adapters/pirate"},
                         {"name": "tuned", "fromTrainingJob": {"name": "tune"}}]}
    put_isvc(api, wire)
    status = await reconcile(api)
    listed = AdapterList.model_validate_json(api.objects[("v1", "ConfigMap", "ml", "gpt-config")]["data"]
                                             ["adapters.json"]).adapters
    assert [a.name for a in listed] == ["pirate"]
    assert {a["name"]: a["state"] for a in status["adapters"]} == {"pirate": "Pending", "tuned": "Pending"}
    assert "waiting for its adapter export" in status["adapters"][1]["reason"]
    template = copy.deepcopy(api.deployment("gpt")["spec"]["template"])  # type: ignore[index]

    api.objects[("v1", "Pod", "ml", "gpt-abc")] = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gpt-abc", "namespace": "ml"},
        "status": {"podIP": "127.10.0.5", "conditions": [{"type": "Ready", "status": "True"}]}}
    reports["gpt-abc"] = {"adapters": [{"name": "pirate", "key": listed[0].key, "state": "Loaded"}]}
    api.objects[job_key]["status"] = {"phase": "Succeeded", "checkpoint": {"step": 30}}
    status = await reconcile(api)
    listed = AdapterList.model_validate_json(api.objects[("v1", "ConfigMap", "ml", "gpt-config")]["data"]
                                             ["adapters.json"]).adapters
    assert [(a.name, a.uri) for a in listed] == [("pirate", "s3://adapters/pirate"),
                                                 ("tuned", "s3://ckpt/tune/final")]
    states = {a["name"]: a for a in status["adapters"]}
    assert states["pirate"]["state"] == "Loaded" and states["pirate"]["replicas"] == [
        {"pod": "gpt-abc", "state": "Loaded"}]
    assert states["tuned"]["state"] == "Pending"  # the replica has not read the new list yet
    assert api.deployment("gpt")["spec"]["template"] == template  # type: ignore[index]  # no rollout for adapters


def _leftover(kind: str, api_version: str, name: str, owner_uid: str | None) -> dict[str, Any]:
    refs = [] if owner_uid is None else [{"kind": "InferenceService", "uid": owner_uid, "controller": True}]
    meta = {"name": name, "namespace": "ml", "uid": f"uid-of-{name}", "generation": 1, "ownerReferences": refs}
    return {"apiVersion": api_version, "kind": kind, "metadata": meta, "spec": {}}


async def test_another_shape_left_by_a_killed_operator_goes_and_a_namesakes_objects_stay(api: FakeApi) -> None:
    """The track is a Deployment again; an operator killed between that apply and deleting the pools and the group
    it ran as before left them (ours: they go on the next pass), and objects of Loom's names that are not this
    service's (a service named gpt-decode, someone's gpt-group) are left alone."""
    put_isvc(api, spec("v1"))
    await reconcile(api)
    api.settle("gpt")
    leftovers = {
        ("apps/v1", "Deployment", "ml", "gpt-prefill"): _leftover("Deployment", "apps/v1", "gpt-prefill", "uid-1"),
        ("apps/v1", "Deployment", "ml", "gpt-decode"): _leftover("Deployment", "apps/v1", "gpt-decode", "uid-2"),
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "ml", "gpt-group"): _leftover(
            "LeaderWorkerSet", "leaderworkerset.x-k8s.io/v1", "gpt-group", None
        ),
    }
    api.objects.update(copy.deepcopy(leftovers))
    await reconcile(api)
    assert ("apps/v1", "Deployment", "ml", "gpt-prefill") not in api.objects
    assert api.objects[("apps/v1", "Deployment", "ml", "gpt-decode")] == leftovers[
        ("apps/v1", "Deployment", "ml", "gpt-decode")
    ]
    assert ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "ml", "gpt-group") in api.objects
    assert api.deployment("gpt") is not None
    assert [k for k in api.deleted if k[3] != "gpt-canary" and k[1] != "ConfigMap"] == [
        ("apps/v1", "Deployment", "ml", "gpt-prefill")
    ]
