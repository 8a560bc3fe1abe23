"""InferenceService status: conditions with reasons, phase, replica counts, canary state, events on transitions."""

from __future__ import annotations

from typing import Any

import pytest

from loom.operator.kinds.inferenceservice.api import InferenceServiceStatus
from loom.operator.kinds.inferenceservice.render import CONFIG_HASH_ANNOTATION
from loom.operator.kinds.inferenceservice.rollout import RolloutPlan
from loom.operator.kinds.inferenceservice.source.model import MODEL_ANNOTATION, ModelRef, ResolveError
from loom.operator.kinds.inferenceservice.status import Observed, compute_status, diagnose

OWNER = {
    "apiVersion": "loom.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "gpt", "namespace": "ml", "uid": "u", "generation": 4},
}


def ref(version: str) -> ModelRef:
    return ModelRef(storage_uri=f"s3://m/{version}", storage_kind="s3", handler="noop", version=version)


def deployment(model: ModelRef, wanted: int, ready: int, *, updated: int | None = None) -> dict[str, Any]:
    updated = wanted if updated is None else updated
    return {
        "metadata": {"generation": 2, "annotations": {MODEL_ANNOTATION: model.to_annotation()}},
        "spec": {"replicas": wanted},
        "status": {
            "observedGeneration": 2,
            "replicas": max(wanted, updated),
            "updatedReplicas": updated,
            "readyReplicas": ready,
            "availableReplicas": ready,
        },
    }


def pod(config_hash: str, ready: bool, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": f"gpt-{config_hash}", "annotations": {CONFIG_HASH_ANNOTATION: config_hash}},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}], **status},
    }


