"""spec.vllm.disaggregation: the prefill and decode pools rendered from a track's Deployment, the view the rollout
and status code read them through, the picker's config and the admission rules (llm/disaggregation.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pydantic import ValidationError

from loom.operator.api.cel import admitted
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.llm import disaggregation
from loom.operator.kinds.inferenceservice.queue.admission import ServiceQueue, admit, minimum, minimum_pods, workloads
from loom.operator.kinds.inferenceservice.render import render_deployment
from loom.operator.kinds.inferenceservice.rollout import (
    available,
    desired_total_replicas,
    plan_rollout,
    rolled_out,
)
from loom.operator.kinds.inferenceservice.source.model import resolve_model
from loom.operator.kinds.inferenceservice.status import Observed, compute_status
from loom.operator.kinds.inferenceservice.traffic.picker import (
    picker_config,
    picker_policy,
    picker_selector,
    service_selector,
)
from loom.workloads.llm.__main__ import with_engine_args
from loom.workloads.llm.config import LlmServerConfig
from loom.workloads.picker.config import DECODE_ROLE, PREFILL_ROLE, DisaggregationConfig

IMAGE = "localhost/loom/server:test"
VLLM_IMAGE = "localhost/loom/vllm:test"
OWNER: dict[str, Any] = {
    "apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "chat", "namespace": "ml",
                                                                                "uid": "u", "generation": 1},
}  # fmt: skip
BASE: dict[str, Any] = {"model": {"uri": "s3://models/llama/v1", "name": "llama"}, "runtime": "vllm"}
SPLIT: dict[str, Any] = {
    **BASE,
    "vllm": {"disaggregation": {"kvStorage": {"claimName": "kv"}, "prefill": {"replicas": 1},
                                "decode": {"replicas": 2}}},
}  # fmt: skip


def spec_of(wire: dict[str, Any]) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(wire)


def rendered(wire: dict[str, Any], replicas: int = 1) -> dict[str, Any]:
    spec = spec_of(wire)
    _, deployment = render_deployment(
        {**OWNER, "spec": wire}, spec, "stable", resolve_model(spec.model, spec.serving_handler), replicas, IMAGE,
        vllm_image=VLLM_IMAGE,
    )  # fmt: skip
    return deployment


def pools_of(wire: dict[str, Any], replicas: int = 1) -> list[dict[str, Any]]:
    return disaggregation.pools(rendered(wire, replicas), spec_of(wire))


def server(template: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in template["spec"]["containers"] if c["name"] == "server")
    return found


def kv_config(pool: dict[str, Any]) -> dict[str, Any]:
    prefix = "--engine-arg=--kv-transfer-config="
    args = [a for a in server(pool["spec"]["template"])["command"] if a.startswith(prefix)]
    assert len(args) == 1
    parsed: dict[str, Any] = json.loads(args[0].removeprefix(prefix))
    return parsed


def test_a_disaggregated_track_is_a_prefill_and_a_decode_deployment_with_their_replicas() -> None:
    assert disaggregation.disaggregated(spec_of(SPLIT)) and not disaggregation.disaggregated(spec_of(BASE))
    prefill, decode = pools_of(SPLIT)
    assert (prefill["metadata"]["name"], decode["metadata"]["name"]) == ("chat-prefill", "chat-decode")
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (1, 2)
    for pool, role in ((prefill, "prefill"), (decode, "decode")):
        # Each Deployment selects its own pool's pods only: the two never adopt each other's.
        assert pool["spec"]["selector"]["matchLabels"]["loom.dev/role"] == role
        labels = pool["spec"]["template"]["metadata"]["labels"]
        assert labels["loom.dev/role"] == role and labels["app.kubernetes.io/component"] == "server"
        assert labels["loom.dev/track"] == "stable"
    # The track scaled to zero runs no pool.
    assert [p["spec"]["replicas"] for p in pools_of(SPLIT, replicas=0)] == [0, 0]


def test_both_pools_run_the_same_connector_on_the_shared_claim_in_their_kv_version_s_folder() -> None:
    prefill, decode = pools_of(SPLIT)
    version = prefill["spec"]["template"]["metadata"]["labels"]["loom.dev/kv-version"]
    assert version == decode["spec"]["template"]["metadata"]["labels"]["loom.dev/kv-version"] and len(version) == 16
    assert kv_config(prefill) == kv_config(decode) == {
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": f"/var/cache/loom/kv/{version}"},
    }  # fmt: skip
    for pool in (prefill, decode):
        template = pool["spec"]["template"]
        assert {"name": "kv-storage", "persistentVolumeClaim": {"claimName": "kv"}} in template["spec"]["volumes"]
        assert {"name": "kv-storage", "mountPath": "/var/cache/loom/kv"} in server(template)["volumeMounts"]
        command = server(template)["command"]
        # Before the front's own drain flags, as a group's per-pod engine flags are.
        assert command.index("--drain-seconds") > command.index(next(a for a in command if "kv-transfer" in a))
    # One config hash for both pools' pods (status reads it as the serving template's), not the aggregated one's.
    hashes = {p["spec"]["template"]["metadata"]["annotations"]["loom.dev/config-hash"] for p in (prefill, decode)}
    assert len(hashes) == 1
    assert hashes != {rendered(BASE)["spec"]["template"]["metadata"]["annotations"]["loom.dev/config-hash"]}


def test_both_engines_get_the_connector_and_prefill_each_prompt_in_one_step_through_the_front() -> None:
    for pool in pools_of(SPLIT):
        args = [a.removeprefix("--engine-arg=") for a in server(pool["spec"]["template"])["command"]
                if a.startswith("--engine-arg=")]  # fmt: skip
        config = LlmServerConfig(model_name="llama", model_dir="/models/llama")
        engine = with_engine_args(config, args).engine
        # Chunked prefill off: the connector stores what a request's first step computed, so the whole prompt.
        assert engine.extra_args[-2].startswith("--kv-transfer-config={")
        assert engine.extra_args[-1] == "--no-enable-chunked-prefill"


def test_a_new_model_or_engine_is_a_new_kv_version_a_new_replica_count_is_not() -> None:
    def version(wire: dict[str, Any]) -> str:
        label: str = pools_of(wire)[0]["spec"]["template"]["metadata"]["labels"]["loom.dev/kv-version"]
        return label

    before = version(SPLIT)
    assert version({**SPLIT, "model": {"uri": "s3://models/llama/v2", "name": "llama"}}) != before
    assert version({**SPLIT, "vllm": {**SPLIT["vllm"], "dtype": "bfloat16"}}) != before
    assert version({**SPLIT, "vllm": {**SPLIT["vllm"], "extraArgs": ["--kv-cache-dtype=fp8"]}}) != before
    more = copy.deepcopy(SPLIT)
    more["vllm"]["disaggregation"]["decode"]["replicas"] = 5
    assert version(more) == before
    assert version({**SPLIT, "vllm": {**SPLIT["vllm"], "maxNumSeqs": 4}}) == before  # sizes, does not change a block


def _with_status(pool: dict[str, Any], ready: int, updated: int | None = None, generation: int = 1) -> dict[str, Any]:
    pool = copy.deepcopy(pool)
    wanted = pool["spec"]["replicas"]
    pool["metadata"]["generation"] = generation
    pool["status"] = {
        "observedGeneration": 1, "replicas": wanted, "readyReplicas": ready, "availableReplicas": ready,
        "updatedReplicas": wanted if updated is None else updated,
    }  # fmt: skip
    return pool


def test_the_pools_read_as_one_track_ready_only_when_both_have_a_ready_replica() -> None:
    prefill, decode = pools_of(SPLIT)
    view = disaggregation.track_view("chat", {"prefill": _with_status(prefill, 1), "decode": _with_status(decode, 0)})
    assert view is not None and view["kind"] == disaggregation.VIEW_KIND and view["metadata"]["name"] == "chat"
    assert view["spec"]["replicas"] == 3 and view["status"]["readyReplicas"] == 0
    assert available(view) == 0 and not rolled_out(view)
    assert view["metadata"]["annotations"]["loom.dev/model"]  # the rollout reads the model it runs here
    both = disaggregation.track_view("chat", {"prefill": _with_status(prefill, 1), "decode": _with_status(decode, 2)})
    assert both is not None and both["status"]["readyReplicas"] == 3 and rolled_out(both)
    status = disaggregation.pool_status(both)
    assert status is not None
    assert (status.prefill.replicas, status.prefill.ready_replicas) == (1, 1)
    assert (status.decode.replicas, status.decode.ready_replicas) == (2, 2)
    assert status.kv_version == prefill["spec"]["template"]["metadata"]["labels"]["loom.dev/kv-version"]
    assert disaggregation.ready_message(status) == "prefill 1/1 ready, decode 2/2 ready"
    # One pool not rolled out (a generation not yet observed, or a pod still on the old template): neither is.
    lagging = disaggregation.track_view(
        "chat", {"prefill": _with_status(prefill, 1, generation=2), "decode": _with_status(decode, 2)}
    )
    assert lagging is not None and not rolled_out(lagging)
    old_pod = disaggregation.track_view(
        "chat", {"prefill": _with_status(prefill, 1), "decode": _with_status(decode, 2, updated=1)}
    )
    assert old_pod is not None and not rolled_out(old_pod)
    # A pool missing (the operator stopped between the two applies) is not rolled out either.
    alone = disaggregation.track_view("chat", {"prefill": _with_status(prefill, 1), "decode": None})
    assert alone is not None and not rolled_out(alone) and alone["status"]["readyReplicas"] == 0
    assert disaggregation.track_view("chat", {"prefill": None, "decode": None}) is None
    assert disaggregation.pool_status(_with_status(prefill, 1)) is None  # a plain Deployment is no pools


def test_ready_needs_both_pools_and_says_each_pool_s_count() -> None:
    spec = spec_of(SPLIT)
    ref = resolve_model(spec.model, spec.serving_handler)
    prefill, decode = pools_of(SPLIT)
    plan = plan_rollout(spec, ref, None, None, 1)

    def ready_of(decode_ready: int) -> tuple[str, str]:
        view = disaggregation.track_view(
            "chat", {"prefill": _with_status(prefill, 1), "decode": _with_status(decode, decode_ready)}
        )
        status, _ = compute_status(
            OWNER,
            Observed(plan=plan, stable=view, canary=None, pods=[], serving_config_hash=None, runtime="vllm"),
            None,
        )
        pools = disaggregation.pool_status(view)
        assert pools is not None
        conditions = disaggregation.with_pools_in_ready(status.conditions, pools)
        ready = next(c for c in conditions if c.type == "Ready")
        return ready.status, ready.message

    state, message = ready_of(0)
    assert state == "False" and message.endswith("prefill 1/1 ready, decode 0/2 ready")
    state, message = ready_of(2)
    assert state == "True" and message == "3 replica(s) ready; prefill 1/1 ready, decode 2/2 ready"


def test_the_rollout_counts_both_pools_replicas() -> None:
    """A disaggregated service's replicas are its pools' (1 prefill + 2 decode), in the plan and in RolledOut (a new
    user's check read "2 of 1 replica(s) updated" with the plan at one replica)."""
    spec = spec_of(SPLIT)
    assert desired_total_replicas(spec) == 3
    ref = resolve_model(spec.model, spec.serving_handler)
    plan = plan_rollout(spec, ref, None, None, desired_total_replicas(spec))
    prefill, decode = pools_of(SPLIT)

    def rolled_out_of(decode_updated: int) -> tuple[str, str]:
        view = disaggregation.track_view(
            "chat",
            {"prefill": _with_status(prefill, 1), "decode": _with_status(decode, decode_updated, decode_updated)},
        )
        status, _ = compute_status(
            OWNER,
            Observed(plan=plan, stable=view, canary=None, pods=[], serving_config_hash=None, runtime="vllm"),
            None,
        )
        rolled = next(c for c in status.conditions if c.type == "RolledOut")
        return rolled.status, rolled.message

    assert rolled_out_of(0) == ("False", "1 of 3 replica(s) updated to model v1")
    assert rolled_out_of(2) == ("True", "model v1 on all 3 replica(s)")


def _pod(role: str, *, crashed: bool) -> dict[str, Any]:
    state = (
        {"terminated": {"exitCode": 1, "reason": "Error", "message": "engine died: out of memory"}}
        if crashed
        else {"running": {}}
    )
    return {
        "metadata": {"name": f"chat-{role}-x", "labels": {"loom.dev/role": role}},
        "status": {"conditions": [{"type": "Ready", "status": "False" if crashed else "True"}],
                   "containerStatuses": [{"name": "server", "state": state}]},
    }  # fmt: skip


def test_a_pool_without_ready_replicas_is_named_in_ready_with_its_own_pods_failure() -> None:
    spec = spec_of(SPLIT)
    ref = resolve_model(spec.model, spec.serving_handler)
    prefill, decode = pools_of(SPLIT)
    view = disaggregation.track_view("chat", {"prefill": _with_status(prefill, 1), "decode": _with_status(decode, 0)})
    pods = [_pod("prefill", crashed=False), _pod("decode", crashed=True)]
    plan = plan_rollout(spec, ref, None, None, 1)
    status, _ = compute_status(
        OWNER, Observed(plan=plan, stable=view, canary=None, pods=pods, serving_config_hash=None, runtime="vllm"), None
    )
    pools = disaggregation.pool_status(view)
    assert pools is not None
    conditions = disaggregation.with_pools_in_ready(status.conditions, pools, pods)
    ready = next(c for c in conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "LoadFailed")
    assert ready.message.startswith("no ready replica in the decode pool: pod chat-decode-x: the server exited: "
                                    "engine died: out of memory")  # fmt: skip
    assert ready.message.endswith("prefill 1/1 ready, decode 0/2 ready")
    assert status.phase == "Loading" and disaggregation.phase_with_pools(status.phase, conditions) == "Failed"
    assert disaggregation.phase_with_pools("Ready", conditions) == "Ready"


def test_the_picker_pairs_pools_by_role_and_kv_version_and_alone_takes_the_service_s_traffic() -> None:
    spec = spec_of(SPLIT)
    assert picker_policy(spec) == "prefix-cache"  # even with one replica per pool: the picker makes both calls
    config = picker_config(OWNER, spec, "prefix-cache")
    assert config.disaggregation == DisaggregationConfig(
        role_label="loom.dev/role", version_label="loom.dev/kv-version"
    )
    assert (PREFILL_ROLE, DECODE_ROLE) == disaggregation.ROLES  # the values the pools' role label takes
    assert picker_config(OWNER, spec_of(BASE), "prefix-cache").disaggregation is None
    # The Service selects the picker even before it is ready (its pods serve through it), never the replicas.
    assert service_selector(OWNER, False, False, picker_only=True) == picker_selector(OWNER)
    assert service_selector(OWNER, False, False) is None


@pytest.mark.parametrize(("extra", "message"), [
    ({"replicas": 2}, "not replicas"),
    ({"autoscaling": {"minReplicas": 1, "maxReplicas": 3, "target": 4}}, "autoscaling is not supported"),
    ({"rollout": {"canaryPercent": 20}}, "a canary"),
    ({"adapters": [{"name": "a", "uri": "s3://b/a"}]}, "keys a KV cache by the prompt's tokens"),
    ({"routing": {"inferencePool": {}}}, "a gateway sends a request to one endpoint"),
    ({"vllm": {**SPLIT["vllm"], "parallelism": {"tensor": 2}}}, "not supported yet"),
    ({"vllm": {**SPLIT["vllm"], "extraArgs": ["--kv-transfer-config={}"]}}, "Loom sets them"),
    ({"vllm": {**SPLIT["vllm"], "extraArgs": ["--enable-chunked-prefill"]}}, "Loom sets them"),
    ({"runtime": "default", "handler": "sklearn"}, "vllm options need runtime: vllm"),
])  # fmt: skip
def test_admission_refuses_what_two_pools_do_not_support(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        admitted(InferenceServiceSpec, {**SPLIT, **extra})


def test_admission_takes_a_disaggregated_service_and_needs_its_claim() -> None:
    spec = admitted(InferenceServiceSpec, SPLIT)
    assert spec.vllm is not None and spec.vllm.disaggregation is not None
    assert spec.vllm.disaggregation.connector == "SharedStorage"
    defaults = admitted(InferenceServiceSpec, {**BASE, "vllm": {"disaggregation": {"kvStorage": {"claimName": "kv"}}}})
    assert defaults.vllm is not None and defaults.vllm.disaggregation is not None
    assert defaults.vllm.disaggregation.prefill.replicas == defaults.vllm.disaggregation.decode.replicas == 1
    with pytest.raises(ValidationError, match="kvStorage"):
        admitted(InferenceServiceSpec, {**BASE, "vllm": {"disaggregation": {}}})
    with pytest.raises(ValidationError):
        admitted(
            InferenceServiceSpec,
            {**BASE, "vllm": {"disaggregation": {"kvStorage": {"claimName": "kv"}, "connector": "LMCache"}}},
        )
    admitted(InferenceServiceSpec, {**SPLIT, "vllm": {**SPLIT["vllm"], "extraArgs": ["--max-num-batched-tokens=64"]}})


def test_kueue_admits_both_pools_as_one_pod_set_and_without_admission_neither_runs() -> None:
    spec = spec_of(SPLIT)
    assert minimum(spec) == 1 and minimum_pods(spec) == 3  # one "replica": prefill 1 + decode 2 pods
    (base,) = workloads({**OWNER, "spec": {}}, spec, rendered(SPLIT)["spec"]["template"], "q", (0,), [])
    assert base["spec"]["podSets"][0]["count"] == 3
    # Not admitted, the track asks for no replica: neither pool runs; admitted, each its own replicas.
    queued = admit(ServiceQueue("q", None), spec, requested=1, running=0)
    assert (queued.state, queued.replicas, queued.create) == ("Queued", 0, (0,))
    assert [p["spec"]["replicas"] for p in pools_of(SPLIT, replicas=queued.replicas)] == [0, 0]
    assert [p["spec"]["replicas"] for p in pools_of(SPLIT, replicas=1)] == [1, 2]
