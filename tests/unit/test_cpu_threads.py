"""OMP_NUM_THREADS in the pods that run PyTorch: from the CPU the container was given, never the node's core count;
the user's own value wins; vLLM's engine is left to place its own threads."""

from __future__ import annotations

from typing import Any

import pytest

from loom.operator.core.kit import cpu_cores, cpu_threads_env
from loom.operator.core.model import ResourceRequirements
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.render import render_deployment
from loom.operator.kinds.inferenceservice.source.model import resolve_model
from loom.operator.kinds.trainingjob import render as trainingjob_render
from loom.operator.kinds.trainingjob.api import TrainingJobSpec


@pytest.mark.parametrize(
    ("quantity", "cores"), [(2, 2.0), ("2", 2.0), ("1.5", 1.5), ("500m", 0.5), ("2500m", 2.5), ("0.25", 0.25)]
)
def test_cpu_quantities_read_as_cores(quantity: int | str, cores: float) -> None:
    assert cpu_cores(quantity) == cores


@pytest.mark.parametrize(
    ("resources", "threads"),
    [
        (None, "1"),  # no CPU named: one thread, not one per core of whatever node the pod lands on
        ({"requests": {"memory": "1Gi"}}, "1"),
        ({"requests": {"cpu": "500m"}}, "1"),  # rounded down, at least 1
        ({"requests": {"cpu": 3}}, "3"),
        ({"requests": {"cpu": "2"}, "limits": {"cpu": "4500m"}}, "4"),  # the limit is what the pod may use
        ({"limits": {"cpu": "8"}}, "8"),
        ({"limits": {"cpu": "1Ki"}}, "1"),  # a quantity, but not one CPU is written in: no crash here
    ],
)
def test_threads_follow_the_cpu_limit_else_the_request(resources: dict[str, Any] | None, threads: str) -> None:
    model = ResourceRequirements.model_validate(resources) if resources is not None else None
    assert cpu_threads_env(model) == [{"name": "OMP_NUM_THREADS", "value": threads}]


JOB = {"metadata": {"name": "gpt", "namespace": "team-a", "uid": "uid-1", "generation": 1}}


def trainer_env(workers: dict[str, Any] | None = None, **fields: Any) -> dict[str, dict[str, Any]]:
    spec = TrainingJobSpec.model_validate({
        "engine": "fsdp",
        "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task"},
        "workers": {"replicas": 2, **(workers or {})},
        **fields,
    })
    pod = trainingjob_render.worker_pod(JOB, spec, 0, attempt=0, image="loom/trainer:1", mlflow_run_id=None)
    env = pod["spec"]["containers"][0]["env"]
    assert len({e["name"] for e in env}) == len(env)  # server-side apply refuses a repeated name
    return {e["name"]: e for e in env}


def test_a_training_worker_gets_the_threads_of_its_cpu() -> None:
    assert trainer_env()["OMP_NUM_THREADS"]["value"] == "1"
    assert trainer_env(workers={"resources": {"limits": {"cpu": "6"}}})["OMP_NUM_THREADS"]["value"] == "6"


def test_a_users_thread_count_replaces_loom_s() -> None:
    env = trainer_env(workers={"resources": {"limits": {"cpu": "6"}}},
                      env=[{"name": "OMP_NUM_THREADS", "value": "12"}])
    assert env["OMP_NUM_THREADS"]["value"] == "12"


def server_containers(spec_wire: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    spec = InferenceServiceSpec.model_validate(spec_wire)
    owner = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
             "metadata": {"name": "gpt", "namespace": "ml", "uid": "uid-1", "generation": 1}, "spec": spec_wire}
    _, deployment = render_deployment(owner, spec, "stable", resolve_model(spec.model, spec.serving_handler), 1,
                                      "loom/server:1", vllm_image="loom/vllm:1")
    pod = deployment["spec"]["template"]["spec"]
    return {c["name"]: {e["name"]: e for e in c.get("env", [])} for c in pod["initContainers"] + pod["containers"]}


MODEL = {"uri": "s3://models/gpt/v1", "endpoint": "http://s3:9000"}


def test_the_default_runtimes_server_gets_the_threads_of_its_cpu() -> None:
    env = server_containers({"model": MODEL, "handler": "chargpt", "resources": {"requests": {"cpu": "2"}}})
    assert env["server"]["OMP_NUM_THREADS"]["value"] == "2"
    env = server_containers({"model": MODEL, "handler": "chargpt", "env": [{"name": "OMP_NUM_THREADS", "value": "3"}]})
    assert env["server"]["OMP_NUM_THREADS"]["value"] == "3"


def test_the_vllm_runtime_places_its_own_threads() -> None:
    env = server_containers({"model": {**MODEL, "name": "llama"}, "runtime": "vllm",
                             "resources": {"requests": {"cpu": "2"}}})
    assert "OMP_NUM_THREADS" not in env["server"]
