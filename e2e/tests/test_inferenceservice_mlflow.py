"""An InferenceService serving a model from the real MLflow registry (artifacts in the real S3 server) by alias:
the pod gets the tracking URI, the S3 endpoint and the credentials Secret by reference; the operator resolves the
alias to a version (status.alias) and pins the served model to it, and the server reports that version. When the
alias moves, the service rolls out the new version and status says why.
"""

from __future__ import annotations

import importlib
import json
import uuid
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.servers import MLflowEndpoint, S3Endpoint
from loom.e2e.pytest_operator import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def register_affine_models(mlflow: MLflowEndpoint, s3: S3Endpoint, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Versions 1 (x * 3) and 2 (x * 5) of a pyfunc model; alias `champion` on version 1."""
    mlflow_lib = importlib.import_module("mlflow")
    pyfunc = importlib.import_module("mlflow.pyfunc")
    tracking = importlib.import_module("mlflow.tracking")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow.url)
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)

    class Affine(pyfunc.PythonModel):  # type: ignore[misc,name-defined]
        def __init__(self, scale: float) -> None:
            self.scale = scale

        # No type hints: MLflow would read them as an input schema.
        def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
            return np.asarray(model_input, dtype=np.float64) * self.scale

    mlflow_lib.set_experiment("isvc-e2e")
    for scale in (3.0, 5.0):
        with mlflow_lib.start_run():
            pyfunc.log_model(name="model", python_model=Affine(scale), registered_model_name=name)
    tracking.MlflowClient().set_registered_model_alias(name, "champion", "1")


def test_serves_an_mlflow_registry_alias(
    cluster: Cluster,
    loom_operator: OperatorProcess,
    operator_namespace: str,
    s3: S3Endpoint,
    mlflow: MLflowEndpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ns = operator_namespace
    model = f"affine-{uuid.uuid4().hex[:6]}"
    register_affine_models(mlflow, s3, model, monkeypatch)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s3-credentials"},
        "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key},
    }
    isvc = {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "affine"},
        "spec": {
            "model": {
                "mlflow": f"models:/{model}@champion",
                "trackingUri": mlflow.url,
                "endpoint": s3.url,
                "secretRef": {"name": "s3-credentials"},
                "aliasPollSeconds": 5,  # the test waits for the move; the default is 30 s
            },
            "handler": "auto",  # an MLflow source means an MLflow pyfunc handler
            "replicas": 1,
            "nodeSelector": {"kubernetes.io/hostname": AGENT_NODE_NAME},
            "env": [{"name": "AWS_DEFAULT_REGION", "value": s3.region}, {"name": "OMP_NUM_THREADS", "value": "1"}],
        },
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all([secret, isvc]))

    def ready() -> dict[str, Any] | None:
        result = cluster.kubectl("get", "inferenceservice", "affine", "-n", ns, "-o", "json", check=False)
        obj = json.loads(result.stdout) if result.returncode == 0 else {}
        conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
        return obj if conds.get("Ready", {}).get("status") == "True" else None

    try:
        obj = wait_until(ready, timeout=400, what="the MLflow-served InferenceService to be Ready", interval=2)
    except TimeoutError as error:
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        raise AssertionError(f"{error}\n{pods}\n{loom_operator.log_tail()}") from None

    # The operator resolved the alias: status names the version and where the alias pointed.
    assert obj["status"]["modelVersion"] == "1"
    assert (obj["status"]["alias"]["alias"], obj["status"]["alias"]["version"]) == ("champion", "1")
    deployment = json.loads(cluster.kubectl("get", "deployment", "affine", "-n", ns, "-o", "json").stdout)
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MLFLOW_TRACKING_URI"]["value"] == mlflow.url
    assert env["MLFLOW_S3_ENDPOINT_URL"]["value"] == s3.url
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-credentials"

    response = httpx.post(
        f"http://{service_address('affine', ns, AGENT_STATE_DIR)}:80/v2/models/affine/infer",
        json={"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP64", "data": [1, 2]}]},
        timeout=30,
        trust_env=False,
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["model_version"] == "1"
    assert answer["outputs"][0]["data"] == [3.0, 6.0]

    # The alias moves (as a person or a pipeline would move it): the service rolls out version 2 by itself.
    importlib.import_module("mlflow.tracking").MlflowClient().set_registered_model_alias(model, "champion", "2")

    def moved() -> dict[str, Any] | None:
        obj = ready()
        rolled = {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions", [])}.get("RolledOut", {})
        return obj if obj and obj["status"].get("modelVersion") == "2" and rolled.get("status") == "True" else None

    try:
        obj = wait_until(moved, timeout=300, what="version 2 rolled out after the alias moved", interval=2)
    except TimeoutError as error:
        raise AssertionError(f"{error}\n{loom_operator.log_tail()}") from None
    assert obj["status"]["modelChanged"].startswith(f"alias champion of {model} moved from version 1 to 2")
    response = httpx.post(
        f"http://{service_address('affine', ns, AGENT_STATE_DIR)}:80/v2/models/affine/infer",
        json={"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP64", "data": [1, 2]}]},
        timeout=30,
        trust_env=False,
    )
    assert response.status_code == 200, response.text
    assert (response.json()["model_version"], response.json()["outputs"][0]["data"]) == ("2", [5.0, 10.0])
