"""loom.client end to end on the local stack: the notebook in examples/ (only loom.client: it trains the bundled
GPT, serves what it exported and queries it) runs to its end in a Jupyter kernel, and `result()` names the same
checkpoint as the job's status; the CLI verbs read the same objects; a job that cannot start fails a wait at once
with its own condition message.

Services are reached through the node agent's local Service addresses (`loom.client.Direct` with
`loom.devstack.agent.service_address`): the agent has no port-forward, so the SDK's PortForward (the default
outside a cluster) is exercised here only for its refusal; its forward end to end (API server, kwok's kubelet server)
in test_client_portforward.py, its piping in tests/unit/test_client_units.py.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import nbformat
import pytest
import yaml
from click.testing import CliRunner
from nbclient import NotebookClient

from loom.client import (
    Client,
    Direct,
    Entrypoint,
    InvalidObject,
    PortForward,
    PortForwardRefused,
    TrainingJob,
    TrainingJobSpec,
    WaitFailed,
    training_job,
)
from loom.client import cli as client_cli
from loom.client.models import name_of
from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.devstack.servers import MLflowEndpoint, S3Endpoint
from loom.e2e.pytest_operator import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "sdk-train-serve-query.ipynb"


def parameters(namespace: str, bucket: str, s3: S3Endpoint, mlflow: MLflowEndpoint) -> str:
    return "\n".join([
        f"namespace = {namespace!r}",
        f"bucket = {bucket!r}",
        f"s3_endpoint = {s3.url!r}",
        f"tracking_uri = {mlflow.url!r}",
        "from loom.client import Direct",
        "from loom.devstack.agent.proxies import service_address",
        f"access = Direct(lambda name, ns: service_address(name, ns, {str(AGENT_STATE_DIR)!r}))",
        "max_steps = 30",
    ])


def outputs(cell: Any) -> str:
    return "".join(str(o.get("text", "")) + json.dumps(o.get("data", {})) for o in cell.get("outputs", []))


def cli(*args: str) -> Any:
    command = client_cli.COMMANDS[args[0]]
    return CliRunner().invoke(command, list(args[1:]), catch_exceptions=False)


def test_the_sdk_notebook_trains_serves_and_queries_and_the_cli_agrees(
    cluster: Cluster,
    loom_operator: OperatorProcess,
    operator_namespace: str,
    s3: S3Endpoint,
    mlflow: MLflowEndpoint,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    ns = operator_namespace
    bucket = f"sdk-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=bucket)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-credentials"},
              "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}}
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(secret))
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.setenv("PYTHONSAFEPATH", "1")

    # A job whose task cannot be imported: its wait ends at once with the job's own words, not at the timeout.
    client = Client(namespace=ns, access=Direct(lambda name, n: service_address(name, n, AGENT_STATE_DIR)))
    broken = client.apply(training_job("broken", TrainingJobSpec(
        engine="fsdp", entrypoint=Entrypoint(module="loom_no_such_package.train:task"), max_steps=5)))

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    [parameter_cell] = [c for c in notebook.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    parameter_cell.source = parameters(ns, bucket, s3, mlflow)
    executed = NotebookClient(notebook, timeout=900, kernel_name="python3",
                              resources={"metadata": {"path": str(tmp_path)}}).execute()
    nbformat.write(executed, tmp_path / "executed.ipynb")
    text = [outputs(cell) for cell in executed.cells if cell.cell_type == "code"]

    # What the notebook printed is what the cluster holds.
    job = client.get(TrainingJob, "chargpt")
    assert job.status is not None and job.status.phase == "Succeeded" and job.status.checkpoint is not None
    latest = job.status.checkpoint.latest
    assert latest == f"s3://{bucket}/sdk-chargpt/step-{30:09d}"
    # Code cells: 0 parameters, 1 client, 2 train, 3 result, 4 metrics and logs, 5 serve, 6 query.
    shown = "\n".join(f"cell {i}: {t}" for i, t in enumerate(text))
    assert f"checkpoint: {latest}" in text[3], shown
    assert f"model: s3://{bucket}/sdk-chargpt/final" in text[3], shown
    assert job.status.mlflow is not None and f"MLflow run: {job.status.mlflow.run_id}" in text[3], shown
    assert "at step 30" in text[4] and '"event": "done"' in text[4], shown
    assert "final-step-30" in text[5], shown
    assert "text_output" in text[6] and "pieces:" in text[6], shown

    # The CLI verbs, as kubectl's.
    got = cli("get", "ltj", "chargpt", "-n", ns, "-o", "json")
    assert got.exit_code == 0, got.output
    assert json.loads(got.output)["status"]["checkpoint"]["latest"] == latest
    listed = cli("get", "trainingjobs", "-n", ns)
    assert listed.exit_code == 0 and listed.output.split("\n")[0].split()[:3] == ["NAME", "ENGINE", "PHASE"]
    assert any(line.split()[:3] == ["chargpt", "fsdp", "Succeeded"] for line in listed.output.splitlines())
    progress = cli("progress", "chargpt", "-n", ns)
    assert progress.output.startswith("Succeeded step 30/30 loss "), progress.output
    waited = cli("wait", "lis/chargpt", "-n", ns, "--for=condition=Ready", "--timeout=60s")
    assert waited.exit_code == 0 and "condition met" in waited.output
    address = f"http://{service_address('chargpt', ns, AGENT_STATE_DIR)}:80"
    predicted = cli("predict", "chargpt", "-n", ns, "--url", address, "-i", 'text_input=["The "]')
    assert predicted.exit_code == 0, predicted.output
    assert isinstance(json.loads(predicted.output)["text_output"][0], str)
    chatted = cli("chat", "chargpt", "The ", "-n", ns, "--url", address, "--max-tokens", "8")
    assert chatted.exit_code == 0 and chatted.output.strip(), chatted.output
    logged = cli("logs", "chargpt", "-n", ns, "--tail", "40")
    assert logged.exit_code == 0 and '"event": "done"' in logged.output, logged.output

    # The SDK's default outside a cluster on a node that serves no port-forward (the node agent): a clear refusal
    # naming the pod and what to do instead, before any request (it used to be a bare connection reset).
    forward = PortForward(client.connection).open(f"http://chargpt.{ns}.svc/v2/health/ready")
    refused = rf"cannot port-forward to pod {ns}/chargpt-.*node did not open the forward.*Direct"
    with pytest.raises(PortForwardRefused, match=refused), forward:
        pass

    # The broken job: WaitFailed with the job's condition message (the trainer's own, naming the module).
    with pytest.raises(WaitFailed) as caught:
        client.wait_for(broken, phase="Succeeded", timeout=600)
    assert "TrainingJob broken is Failed" in str(caught.value)
    assert "loom_no_such_package" in str(caught.value), str(caught.value)
    failed = cli("wait", "trainingjob/broken", "-n", ns, "--for=phase=Succeeded", "--timeout=60s")
    assert failed.exit_code == 1 and "loom_no_such_package" in failed.output

    # list and delete; a spec the API server would refuse never leaves this process.
    assert [name_of(j) for j in client.list(TrainingJob)] == ["broken", "chargpt"]
    assert client.delete(broken) is True and client.delete(TrainingJob, "broken") is False
    bad = training_job("Bad_Name", TrainingJobSpec(engine="fsdp", entrypoint=Entrypoint(module="a.b:c")))
    with pytest.raises(InvalidObject, match="DNS-1035"):
        client.apply(bad)
