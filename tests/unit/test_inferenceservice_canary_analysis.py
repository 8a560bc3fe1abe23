"""The canary analysis inside the InferenceService pass, against the in-memory API server: steps advance the
canary's share, the verdict promotes or rolls back, overrides, a rejected version never comes back, and a pass
killed between writing the verdict and applying it resumes without repeating or skipping a step.

Every pass builds a fresh reconciler (as a restarted operator would): all it knows comes from the cluster.
Checks that read Prometheus are covered by the decision's tests and the e2e test; here steps move on time alone.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from loom.operator.core.reconcile import run
from loom.operator.kinds.inferenceservice import controller

from .test_inferenceservice_controller import SETTINGS, FakeApi, api, cond, put_isvc, spec

__all__ = ["api"]  # the fake API server fixture, shared with the controller tests

T0 = datetime(2026, 11, 26, 2, 0, 0, tzinfo=UTC)


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the API server applies it."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


@pytest.fixture
def cluster(api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    async def patch_status(api_version: str, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        obj = api.objects[api.key(api_version, kind, namespace, name)]
        obj["status"] = merge(obj.get("status", {}), status)

    async def merge_patch(api_version: str, kind: str, namespace: str, name: str, body: dict[str, Any],
                          **_: Any) -> dict[str, Any]:
        key = api.key(api_version, kind, namespace, name)
        api.objects[key] = merge(api.objects[key], body)
        return copy.deepcopy(api.objects[key])

    monkeypatch.setattr(controller.kube, "patch_status", patch_status)
    monkeypatch.setattr(controller.kube, "merge_patch", merge_patch)
    return api


ANALYSIS = {"steps": [{"weight": 20, "pauseSeconds": 60}, {"weight": 60, "pauseSeconds": 60}], "intervalSeconds": 10}


def analysed(version: str) -> dict[str, Any]:
    return {**spec(version), "rollout": {"analysis": ANALYSIS}}


class Clock:
    def __init__(self) -> None:
        self.now = T0
        self.asked: list[float] = []

    async def tick(self, api: FakeApi, seconds: float = 0) -> dict[str, Any]:
        self.now += timedelta(seconds=seconds)
        reconciler = controller.ServiceReconciler(SETTINGS, None, lambda ns, n, s: self.asked.append(s),
                                                  now=lambda: self.now)  # fmt: skip
        await run(reconciler, "ml", "gpt")
        return dict(api.isvc()["status"])


def replicas(api: FakeApi) -> tuple[int, int]:
    stable, canary = api.deployment("gpt"), api.deployment("gpt-canary")
    return (stable or {}).get("spec", {}).get("replicas", 0), (canary or {}).get("spec", {}).get("replicas", 0)


def analysis_of(status: dict[str, Any]) -> dict[str, Any]:
    return dict(status["rollout"]["analysis"])


async def steady(api: FakeApi, clock: Clock, version: str) -> None:
    put_isvc(api, analysed(version))
    await clock.tick(api)
    api.settle("gpt")
    await clock.tick(api)


async def test_steps_advance_then_promote(cluster: FakeApi) -> None:
    api, clock = cluster, Clock()
    await steady(api, clock, "v1")
    put_isvc(api, analysed("v2"))
    status = await clock.tick(api)
    assert (api.model("gpt"), api.model("gpt-canary")) == ("v1", "v2")
    assert replicas(api) == (4, 1)  # 20% of 5
    state = analysis_of(status)
    assert (state["step"], state["weight"], state["verdict"]) == ("1/2", 20, "Waiting")
    assert status["rollout"]["trafficSplit"] == "replica-weighted"
    assert ("Normal", "CanaryStarted") in api.events
    # The pause starts only once the canary is ready at its share.
    status = await clock.tick(api, 300)
    assert analysis_of(status).get("stepStartedAt") is None
    api.settle("gpt")
    api.settle("gpt-canary")
    status = await clock.tick(api, 1)
    assert analysis_of(status)["verdict"] == "Analyzing" and ("Normal", "CanaryStep") in api.events
    assert cond(status, "CanaryAnalysis")[0] == "Unknown"
    # The runner is asked back for the step's first evaluation: one window (the default 60 s) of the step's own data.
    assert clock.asked and clock.asked[-1] == 60
    status = await clock.tick(api, 30)
    assert analysis_of(status)["step"] == "1/2"
    status = await clock.tick(api, 31)  # the pause is over
    assert (analysis_of(status)["step"], analysis_of(status)["weight"]) == ("2/2", 60)
    assert replicas(api) == (2, 3) and ("Normal", "CanaryAdvanced") in api.events
    api.settle("gpt")
    api.settle("gpt-canary")
    await clock.tick(api, 1)
    status = await clock.tick(api, 61)
    assert analysis_of(status)["verdict"] == "Promoted"
    assert cond(status, "CanaryAnalysis") == ("True", "AnalysisPassed")
    assert api.model("gpt") == "v2" and replicas(api)[0] == 5  # the stable track rolls to v2
    api.settle("gpt")
    status = await clock.tick(api, 1)
    assert api.deployment("gpt-canary") is None and status["modelVersion"] == "v2"
    assert analysis_of(status)["verdict"] == "Promoted"  # kept for kubectl get until the next canary


async def test_abort_rejects_the_version_for_good_and_retry_brings_it_back(cluster: FakeApi) -> None:
    api, clock = cluster, Clock()
    await steady(api, clock, "v1")
    put_isvc(api, analysed("v2"))
    await clock.tick(api)
    api.settle("gpt")
    api.settle("gpt-canary")
    await clock.tick(api, 1)
    api.isvc()["metadata"]["annotations"] = {"loom.dev/canary": "abort"}
    status = await clock.tick(api, 5)
    assert analysis_of(status)["verdict"] == "RolledBack" and analysis_of(status)["reason"] == "Aborted"
    assert [r["modelVersion"] for r in status["rollout"]["rejected"]] == ["v2"]
    assert "loom.dev/canary" not in (api.isvc()["metadata"].get("annotations") or {})  # consumed
    assert ("Warning", "CanaryRolledBack") in api.events
    assert api.model("gpt") == "v1"
    # The rejected canary leaves at once (its share back to the stable replicas), the stable track grows back.
    assert api.deployment("gpt-canary") is None and replicas(api) == (5, 0)
    api.settle("gpt")
    await clock.tick(api, 1)
    assert api.deployment("gpt-canary") is None
    # The spec still names v2: it is never tried again, however many passes come.
    for _ in range(3):
        status = await clock.tick(api, 600)
    assert api.deployment("gpt-canary") is None and api.model("gpt") == "v1"
    assert cond(status, "CanaryAnalysis") == ("False", "Aborted")
    # Unless asked.
    api.isvc()["metadata"]["annotations"] = {"loom.dev/canary": "retry"}
    status = await clock.tick(api, 1)
    assert api.model("gpt-canary") == "v2" and status["rollout"]["rejected"] == []
    assert analysis_of(status)["verdict"] == "Waiting"


async def test_promote_now(cluster: FakeApi) -> None:
    api, clock = cluster, Clock()
    await steady(api, clock, "v1")
    put_isvc(api, analysed("v2"))
    await clock.tick(api)
    api.isvc()["metadata"]["annotations"] = {"loom.dev/canary": "promote"}
    status = await clock.tick(api, 1)
    assert analysis_of(status)["reason"] == "PromotedByAnnotation" and api.model("gpt") == "v2"


async def test_a_pass_killed_after_the_verdict_resumes_without_skipping_a_step(
    cluster: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, clock = cluster, Clock()
    await steady(api, clock, "v1")
    put_isvc(api, analysed("v2"))
    await clock.tick(api)
    api.settle("gpt")
    api.settle("gpt-canary")
    await clock.tick(api, 1)
    real_apply = controller.kube.apply

    async def dies_on_deployments(manifest: dict[str, Any], **kw: Any) -> dict[str, Any]:
        if manifest["kind"] == "Deployment":
            raise RuntimeError("operator killed")
        return await real_apply(manifest, **kw)

    monkeypatch.setattr(controller.kube, "apply", dies_on_deployments)
    with pytest.raises(RuntimeError):
        await clock.tick(api, 61)  # the step is over: the advance is written, then the process dies
    assert analysis_of(api.isvc()["status"])["step"] == "2/2"
    assert replicas(api) == (4, 1)  # nothing applied yet
    monkeypatch.setattr(controller.kube, "apply", real_apply)
    status = await clock.tick(api, 1)  # the restarted operator
    assert replicas(api) == (2, 3)
    state = analysis_of(status)
    assert (state["step"], state["verdict"]) == ("2/2", "Waiting")  # step 2 once, not step 2 skipped to a promotion
    assert api.events.count(("Normal", "CanaryAdvanced")) == 1  # announced with the state, before the crash