def conditions(status: InferenceServiceStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


def test_steady_and_ready() -> None:
    observed = Observed(
        plan=RolloutPlan(stable_ref=ref("v1"), stable_replicas=2),
        stable=deployment(ref("v1"), 2, 2),
        canary=None,
        pods=[pod("h1", True), pod("h1", True)],
        serving_config_hash="h1",
    )
    status, events = compute_status(OWNER, observed, None)
    assert conditions(status) == {
        "ModelLoaded": ("True", "Loaded"),
        "RolledOut": ("True", "RolledOut"),
        "Ready": ("True", "Serving"),
    }
    assert status.phase == "Ready"
    assert (status.replicas, status.ready_replicas, status.model_version) == (2, 2, "v1")
    assert status.url == "http://gpt.ml.svc"
    assert status.selector and "app.kubernetes.io/instance=gpt" in status.selector
    assert status.canary is None
    assert status.observed_generation == 4
    assert all(c.observed_generation == 4 for c in status.conditions)
    assert {e.reason for e in events} == {"Loaded", "RolledOut", "Serving"}
    assert all(e.type == "Normal" for e in events)
    # The same observation again: no transition, no event.
    again, events = compute_status(OWNER, observed, status)
    assert events == []
    assert [c.last_transition_time for c in again.conditions] == [c.last_transition_time for c in status.conditions]


def test_rolling_update_serves_old_replicas_while_new_ones_load() -> None:
    observed = Observed(
        plan=RolloutPlan(stable_ref=ref("v2"), stable_replicas=2),
        stable=deployment(ref("v2"), 2, 2, updated=1),
        canary=None,
        pods=[pod("old", True), pod("old", True), pod("new", False)],
        serving_config_hash="new",
    )
    status, _ = compute_status(OWNER, observed, None)
    assert conditions(status)["ModelLoaded"] == ("False", "Loading")
    assert conditions(status)["RolledOut"] == ("False", "RollingOut")
    assert conditions(status)["Ready"] == ("True", "Serving")
    assert status.phase == "RollingOut"


def test_canary_state_in_status() -> None:
    plan = RolloutPlan(
        stable_ref=ref("v1"), stable_replicas=4, canary_ref=ref("v2"), canary_replicas=1,
        canary_action="apply", canary_percent=20, mode="canary",
    )  # fmt: skip
    observed = Observed(
        plan=plan,
        stable=deployment(ref("v1"), 4, 4),
        canary=deployment(ref("v2"), 1, 1),
        pods=[pod("s", True)] * 4 + [pod("c", True)],
        serving_config_hash="c",
    )
    status, _ = compute_status(OWNER, observed, None)
    assert status.model_version == "v1"
    assert status.canary is not None
    assert (status.canary.percent, status.canary.model_version, status.canary.replicas) == (20, "v2", 1)
    assert status.canary.ready_replicas == 1
    assert (status.replicas, status.ready_replicas) == (5, 5)
    assert conditions(status)["RolledOut"] == ("True", "CanaryRolledOut")
    assert status.phase == "Ready"


def test_promotion_in_progress_is_not_rolled_out() -> None:
    plan = RolloutPlan(
        stable_ref=ref("v2"), stable_replicas=5, canary_ref=ref("v2"), canary_replicas=1,
        canary_action="keep", mode="promoting",
    )  # fmt: skip
    observed = Observed(
        plan=plan, stable=deployment(ref("v2"), 5, 4, updated=2), canary=deployment(ref("v2"), 1, 1),
        pods=[pod("s2", True)] * 2, serving_config_hash="s2",
    )  # fmt: skip
    status, _ = compute_status(OWNER, observed, None)
    assert conditions(status)["RolledOut"] == ("False", "Promoting")
    assert status.phase == "RollingOut"
    assert status.model_version == "v2"


def test_fetch_failure_is_reported_with_a_warning_and_no_logs() -> None:
    failing = pod(
        "h", False,
        initContainerStatuses=[{"name": "fetch-model", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                "lastState": {"terminated": {"exitCode": 1}}}],
    )  # fmt: skip
    observed = Observed(
        plan=RolloutPlan(stable_ref=ref("v1"), stable_replicas=1),
        stable=deployment(ref("v1"), 1, 0, updated=1),
        canary=None,
        pods=[failing],
        serving_config_hash="h",
    )
    status, events = compute_status(OWNER, observed, None)
    assert conditions(status)["ModelLoaded"] == ("False", "FetchFailed")
    assert conditions(status)["Ready"] == ("False", "FetchFailed")
    assert status.phase == "Failed"
    assert any(e.type == "Warning" and e.reason == "FetchFailed" for e in events)


def test_diagnose_pods() -> None:
    assert diagnose([])[0] == "Pending"
    crashed = pod("h", False, containerStatuses=[{"name": "server", "lastState": {"terminated": {"exitCode": 1}}}])
    assert diagnose([crashed])[0] == "LoadFailed"
    fetching = pod("h", False, initContainerStatuses=[{"name": "fetch-model", "state": {"running": {}}}])
    assert diagnose([fetching])[0] == "Fetching"
    unscheduled = {"metadata": {"name": "p"}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "message": "0/3 nodes have free nvidia.com/gpu"}]}}  # fmt: skip
    assert diagnose([unscheduled]) == ("Unschedulable", "pod p: 0/3 nodes have free nvidia.com/gpu")
    assert diagnose([pod("h", False)])[0] == "Loading"


def test_unresolved_training_job_model_with_nothing_running() -> None:
    observed = Observed(
        plan=RolloutPlan(stable_ref=None, stable_replicas=0, mode="waiting"),
        stable=None, canary=None, pods=[], serving_config_hash=None,
        resolve_error=ResolveError("NoCheckpointYet", "TrainingJob train has not written a checkpoint yet"),
    )  # fmt: skip
    status, _ = compute_status(OWNER, observed, None)
    assert conditions(status) == {
        "ModelLoaded": ("False", "NoCheckpointYet"),
        "RolledOut": ("False", "NoCheckpointYet"),
        "Ready": ("False", "NoCheckpointYet"),
    }
    assert status.phase == "Pending"
    assert status.model_version is None


