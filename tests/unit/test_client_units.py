"""The SDK's pure parts: when a wait is over (and the message it fails with), the local mode's plan and refusals,
numpy tensors against the model server's own protocol decoder, Service URLs, the port forwarder's piping, and the
CLI's kubectl-shaped parsing."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loom.client import (
    CheckpointSpec,
    Entrypoint,
    EnvVar,
    LocalRunRefused,
    MlflowTracking,
    Tracking,
    TrainingJob,
    TrainingJobSpec,
    Workers,
    training_job,
)
from loom.client.access import Direct, Forwarder, ServiceUrl
from loom.client.cli import _target, parse_duration, table
from loom.client.local import plan
from loom.client.models import kind_named
from loom.client.tensors import decode_outputs, encode_request
from loom.client.training import TrainingProgress
from loom.client.waiting import Target, explain, judge
from loom.workloads.server.protocol import decode_infer_request

# ------------------------------------------------------------------------------------------- waiting


def obj(kind: str, phase: str | None, conditions: list[dict[str, Any]], generation: int = 1) -> dict[str, Any]:
    return {"kind": kind, "metadata": {"name": "x", "generation": generation},
            "status": {"phase": phase, "conditions": conditions}}


def cond(type_: str, status: str, reason: str = "R", message: str = "", observed: int | None = None) -> dict[str, Any]:
    found = {"type": type_, "status": status, "reason": reason, "message": message}
    if observed is not None:
        found["observedGeneration"] = observed
    return found


def test_a_condition_wait_is_over_when_it_holds_for_the_current_generation() -> None:
    ready = obj("InferenceService", "Ready", [cond("Ready", "True", observed=2)], generation=2)
    assert judge(ready, Target()).done
    stale = obj("InferenceService", "Ready", [cond("Ready", "True", observed=1)], generation=2)
    assert not judge(stale, Target()).done


def test_a_failed_object_fails_the_wait_with_its_own_condition_message() -> None:
    failed = obj("InferenceService", "Failed", [
        cond("ModelLoaded", "False", "LoadFailed", "no model under s3://models/x"),
        cond("Ready", "False", "ModelNotLoaded", "the model failed to load: no model under s3://models/x"),
    ])
    verdict = judge(failed, Target())
    assert not verdict.done
    assert verdict.failure == (
        "InferenceService x is Failed (Ready=False ModelNotLoaded: the model failed to load: no model under "
        "s3://models/x) and cannot reach condition Ready=True"
    )


def test_a_job_that_succeeded_fails_a_wait_for_failure_and_a_running_one_does_not() -> None:
    done = obj("TrainingJob", "Succeeded", [cond("Ready", "True")])
    assert judge(done, Target(condition=None, phase="Succeeded")).done
    assert judge(done, Target(condition=None, phase="Failed")).failure is not None
    running = obj("TrainingJob", "Running", [cond("Ready", "False", "Training", "step 3 of 10")])
    verdict = judge(running, Target(condition=None, phase="Succeeded"))
    assert not verdict.done and verdict.failure is None
    assert verdict.summary == "phase Running; Ready=False Training: step 3 of 10"


def test_explain_prefers_ready_then_any_false_condition() -> None:
    assert explain(obj("X", None, [cond("A", "False", "Oops", "a broke"), cond("Ready", "True")])) == \
        "A=False Oops: a broke"
    assert explain(obj("X", None, [])) == ""
    with pytest.raises(ValueError):
        Target(condition="Ready", phase="Succeeded")


def test_progress_reads_the_status_and_falls_back_to_the_spec_for_the_total() -> None:
    job = TrainingJob.model_validate({
        "metadata": {"name": "g"}, "spec": {"engine": "fsdp", "entrypoint": {"module": "a:b"}, "maxSteps": 50},
        "status": {"phase": "Running", "restarts": 1,
                   "progress": {"step": 10, "loss": 2.5, "samplesPerSecond": 120.0, "eta": "1m20s"}},
    })
    progress = TrainingProgress.of(job)
    assert (progress.step, progress.total_steps, progress.restarts, progress.fraction) == (10, 50, 1, 0.2)
    assert progress.line() == "Running step 10/50 loss 2.5000 throughput 120.0/s ETA 1m20s restarts 1"


# ------------------------------------------------------------------------------------------- local mode


def job(**changes: Any) -> TrainingJob:
    fields: dict[str, Any] = {
        "engine": "fsdp",
        "entrypoint": Entrypoint(module="loom.workloads.trainer.examples.chargpt:task", args=["nLayer=2"]),
        "max_steps": 20,
        "workers": Workers(replicas=2),
        "checkpoint": CheckpointSpec(uri="s3://ckpt/gpt", every_steps=5),
        "tracking": Tracking(mlflow=MlflowTracking(tracking_uri="http://mlflow.mlops.svc:5000", experiment="e")),
    }
    return training_job("gpt", TrainingJobSpec(**{**fields, **changes}))


def test_the_plan_is_the_operators_trainer_config_with_local_paths(tmp_path: Path) -> None:
    the_plan = plan(job(), workdir=tmp_path, checkpoint_dir=tmp_path / "store", tracking_uri="http://127.0.0.1:5000")
    config = the_plan.config
    assert the_plan.processes == 2
    assert "--nproc-per-node=2" in the_plan.argv and the_plan.argv[-2:] == ["--config", str(tmp_path / "trainer.json")]
    assert config.training.task_args == {"nLayer": 2} and config.training.max_steps == 20
    assert config.training.device == "cpu" and the_plan.env["CUDA_VISIBLE_DEVICES"] == ""
    assert config.checkpoint is not None and config.checkpoint.uri == "s3://ckpt/gpt"
    assert config.checkpoint.endpoint == f"file://{(tmp_path / 'store').resolve()}"
    assert config.checkpoint.staging_dir == str(tmp_path.resolve() / "staging")
    assert config.progress.file == str(tmp_path.resolve() / "progress.json") and config.progress.metrics_port is None
    assert config.tracking.mlflow is not None and config.tracking.mlflow.tracking_uri == "http://127.0.0.1:5000"
    assert the_plan.mlflow == ("http://127.0.0.1:5000", "e")


def test_gpus_that_are_not_there_are_refused_with_what_to_change(tmp_path: Path) -> None:
    gpu_job = job(workers=Workers(replicas=2, gpus_per_worker=4))
    with pytest.raises(LocalRunRefused) as caught:
        plan(gpu_job, workdir=tmp_path, gpus_here=0)
    assert str(caught.value) == (
        "TrainingJob gpt asks for GPUs (workers.gpusPerWorker: 4, 8 processes, one GPU each) and this machine has "
        "0 CUDA device(s). Run it with fewer processes (--processes 0), set workers.gpusPerWorker: 0 to train on "
        "CPU here."
    )
    with pytest.raises(LocalRunRefused, match="has 2 CUDA device"):
        plan(gpu_job, workdir=tmp_path, gpus_here=2)
    ok = plan(gpu_job, workdir=tmp_path, gpus_here=2, processes=2)
    assert ok.config.training.device == "cuda" and ok.env.get("CUDA_VISIBLE_DEVICES") != ""


def test_what_needs_the_cluster_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(LocalRunRefused, match="module entrypoints"):
        plan(job(entrypoint=Entrypoint(command=["python", "train.py"])), workdir=tmp_path)
    secret_env = [EnvVar(name="HF_TOKEN", value_from={"secretKeyRef": {"name": "hf", "key": "token"}})]
    with pytest.raises(LocalRunRefused, match="env HF_TOKEN comes from valueFrom"):
        plan(job(env=secret_env), workdir=tmp_path)
    assert plan(job(env=secret_env), workdir=tmp_path, env={"HF_TOKEN": "t"}).env["HF_TOKEN"] == "t"
    no_uri = job(tracking=Tracking(mlflow=MlflowTracking(experiment="e")))
    with pytest.raises(LocalRunRefused, match="--tracking-uri"):
        plan(no_uri, workdir=tmp_path)
    with pytest.raises(LocalRunRefused, match=r"needs spec\.checkpoint"):
        plan(job(checkpoint=None), workdir=tmp_path, checkpoint_dir=tmp_path)


# ------------------------------------------------------------------------------------------- tensors


def test_numpy_tensors_decode_in_the_model_servers_own_protocol_code() -> None:
    inputs = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "ids": np.array([1, 2], dtype=np.int64),
              "text": np.array(["a", "b"])}
    body = encode_request(inputs, outputs=["y"], parameters={"driver_id": 1001})
    decoded = decode_infer_request(json.dumps(body).encode(), None).request
    tensors = decoded.inputs
    assert tensors["x"].datatype == "FP32"
    np.testing.assert_array_equal(tensors["x"].data, inputs["x"])
    assert tensors["ids"].datatype == "INT64" and tensors["text"].datatype == "BYTES"
    assert tensors["text"].data.tolist() == ["a", "b"]
    assert decoded.parameters == {"driver_id": 1001} and decoded.requested_outputs == ["y"]


def test_outputs_come_back_as_arrays_of_their_datatype_and_shape() -> None:
    out = decode_outputs({"outputs": [{"name": "y", "shape": [2, 2], "datatype": "INT32", "data": [1, 2, 3, 4]}]})
    assert out["y"].dtype == np.int32 and out["y"].tolist() == [[1, 2], [3, 4]]


# ------------------------------------------------------------------------------------------- access


def test_service_urls_are_split_into_service_namespace_and_port() -> None:
    assert ServiceUrl.parse("http://chat.team-a.svc") == ServiceUrl("http", "chat", "team-a", 80, "")
    assert ServiceUrl.parse("http://mlflow.mlops.svc.cluster.local:5000/x?y=1") == \
        ServiceUrl("http", "mlflow", "mlops", 5000, "/x?y=1")
    assert ServiceUrl.parse("http://mlflow:5000", "ns") == ServiceUrl("http", "mlflow", "ns", 5000, "")
    assert ServiceUrl.parse("https://mlflow.example.com") is None
    assert ServiceUrl.parse("http://127.0.0.1:5000") is None


def test_direct_access_maps_services_and_leaves_other_hosts() -> None:
    access = Direct(lambda name, ns: f"127.0.9.{len(name)}")
    with access.open("http://chat.team-a.svc/") as url:
        assert url == "http://127.0.9.4:80"
    with access.open("https://models.example.com/v1") as url:
        assert url == "https://models.example.com/v1"


def test_the_forwarder_pipes_bytes_both_ways_to_the_socket_it_opens() -> None:
    upstream = socket.create_server(("127.0.0.1", 0))

    def echo_upper() -> None:
        conn, _ = upstream.accept()
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data.upper())

    threading.Thread(target=echo_upper, daemon=True).start()
    port = upstream.getsockname()[1]
    with (
        Forwarder(lambda: socket.create_connection(("127.0.0.1", port))) as forwarder,
        socket.create_connection(("127.0.0.1", forwarder.port), timeout=10) as client,
    ):
        client.sendall(b"hello through the forward")
        received = b""
        while len(received) < 25:
            received += client.recv(1024)
    assert received == b"HELLO THROUGH THE FORWARD"
    upstream.close()


# ------------------------------------------------------------------------------------------- CLI


def test_kubectl_shaped_flags() -> None:
    assert parse_duration("90s") == 90 and parse_duration("1h30m") == 5400 and parse_duration("2") == 2
    with pytest.raises(Exception, match="not a duration"):
        parse_duration("10 minutes")
    assert _target("condition=Ready") == Target(condition="Ready")
    assert _target("condition=Ready=False") == Target(condition="Ready", status="False")
    assert _target("phase=Succeeded") == Target(condition=None, phase="Succeeded")
    assert _target("jsonpath={.status.phase}=Failed") == Target(condition=None, phase="Failed")
    assert kind_named("ltj").kind == "TrainingJob" and kind_named("InferenceServices").kind == "InferenceService"


def test_get_prints_the_crds_printer_columns() -> None:
    items = [{"metadata": {"name": "gpt"}, "spec": {"engine": "fsdp"},
              "status": {"phase": "Running", "progress": {"step": 7, "totalSteps": 20}, "restarts": 1}}]
    lines = table(kind_named("trainingjobs"), items, wide=False).splitlines()
    assert lines[0].split() == ["NAME", "ENGINE", "PHASE", "READY", "DESIRED", "STEP", "TOTAL", "RESTARTS", "AGE"]
    assert lines[1].split() == ["gpt", "fsdp", "Running", "7", "20", "1"]


# ------------------------------------------------------------------------------------------- the OpenAI client


def test_the_openai_client_is_pointed_at_the_services_v1_api_with_its_key() -> None:
    import http.server
    import types

    from loom.client import InferenceService, Service

    seen: list[tuple[str, str | None]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("authorization")))
            body = json.dumps({"object": "list", "data": [{"id": "chat", "object": "model", "created": 0,
                                                           "owned_by": "loom"}]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    isvc = InferenceService.model_validate({
        "metadata": {"name": "chat", "namespace": "team-a"},
        "spec": {"model": {"uri": "s3://models/chat"}},
        "status": {"url": "http://chat.team-a.svc"},
    })
    # The cluster side is a stand-in (a Client that returns this object); the HTTP side is a real server.
    cluster = types.SimpleNamespace(
        get=lambda *_: isvc, access=Direct(lambda name, ns: "127.0.0.1"), namespace="team-a"
    )
    service = Service(cluster, "chat", "team-a", api_key="k-123")  # type: ignore[arg-type]
    port = server.server_address[1]
    isvc.status.url = f"http://chat.team-a.svc:{port}"  # type: ignore[union-attr]
    with service.openai() as api:
        models = api.models.list()
    server.shutdown()
    assert [m.id for m in models.data] == ["chat"]
    assert seen == [("/v1/models", "Bearer k-123")]


def test_loom_run_local_refuses_the_gpu_example_on_a_machine_without_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from loom.client import local
    from loom.client.cli import run

    # What torch reports on a machine without CUDA devices (so the test means the same on a GPU machine).
    monkeypatch.setattr(local, "visible_gpus", lambda: 0)
    example = Path(__file__).resolve().parents[2] / "examples" / "trainingjob-deepspeed-elastic-gpu.yaml"
    result = CliRunner().invoke(run, ["-f", str(example), "--local", "--workdir", str(tmp_path)])
    assert result.exit_code == 1
    assert "asks for GPUs (workers.gpusPerWorker: 8" in result.output and "0 CUDA device(s)" in result.output
    assert not (tmp_path / "trainer.json").exists()  # nothing was started


def test_the_client_takes_the_kubeconfig_context_and_its_namespace_as_kubectl_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import yaml

    from loom.client import Client, PortForward

    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "a",
        "clusters": [{"name": "c1", "cluster": {"server": "https://127.0.0.1:6443"}},
                     {"name": "c2", "cluster": {"server": "https://10.0.0.2:6443"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "a", "context": {"cluster": "c1", "user": "u", "namespace": "team-a"}},
                     {"name": "b", "context": {"cluster": "c2", "user": "u"}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    current = Client()
    assert current.namespace == "team-a" and current.connection.api.configuration.host == "https://127.0.0.1:6443"
    assert isinstance(current.access, PortForward)  # outside a pod: Services through a port-forward
    other = Client(context="b")
    assert other.namespace == "default" and other.connection.api.configuration.host == "https://10.0.0.2:6443"
    assert Client(context="b", namespace="x").namespace == "x"


def test_a_port_forward_the_node_refuses_is_named_before_any_request(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from loom.client import PortForward, PortForwardRefused

    forward = PortForward(SimpleNamespace(namespace="team-a"))  # type: ignore[arg-type]
    monkeypatch.setattr(forward, "_pod_and_port", lambda target: ("bot-7d9-x2", 8080))

    def refused(namespace: str, pod: str, port: int) -> Any:
        raise AttributeError("'NoneType' object has no attribute 'decode'")  # what the kubernetes client raises

    monkeypatch.setattr(forward, "_pod_socket", refused)
    with pytest.raises(PortForwardRefused) as caught, forward.open("http://bot.team-a.svc/v2/health/ready"):
        pass
    message = str(caught.value)
    assert message.startswith("cannot port-forward to pod team-a/bot-7d9-x2 port 8080 for Service bot: ")
    assert "the pod's node did not open the forward" in message and "access=Direct(...)" in message
