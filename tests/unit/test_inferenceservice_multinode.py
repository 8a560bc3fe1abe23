"""spec.vllm.parallelism: a replica larger than one pod renders as a LeaderWorkerSet group (llm/multinode.py), its
rules (CEL at admission, the GPUs a group holds at reconcile), the engine's flags per rank, the worker's command
line, Kueue's pod counts per group, and the LeaderWorkerSet's status read as a Deployment's (groups for replicas).
A one-pod replica renders the Deployment as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from loom.operator.api.cel import admitted
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.llm import multinode
from loom.operator.kinds.inferenceservice.queue.admission import Minimum, minimum_pods, workloads
from loom.operator.kinds.inferenceservice.render import render_deployment, server_selector
from loom.operator.kinds.inferenceservice.rollout import available, rolled_out
from loom.operator.kinds.inferenceservice.source.model import resolve_model
from loom.workloads.llm.__main__ import with_engine_args
from loom.workloads.llm.config import LlmServerConfig
from loom.workloads.llm.worker import headless_args

IMAGE = "localhost/loom/server:test"
VLLM_IMAGE = "localhost/loom/vllm:test"
OWNER: dict[str, Any] = {
    "apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "big", "namespace": "ml",
                                                                                "uid": "u"},
}  # fmt: skip
BASE: dict[str, Any] = {"model": {"uri": "s3://models/llama/v1", "name": "llama"}, "runtime": "vllm"}
TWO_PODS = {**BASE, "vllm": {"parallelism": {"tensor": 2, "podsPerReplica": 2}}}


def spec_of(wire: dict[str, Any]) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(wire)


def render(wire: dict[str, Any], replicas: int = 3) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = spec_of(wire)
    config_map, deployment = render_deployment(
        {**OWNER, "spec": wire}, spec, "stable", resolve_model(spec.model, spec.serving_handler), replicas, IMAGE,
        vllm_image=VLLM_IMAGE,
    )  # fmt: skip
    return config_map, deployment


def lws_of(wire: dict[str, Any], replicas: int = 3) -> dict[str, Any]:
    _, deployment = render(wire, replicas)
    return multinode.leader_worker_set(deployment, spec_of(wire), "/etc/loom/llm.json")


def server(template: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in template["spec"]["containers"] if c["name"] == "server")
    return found


def test_only_a_vllm_replica_of_several_pods_is_a_group() -> None:
    assert multinode.grouped(spec_of(TWO_PODS))
    assert not multinode.grouped(spec_of({**BASE, "vllm": {"parallelism": {"tensor": 2}}}))
    assert not multinode.grouped(spec_of(BASE))


def test_a_two_pod_replica_is_a_leader_worker_set_group_restarted_and_rolled_out_as_one() -> None:
    lws = lws_of(TWO_PODS, replicas=3)
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    # Not the Service's name: LWS's headless Service of the LeaderWorkerSet's name gives the leader its DNS name.
    assert lws["metadata"]["name"] == "big-group" and lws["metadata"]["ownerReferences"][0]["uid"] == "u"
    assert lws["metadata"]["annotations"]["loom.dev/model"]  # the track's model, read back by the next pass
    spec = lws["spec"]
    assert spec["replicas"] == 3  # groups
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["startupPolicy"] == "LeaderCreated"  # the leader is ready only once its workers joined
    # The Deployment's CPU defaults (a new group beside the old before the old goes), but maxUnavailable at least 1:
    # LWS's leader StatefulSet refuses 0.
    assert spec["rolloutStrategy"] == {
        "type": "RollingUpdate", "rollingUpdateConfiguration": {"maxSurge": "25%", "maxUnavailable": 1},
    }  # fmt: skip
    gpu = lws_of({**TWO_PODS, "gpus": 1})["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]
    assert gpu == {"maxSurge": 0, "maxUnavailable": 1}
    chosen = lws_of({**TWO_PODS, "rollout": {"maxSurge": 2, "maxUnavailable": "50%"}})["spec"]["rolloutStrategy"]
    assert chosen["rollingUpdateConfiguration"] == {"maxSurge": 2, "maxUnavailable": "50%"}


def test_the_leader_runs_the_front_with_rank_0_and_the_group_s_leader_address() -> None:
    _, deployment = render(TWO_PODS)
    leader = lws_of(TWO_PODS)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    command = server(leader)["command"]
    assert command[:5] == ["python", "-m", "loom.workloads.llm", "--config", "/etc/loom/llm.json"]
    assert "--engine-arg=--node-rank=0" in command
    assert "--engine-arg=--master-addr=$(LWS_LEADER_ADDRESS)" in command
    assert command[command.index("--drain-seconds"):] == server(deployment["spec"]["template"])["command"][5:]
    # The leader alone is a server pod: the Service, the pod index and the metrics count one pod per replica.
    assert server_selector({**OWNER}).items() <= leader["metadata"]["labels"].items()
    assert server(leader)["readinessProbe"] and leader["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_a_worker_fetches_the_same_model_and_runs_vllm_headless_with_its_index() -> None:
    lws = lws_of(TWO_PODS)
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert worker["spec"]["initContainers"] == leader["spec"]["initContainers"]
    assert worker["spec"]["volumes"] == leader["spec"]["volumes"]
    container = server(worker)
    assert container["command"] == [
        "python", "-m", "loom.workloads.llm.worker", "--config", "/etc/loom/llm.json",
        "--node-rank=$(LWS_WORKER_INDEX)", "--master-addr=$(LWS_LEADER_ADDRESS)",
    ]  # fmt: skip
    assert not {"ports", "readinessProbe", "livenessProbe", "startupProbe", "lifecycle"} & set(container)
    labels = worker["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "worker"  # never behind the Service
    assert not server_selector(OWNER).items() <= labels.items()
    assert not any(k.startswith("prometheus.io/") for k in worker["metadata"]["annotations"])
    # Same template hash as the leader: a new config rolls both.
    assert worker["metadata"]["annotations"]["loom.dev/config-hash"] == leader["metadata"]["annotations"][
        "loom.dev/config-hash"]


def test_every_rank_shares_the_engine_s_parallel_flags() -> None:
    wire = {**BASE, "vllm": {"parallelism": {"tensor": 2, "pipeline": 2, "podsPerReplica": 4}}}
    config_map, _ = render(wire)
    engine = LlmServerConfig.model_validate_json(config_map["data"]["llm.json"]).engine
    assert engine.tensor_parallel_size == 2
    assert engine.extra_args == [
        "--pipeline-parallel-size=2", "--nnodes=4", "--master-port=29501", "--distributed-executor-backend=mp",
    ]  # fmt: skip
    data = {**BASE, "vllm": {"parallelism": {"data": 2, "podsPerReplica": 2}}}
    assert "--data-parallel-backend=mp" in multinode.parallel_flags(spec_of(data))
    one_pod = {**BASE, "vllm": {"parallelism": {"tensor": 1, "pipeline": 2}}}
    assert multinode.parallel_flags(spec_of(one_pod)) == ["--pipeline-parallel-size=2"]


def test_the_front_appends_per_pod_engine_flags_and_the_worker_reuses_the_leader_s(tmp_path: Path) -> None:
    config_map, _ = render(TWO_PODS)
    config = LlmServerConfig.model_validate_json(config_map["data"]["llm.json"])
    leader = with_engine_args(config, ["--node-rank=0", "--master-addr=big-0.big.ml"])
    assert leader.engine.extra_args[-2:] == ["--node-rank=0", "--master-addr=big-0.big.ml"]
    with pytest.raises(ValidationError):
        with_engine_args(config, ["--port=1"])  # the front's own flags stay the front's
    argv = headless_args(config.model_copy(update={"model_dir": "/models/llama"}), 1, "big-0.big.ml")
    assert argv[:5] == [
        "--model=/models/llama", "--headless", "--api-server-count=0", "--node-rank=1", "--master-addr=big-0.big.ml",
    ]  # fmt: skip
    assert "--tensor-parallel-size=2" in argv and "--nnodes=2" in argv


@pytest.mark.parametrize(("parallelism", "message"), [
    ({"tensor": 3, "podsPerReplica": 2}, "divisible by podsPerReplica"),
    ({"tensor": 2, "podsPerReplica": 4}, "may not exceed"),
])  # fmt: skip
def test_admission_refuses_groups_that_cannot_split_the_engine(parallelism: dict[str, int], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        admitted(InferenceServiceSpec, {**BASE, "vllm": {"parallelism": parallelism}})


def test_admission_refuses_parallelism_set_twice() -> None:
    with pytest.raises(ValidationError, match="not both"):
        admitted(InferenceServiceSpec, {**BASE, "vllm": {"tensorParallelSize": 2, "parallelism": {"tensor": 2}}})
    with pytest.raises(ValidationError, match="Loom sets them"):
        admitted(InferenceServiceSpec, {**TWO_PODS, "vllm": {**TWO_PODS["vllm"], "extraArgs": ["--nnodes=3"]}})
    admitted(InferenceServiceSpec, TWO_PODS)


def test_a_group_s_gpus_must_match_its_ranks() -> None:
    assert multinode.check(spec_of({**TWO_PODS, "gpus": 1})) is None  # 1 GPU x 2 pods = tensor 2
    problem = multinode.check(spec_of({**TWO_PODS, "gpus": 2}))
    assert problem is not None and "must equal tensor x pipeline x data (2)" in problem
    assert multinode.check(spec_of(TWO_PODS)) is None  # CPU: no GPU to count


def test_a_name_too_long_for_lws_s_statefulsets_is_refused() -> None:
    assert multinode.check(spec_of({**TWO_PODS, "replicas": 10}), "a" * 37) is None  # <37>-canary-group-9: 52
    problem = multinode.check(spec_of({**TWO_PODS, "replicas": 10}), "a" * 38)
    assert problem is not None and "StatefulSet" in problem
    assert multinode.check(spec_of({**BASE, "replicas": 10}), "a" * 53) is None  # one pod per replica: no LWS


def test_kueue_admits_a_group_whole() -> None:
    spec = spec_of({**TWO_PODS, "replicas": 3})
    assert minimum_pods(spec) == 6 and Minimum(spec, running=0).requested() == 6
    _, deployment = render({**TWO_PODS, "replicas": 3})
    pod = deployment["spec"]["template"]
    base, step = workloads({**OWNER, "spec": {}}, spec, pod, "q", (0, 1), [])
    assert base["spec"]["podSets"][0]["count"] == 6
    assert step["spec"]["podSets"][0]["count"] == 2
    single = spec_of({**BASE, "replicas": 3})
    assert minimum_pods(single) == 3


def test_a_leader_worker_set_reads_as_a_deployment_of_groups() -> None:
    lws = lws_of(TWO_PODS, replicas=2)
    lws["metadata"]["generation"] = 4
    lws["status"] = {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}
    view = multinode.deployment_view(lws)
    assert view is not None
    assert view["kind"] == "LeaderWorkerSet" and view["spec"]["replicas"] == 2
    assert view["spec"]["template"]["metadata"]["annotations"]["loom.dev/config-hash"]
    assert not rolled_out(view) and available(view) == 1
    lws["status"]["readyReplicas"] = 2
    assert rolled_out(multinode.deployment_view(lws))
    lws["status"]["updatedReplicas"] = 1  # one group still runs the old template
    assert not rolled_out(multinode.deployment_view(lws))
    assert multinode.deployment_view(None) is None


def test_a_one_pod_replica_renders_the_deployment_unchanged() -> None:
    _, before = render(BASE)
    _, with_tensor = render({**BASE, "vllm": {"parallelism": {"tensor": 1}}})
    assert before["kind"] == "Deployment" and with_tensor["kind"] == "Deployment"
    assert server(before["spec"]["template"])["command"] == server(with_tensor["spec"]["template"])["command"]