def test_unresolved_model_while_the_previous_one_serves() -> None:
    observed = Observed(
        plan=RolloutPlan(stable_ref=ref("v1"), stable_replicas=1),
        stable=deployment(ref("v1"), 1, 1), canary=None, pods=[pod("h", True)], serving_config_hash="h",
        resolve_error=ResolveError("TrainingJobNotFound", "TrainingJob train does not exist"),
    )  # fmt: skip
    status, _ = compute_status(OWNER, observed, None)
    assert conditions(status)["Ready"] == ("True", "Serving")
    assert conditions(status)["RolledOut"] == ("False", "TrainingJobNotFound")
    assert status.phase == "RollingOut"


def test_invalid_spec_fails_without_touching_anything() -> None:
    observed = Observed(
        plan=RolloutPlan(stable_ref=None, stable_replicas=0, mode="waiting"),
        stable=None, canary=None, pods=[], serving_config_hash=None,
        invalid="rollout.maxSurge and rollout.maxUnavailable cannot both be 0",
    )  # fmt: skip
    status, events = compute_status(OWNER, observed, None)
    assert conditions(status)["Ready"] == ("False", "InvalidSpec")
    assert status.phase == "Failed"
    assert any(e.type == "Warning" for e in events)


def test_scaled_to_zero() -> None:
    observed = Observed(
        plan=RolloutPlan(stable_ref=ref("v1"), stable_replicas=0),
        stable=deployment(ref("v1"), 0, 0), canary=None, pods=[], serving_config_hash="h",
    )  # fmt: skip
    status, _ = compute_status(OWNER, observed, None)
    assert conditions(status)["Ready"] == ("False", "ScaledToZero")
    assert conditions(status)["ModelLoaded"] == ("Unknown", "ScaledToZero")
    assert status.phase == "Pending"


def test_degraded_when_a_rolled_out_replica_is_lost() -> None:
    stable = deployment(ref("v1"), 3, 2)
    stable["status"]["availableReplicas"] = 3  # rolled out, then one replica stopped being ready
    observed = Observed(
        plan=RolloutPlan(stable_ref=ref("v1"), stable_replicas=3),
        stable=stable, canary=None, pods=[pod("h", True)] * 2, serving_config_hash="h",
    )  # fmt: skip
    status, _ = compute_status(OWNER, observed, None)
    assert status.phase == "Degraded"


def first_rollout(available: int, ready: int = 1, wanted: int = 1) -> Observed:
    """A new service: every pod runs the spec's model; `available` = ready for minReadySeconds."""
    stable = deployment(ref("v1"), wanted, ready)
    stable["status"]["availableReplicas"] = available
    return Observed(
        plan=RolloutPlan(stable_ref=ref("v1"), stable_replicas=wanted),
        stable=stable, canary=None, pods=[pod("h", True)] * ready + [pod("h", False)] * (wanted - ready),
        serving_config_hash="h",
    )  # fmt: skip


def test_a_new_service_is_ready_only_once_its_first_rollout_completed() -> None:
    # The demo's glitch: the replica is ready but not yet available (minReadySeconds); Ready used to be True
    # while the phase said RollingOut.
    settling, _ = compute_status(OWNER, first_rollout(available=0), None)
    assert conditions(settling)["Ready"] == ("False", "RollingOut")
    assert conditions(settling)["RolledOut"] == ("False", "RollingOut")
    assert settling.phase == "Loading"
    assert settling.ready_replicas == 1
    done, _ = compute_status(OWNER, first_rollout(available=1), settling)
    assert conditions(done)["Ready"] == ("True", "Serving")
    assert done.phase == "Ready"
    # Two replicas, one loaded: not Ready yet either.
    half, _ = compute_status(OWNER, first_rollout(available=1, ready=1, wanted=2), None)
    assert conditions(half)["Ready"][0] == "False" and half.phase == "Loading"


