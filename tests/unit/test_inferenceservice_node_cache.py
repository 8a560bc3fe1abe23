"""The node cache of S3 and MLflow models in the rendered pod: off unless the operator's settings name a folder; then
a hostPath volume that only the fetch step mounts, with the variables loom.workloads.server.node_cache_io reads."""

from __future__ import annotations

from typing import Any

import pytest

from loom.devstack.images import IMAGE_ENV
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.controller import model_node_cache
from loom.operator.kinds.inferenceservice.render import ModelNodeCache, render_deployment
from loom.operator.kinds.inferenceservice.source.model import ModelRef, resolve_model
from loom.operator.settings import OperatorSettings
from loom.workloads.server.node_cache_io import DIR_ENV, LIMIT_ENV

CACHE = ModelNodeCache("/var/lib/loom/model-cache", 20 * 2**30)
S3 = {"model": {"uri": "s3://models/gpt/v1", "endpoint": "http://s3:9000"}, "handler": "chargpt"}
MLFLOW = {"model": {"mlflow": "models:/gpt/3", "trackingUri": "http://mlflow:5000"}, "handler": "chargpt"}


def pod(spec_wire: dict[str, Any], cache: ModelNodeCache | None, kind: str | None = None) -> dict[str, Any]:
    spec = InferenceServiceSpec.model_validate(spec_wire)
    ref = resolve_model(spec.model, spec.serving_handler)
    if kind is not None:
        ref = ModelRef.model_validate({**ref.model_dump(), "storage_kind": kind})
    owner = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
             "metadata": {"name": "gpt", "namespace": "ml", "uid": "u"}, "spec": spec_wire}
    _, deployment = render_deployment(owner, spec, "stable", ref, 2, "localhost/loom/server:t",
                                      vllm_image="localhost/loom/vllm:t", node_cache=cache)
    template: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return template


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


@pytest.mark.parametrize("spec", [S3, MLFLOW, {**S3, "runtime": "vllm"}], ids=["s3", "mlflow", "vllm"])
def test_only_the_fetch_step_mounts_the_nodes_cache(spec: dict[str, Any]) -> None:
    rendered = pod(spec, CACHE)
    volume = next(v for v in rendered["volumes"] if v["name"] == "model-node-cache")
    assert volume == {"name": "model-node-cache",
                      "hostPath": {"path": "/var/lib/loom/model-cache", "type": "DirectoryOrCreate"}}
    fetch, server = rendered["initContainers"][0], rendered["containers"][0]
    assert {"name": "model-node-cache", "mountPath": "/var/cache/loom/models"} in fetch["volumeMounts"]
    assert env_of(fetch)[DIR_ENV] == "/var/cache/loom/models"
    assert env_of(fetch)[LIMIT_ENV] == str(20 * 2**30)
    assert "model-node-cache" not in [m["name"] for m in server["volumeMounts"]]
    assert DIR_ENV not in env_of(server)


def test_without_the_setting_or_for_a_checkpoint_the_pod_is_as_before() -> None:
    assert pod(S3, None) == pod(S3, None)
    for rendered in (pod(S3, None), pod(S3, CACHE, kind="checkpoint")):
        assert "model-node-cache" not in [v["name"] for v in rendered["volumes"]]
        assert DIR_ENV not in env_of(rendered["initContainers"][0])
    without, checkpoint = pod(S3, None), pod(S3, CACHE, kind="checkpoint")
    assert without["initContainers"][0]["volumeMounts"] == checkpoint["initContainers"][0]["volumeMounts"]


def test_the_setting_comes_from_its_loom_variable_and_must_be_absolute() -> None:
    assert model_node_cache(OperatorSettings.from_env(IMAGE_ENV)) is None
    settings = OperatorSettings.from_env({**IMAGE_ENV, "LOOM_MODEL_NODE_CACHE_DIR": "/var/lib/loom/model-cache",
                                          "LOOM_MODEL_NODE_CACHE_LIMIT_BYTES": "1000"})
    assert model_node_cache(settings) == ModelNodeCache("/var/lib/loom/model-cache", 1000)
    assert OperatorSettings.from_env(IMAGE_ENV).model_node_cache_limit_bytes == 50 * 2**30
    with pytest.raises(ValueError, match="LOOM_MODEL_NODE_CACHE_DIR"):
        OperatorSettings.from_env({**IMAGE_ENV, "LOOM_MODEL_NODE_CACHE_DIR": "model-cache"})
    with pytest.raises(ValueError, match="LOOM_MODEL_NODE_CACHE_LIMIT_BYTES"):
        OperatorSettings.from_env({**IMAGE_ENV, "LOOM_MODEL_NODE_CACHE_LIMIT_BYTES": "0"})
