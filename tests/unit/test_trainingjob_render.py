"""Rendering a TrainingJob into its children: pure functions, checked value by value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from loom.e2e.example_specs import resolved
from loom.operator.kinds.trainingjob import render
from loom.operator.kinds.trainingjob.api import TrainingJobSpec
from loom.operator.kinds.trainingjob.config import SpecError, task_args, torchrun_command, trainer_config
from loom.operator.kinds.trainingjob.observe import observe_node, observe_pod, parse_progress
from loom.workloads.trainer.config import TrainerConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
JOB: dict[str, Any] = {
    "apiVersion": "loom.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "gpt", "namespace": "team-a", "uid": "uid-123", "generation": 1},
}


def spec(**overrides: Any) -> TrainingJobSpec:
    base: dict[str, Any] = {
        "engine": "fsdp",
        "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task", "args": ["nLayer=2", "dataset=tiny"]},
        "maxSteps": 50,
        "workers": {"replicas": 2},
        "checkpoint": {
            "uri": "s3://ckpt/gpt",
            "endpoint": "http://127.0.0.1:9000",
            "secretRef": {"name": "s3-creds"},
            "everySteps": 10,
        },
        "tracking": {"mlflow": {"trackingUri": "http://mlflow:5000", "experiment": "gpt"}},
    }
    base.update(overrides)
    return TrainingJobSpec.model_validate(base)


def pod(index: int = 0, **kwargs: Any) -> dict[str, Any]:
    return render.worker_pod(JOB, spec(**kwargs), index, attempt=3, image="loom/trainer:1", mlflow_run_id="run-9")


def test_headless_service_publishes_not_ready_addresses_and_selects_workers() -> None:
    svc = render.headless_service(JOB)
    assert svc["metadata"]["name"] == "gpt-workers"  # not "gpt": an InferenceService gpt owns that Service
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"loom.dev/trainingjob": "gpt", "app.kubernetes.io/component": "worker"}
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "uid-123"


def test_pod_identity_hostname_and_attempt_label() -> None:
    manifest = pod(1)
    assert manifest["metadata"]["name"] == "gpt-worker-1"
    assert manifest["spec"]["hostname"] == "gpt-worker-1"
    assert manifest["spec"]["subdomain"] == "gpt-workers"
    labels = manifest["metadata"]["labels"]
    assert labels["loom.dev/attempt"] == "3"
    # The trainer learns its gang attempt too (its MLflow resume tags are keyed by it).
    env = {e["name"]: e.get("value") for e in manifest["spec"]["containers"][0]["env"]}
    assert env["LOOM_GANG_ATTEMPT"] == "3"
    assert labels["loom.dev/worker-index"] == "1"
    assert labels["loom.dev/trainingjob"] == "gpt"
    assert manifest["spec"]["restartPolicy"] == "Never"
    assert manifest["metadata"]["ownerReferences"][0]["controller"] is True


def test_torchrun_arguments() -> None:
    cmd = torchrun_command(
        spec(workers={"replicas": 3, "minReplicas": 2, "maxReplicas": 4}),
        job_name="gpt",
        namespace="team-a",
        job_uid="uid-123",
        index=0,
    )
    assert cmd[0] == "torchrun"
    assert "--nnodes=2:4" in cmd
    assert "--nproc-per-node=1" in cmd  # CPU: one process per worker
    assert "--rdzv-backend=c10d" in cmd
    assert "--rdzv-endpoint=gpt-worker-0.gpt-workers.team-a.svc:29400" in cmd
    assert "--rdzv-id=uid-123" in cmd
    assert "--rdzv-conf=is_host=1" in cmd
    # torchrun sorts agents by address to assign ranks: worker 0's name sorts first, so it is rank 0.
    assert "--local-addr=gpt-worker-0.gpt-workers.team-a.svc" in cmd
    assert any(a.startswith("--max-restarts=") for a in cmd)
    assert cmd[cmd.index("-m") + 1 :] == ["loom.workloads.trainer", "--config", "/etc/loom/trainer/config.json"]
    other = torchrun_command(spec(), job_name="gpt", namespace="team-a", job_uid="u", index=1)
    assert "--rdzv-conf=is_host=0" in other
    assert "--nnodes=2:2" in other


def test_gpus_set_nproc_resources_and_shared_memory() -> None:
    manifest = pod(0, workers={"replicas": 2, "gpusPerWorker": 4, "resources": {"limits": {"memory": "32Gi"}}})
    container = manifest["spec"]["containers"][0]
    assert "--nproc-per-node=4" in container["command"]
    assert container["resources"]["limits"] == {"memory": "32Gi", "nvidia.com/gpu": 4}
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])


def test_command_entrypoint_runs_without_python_launcher() -> None:
    manifest = pod(0, entrypoint={"command": ["python", "train.py"], "args": ["--lr", "3"]})
    command = manifest["spec"]["containers"][0]["command"]
    assert command[-5:] == ["--no-python", "python", "train.py", "--lr", "3"]


def test_secret_is_referenced_never_read() -> None:
    env = {e["name"]: e for e in pod()["spec"]["containers"][0]["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3-creds",
        "key": "AWS_SECRET_ACCESS_KEY",
    }
    assert "value" not in env["AWS_SECRET_ACCESS_KEY"]
    assert env["MLFLOW_RUN_ID"]["value"] == "run-9"
    assert env["MLFLOW_TRACKING_URI"]["value"] == "http://mlflow:5000"
    assert env["MLFLOW_S3_ENDPOINT_URL"]["value"] == "http://127.0.0.1:9000"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_user_env_overrides_ours_without_duplicates() -> None:
    manifest = pod(0, env=[{"name": "PYTHONUNBUFFERED", "value": "0"}, {"name": "EXTRA", "value": "x"}])
    env = manifest["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names))
    assert {e["name"]: e.get("value") for e in env}["PYTHONUNBUFFERED"] == "0"


def test_placement_and_security() -> None:
    manifest = pod(
        0,
        workers={
            "replicas": 2,
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
        scheduling={"schedulerName": "custom", "priorityClassName": "high"},
    )
    pod_spec = manifest["spec"]
    assert pod_spec["nodeSelector"] == {"gpu": "h100"}
    assert pod_spec["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod_spec["schedulerName"] == "custom"
    assert pod_spec["priorityClassName"] == "high"
    security = pod_spec["containers"][0]["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["allowPrivilegeEscalation"] is False


def test_config_map_holds_the_trainers_own_model() -> None:
    cm = render.config_map(JOB, spec(fsdp={"sharding": "none", "mixedPrecision": "bf16"}))
    assert cm["metadata"]["name"] == "gpt-trainer"
    raw = cm["data"]["config.json"]
    config = TrainerConfig.model_validate(json.loads(raw))
    assert config.engine.value == "fsdp"
    assert config.fsdp.sharding == "none"  # one word on both sides of the contract (was "no" in the trainer)
    assert config.fsdp.mixed_precision == "bf16"
    assert config.training.max_steps == 50
    assert config.training.device == "cpu"
    assert config.training.task_args == {"nLayer": 2, "dataset": "tiny"}
    assert config.checkpoint is not None and config.checkpoint.uri == "s3://ckpt/gpt"
    assert config.checkpoint.every_steps == 10
    assert config.tracking.mlflow is not None and config.tracking.mlflow.experiment == "gpt"
    assert config.progress.metrics_port == 9400
    assert "s3-creds" not in raw and "SECRET" not in raw


def test_deepspeed_options_rendered() -> None:
    config = trainer_config(spec(engine="deepspeed", deepspeed={"zeroStage": 3, "offload": "cpu", "bf16": True}))
    assert config.engine.value == "deepspeed"
    assert (config.deepspeed.zero_stage, config.deepspeed.offload, config.deepspeed.bf16) == (3, "cpu", True)


def test_trainer_rejection_becomes_spec_error() -> None:
    with pytest.raises(SpecError, match="offload"):
        trainer_config(spec(engine="deepspeed", deepspeed={"zeroStage": 0, "offload": "cpu"}))
    with pytest.raises(SpecError, match="key=value"):
        task_args(["oops"])


def test_pod_groups_for_gang_schedulers() -> None:
    assert render.pod_group(JOB, spec()) is None
    volcano = render.pod_group(
        JOB, spec(workers={"replicas": 4, "minReplicas": 3}, scheduling={"gang": "volcano", "queue": "q"})
    )
    assert volcano is not None
    assert volcano["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert volcano["spec"]["minMember"] == 3
    assert volcano["spec"]["queue"] == "q"
    vpod = render.worker_pod(JOB, spec(scheduling={"gang": "volcano"}), 0, attempt=0, image="i", mlflow_run_id=None)
    assert vpod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "gpt"
    assert vpod["spec"]["schedulerName"] == "volcano"
    plugins = render.pod_group(JOB, spec(scheduling={"gang": "scheduler-plugins", "scheduleTimeoutSeconds": 60}))
    assert plugins is not None and plugins["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert plugins["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 60}
    ppod = render.worker_pod(
        JOB, spec(scheduling={"gang": "scheduler-plugins"}), 0, attempt=0, image="i", mlflow_run_id=None
    )
    assert ppod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "gpt"


def test_observe_pod_reads_exit_codes_scheduling_and_disruption() -> None:
    manifest = pod(1)
    manifest["metadata"].update(uid="p1", creationTimestamp="2026-01-01T00:00:00Z")
    manifest["status"] = {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": "trainer",
                "state": {
                    "terminated": {
                        "exitCode": 1,
                        "reason": "Error",
                        "message": '{"exitCode": 2, "message": "bad config"}',
                    }
                },
            }
        ],
    }
    view = observe_pod(manifest)
    assert view is not None
    assert (view.index, view.attempt, view.exit_code, view.message) == (1, 3, 2, "bad config")
    assert not view.disrupted
    manifest["status"] = {"phase": "Failed", "reason": "Evicted"}
    evicted = observe_pod(manifest)
    assert evicted is not None and evicted.disrupted
    manifest["status"] = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}],
    }
    pending = observe_pod(manifest)
    assert pending is not None and pending.unschedulable == "0/3 nodes"
    assert observe_pod({"metadata": {"name": "x", "labels": {}}}) is None


def test_observe_pod_reads_the_final_checkpoint_of_a_successful_trainer() -> None:
    manifest = pod(0)
    message = ('{"exitCode": 0, "message": "training finished", "checkpoint": {"uri": "s3://b/j/step-120",'
               ' "step": 120}, "final": {"step": 120, "loss": 0.5}}')
    terminated = {"exitCode": 0, "reason": "Completed", "message": message}
    manifest["status"] = {
        "phase": "Succeeded",
        "containerStatuses": [{"name": "trainer", "state": {"terminated": terminated}}],
    }
    view = observe_pod(manifest)
    assert view is not None and view.final_checkpoint is not None
    assert (view.final_checkpoint.uri, view.final_checkpoint.step) == ("s3://b/j/step-120", 120)
    assert (view.final_loss, view.final_step) == (0.5, 120)
    terminated["message"] = message.replace("0.5", "NaN")
    assert (observe_pod(manifest) or view).final_loss is None  # status is JSON: a NaN loss is no loss
    manifest["status"]["phase"] = "Failed"  # a failed worker's message never moves status.checkpoint
    failed = observe_pod(manifest)
    assert failed is not None and failed.final_checkpoint is None and failed.final_loss is None


def test_observe_node_readiness() -> None:
    node = observe_node(
        {
            "metadata": {"name": "n1"},
            "status": {
                "conditions": [{"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-01-01T00:00:00Z"}]
            },
        }
    )
    assert not node.ready and node.since is not None and node.since.year == 2026


def test_parse_progress_contract() -> None:
    report = parse_progress(
        {
            "step": 10,
            "totalSteps": 50,
            "loss": 2.5,
            "samplesPerSecond": 33.0,
            "eta": 125,
            "latestCheckpoint": {"uri": "s3://c/step-10", "step": 10},
        }
    )
    assert report is not None
    assert (report.step, report.total_steps, report.loss, report.eta) == (10, 50, 2.5, "2m05s")
    assert report.latest_checkpoint is not None and report.latest_checkpoint.step == 10
    assert report.phase is None and report.starting is None
    # The trainer's phase tells a trainer that has not run a step since it (re)started.
    starting = parse_progress({"step": 0, "totalSteps": 50, "phase": "Starting"})
    assert starting is not None and starting.starting is True
    running = parse_progress({"step": 11, "phase": "Running"})
    assert running is not None and running.starting is False
    assert parse_progress("garbage") is None
    odd = parse_progress({"step": "ten", "loss": True, "phase": 3})
    assert odd is not None and odd.step is None and odd.loss is None and odd.phase is None


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("trainingjob-*.yaml")), ids=lambda p: p.name)
def test_examples_render_into_children(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    job = {**doc, "metadata": {**doc["metadata"], "namespace": "ns", "uid": "u"}}
    the_spec = resolved(TrainingJobSpec.model_validate(doc["spec"]))
    assert (
        render.name_problem(doc["metadata"]["name"], the_spec.workers.max_replicas or the_spec.workers.replicas) is None
    )
    TrainerConfig.model_validate(json.loads(render.config_map(job, the_spec)["data"]["config.json"]))
    worker = render.worker_pod(job, the_spec, 0, attempt=0, image="loom/trainer:0.1.0", mlflow_run_id="r")
    assert worker["spec"]["containers"][0]["command"][0] == "torchrun"


def test_names_that_cannot_be_hostnames_are_reported() -> None:
    assert render.name_problem("a" * 60, 2) is not None
    assert render.name_problem("9lives", 2) is not None
    assert render.name_problem("gpt", 1000) is None


def test_torchrun_lets_the_final_checkpoint_use_the_pods_grace_period() -> None:
    """On SIGTERM torchrun's agent SIGKILLs the trainer after its shutdown timeout (30 s by default): the final
    checkpoint gets the grace period instead, less the agent's own exit."""
    manifest = pod(0)
    grace = manifest["spec"]["terminationGracePeriodSeconds"]
    env = {e["name"]: e.get("value") for e in manifest["spec"]["containers"][0]["env"]}
    assert 30 < int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < grace