def test_an_update_of_a_ready_service_keeps_it_ready_while_it_rolls() -> None:
    ready, _ = compute_status(OWNER, first_rollout(available=2, ready=2, wanted=2), None)
    assert conditions(ready)["Ready"] == ("True", "Serving")
    # v2 replaces v1 one replica at a time (GPU default): the old pods are gone, the new ones still settle.
    stable = deployment(ref("v2"), 2, 1)
    stable["status"]["availableReplicas"] = 0
    rolling = Observed(
        plan=RolloutPlan(stable_ref=ref("v2"), stable_replicas=2),
        stable=stable, canary=None, pods=[pod("new", True), pod("new", False)], serving_config_hash="new",
    )  # fmt: skip
    status, _ = compute_status(OWNER, rolling, ready)
    assert conditions(status)["Ready"] == ("True", "Serving")
    assert status.phase == "RollingOut"


def test_back_from_zero_is_ready_with_its_first_replica() -> None:
    zero = Observed(
        plan=RolloutPlan(stable_ref=ref("v1"), stable_replicas=0),
        stable=deployment(ref("v1"), 0, 0), canary=None, pods=[], serving_config_hash="h",
    )  # fmt: skip
    scaled, _ = compute_status(OWNER, zero, None)
    back, _ = compute_status(OWNER, first_rollout(available=0, ready=1, wanted=2), scaled)
    assert conditions(back)["Ready"] == ("True", "Serving")
    assert back.phase == "RollingOut"


def test_phase_never_contradicts_ready() -> None:
    stuck = deployment(ref("v1"), 2, 1)
    stuck["status"]["availableReplicas"] = 1
    stuck["status"]["conditions"] = [{"type": "Progressing", "reason": "ProgressDeadlineExceeded"}]
    cases = [
        first_rollout(available=0),
        first_rollout(available=1),
        first_rollout(available=1, ready=1, wanted=3),
        first_rollout(available=0, ready=0),
        Observed(
            plan=RolloutPlan(stable_ref=ref("v1"), stable_replicas=2),
            stable=stuck, canary=None, pods=[pod("h", True), pod("h", False)], serving_config_hash="h",
        ),
    ]  # fmt: skip
    serving_phases = {"Ready", "RollingOut", "Degraded"}
    for observed in cases:
        status, _ = compute_status(OWNER, observed, None)
        ready = conditions(status)["Ready"][0] == "True"
        assert ready == (status.phase in serving_phases), (status.phase, conditions(status))


def test_a_missing_secret_or_image_is_named_not_read_as_a_failed_fetch() -> None:
    """The fetch-model container waits on a Secret that does not exist: ModelLoaded and Ready name it (the kubelet's
    message), a Warning event says it once; a crash loop keeps FetchFailed/LoadFailed with its last termination."""
    waiting = pod(
        "h", False,
        initContainerStatuses=[{"name": "fetch-model", "state": {"waiting": {
            "reason": "CreateContainerConfigError", "message": 'secret "s3-credentials" not found'}}}],
    )  # fmt: skip
    observed = Observed(
        plan=RolloutPlan(stable_ref=ref("v1"), stable_replicas=1),
        stable=deployment(ref("v1"), 1, 0, updated=1),
        canary=None,
        pods=[waiting],
        serving_config_hash="h",
    )
    status, events = compute_status(OWNER, observed, None)
    assert conditions(status)["ModelLoaded"] == ("False", "CreateContainerConfigError")
    assert conditions(status)["Ready"] == ("False", "CreateContainerConfigError")
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert 'secret "s3-credentials" not found' in ready.message and "container fetch-model" in ready.message
    assert [e.type for e in events if e.reason == "CreateContainerConfigError"] == ["Warning", "Warning"]
    _, again = compute_status(OWNER, observed, status)
    assert again == []
    pulling = pod(
        "h", False, containerStatuses=[{"name": "server", "state": {"waiting": {"reason": "ImagePullBackOff"}}}]
    )
    assert diagnose([pulling])[0] == "ImagePullBackOff"
    crashing = pod(
        "h", False,
        containerStatuses=[{"name": "server", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                            "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                                          "message": "no handler x"}}}],
    )  # fmt: skip
    reason, message = diagnose([crashing])
    assert reason == "LoadFailed"
    assert message == "pod gpt-h: the server exited: no handler x (last terminated Error with exit code 1; see its " \
                      "server log)"


def test_at_zero_an_activator_that_cannot_start_is_named_in_ready() -> None:
    from loom.operator.core.pod_problems import PodProblem

    held = PodProblem("ImagePullBackOff", "svc-activator-x", "activator", 'Back-off pulling image "registry/nope"')
    observed = Observed(
        plan=RolloutPlan(stable_ref=ref("v1"), stable_replicas=0),
        stable=deployment(ref("v1"), 0, 0), canary=None, pods=[], serving_config_hash="h", activator_problem=held,
    )  # fmt: skip
    status, events = compute_status(OWNER, observed, None)
    assert conditions(status)["Ready"] == ("False", "ImagePullBackOff")
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert ready.message.startswith("at zero, the activator: pod svc-activator-x container activator")
    assert any(e.type == "Warning" and e.reason == "ImagePullBackOff" for e in events)


ENGINE_ERROR = (
    "the vLLM engine exited with code 1 before it was ready: ValueError: Available memory on node 0 (20.75/23.54 GiB) "
    "on startup is less than desired CPU memory utilization (0.92, 21.66 GiB). On the CPU backend, the "
    "`--gpu-memory-utilization` flag controls the fraction of CPU memory reserved (despite its name). To resolve: "
    "decrease `--gpu-memory-utilization` (e.g. `--gpu-memory-utilization 0.5`) or reduce CPU memory used by other "
    "processes."
)


@pytest.mark.parametrize("container", [
    # the kubelet restarts it: running again, its last run ended (no CrashLoopBackOff while it runs)
    {"name": "server", "state": {"running": {}},
     "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": ENGINE_ERROR}}},
    # in the back-off between runs
    {"name": "server", "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
     "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": ENGINE_ERROR}}},
    # just ended
    {"name": "server", "state": {"terminated": {"exitCode": 1, "reason": "Error", "message": ENGINE_ERROR}}},
], ids=["restarted", "back-off", "ended"])
def test_ready_names_the_engines_own_fatal_error_from_the_termination_message(container: dict[str, Any]) -> None:
    """Issue 52: the vllm front writes the engine's fatal error to its termination message; Ready says it whole,
    whatever the container's state between its runs, not only 'the server exited (see its server log)'."""
    observed = Observed(
        plan=RolloutPlan(stable_ref=ref("v1"), stable_replicas=1),
        stable=deployment(ref("v1"), 1, 0, updated=1),
        canary=None,
        pods=[pod("h", False, containerStatuses=[container])],
        serving_config_hash="h",
        runtime="vllm",
    )
    status, events = compute_status(OWNER, observed, None)
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "LoadFailed") and status.phase == "Failed"
    assert ready.message == (f"model v1: pod gpt-h: the server exited: {ENGINE_ERROR} (last terminated Error with "
                             "exit code 1; see its server log)")
    assert any(e.type == "Warning" and e.reason == "LoadFailed" and ENGINE_ERROR in e.message for e in events)


def test_a_termination_message_is_scrubbed_and_one_line() -> None:
    crashed = pod("h", False, containerStatuses=[{"name": "server", "lastState": {"terminated": {
        "exitCode": 1, "message": "cannot reach s3://ak:sk@host with\n password=hunter2"}}}])
    _, message = diagnose([crashed])
    assert "hunter2" not in message and ":sk@" not in message and "\n" not in message
    assert message.startswith("pod gpt-h: the server exited: cannot reach s3://***@host with password=***")
