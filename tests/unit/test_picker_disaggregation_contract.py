"""The operator <-> picker contract of a disaggregated service, end to end without a cluster: the pools the operator
renders for two model versions at once (a rollout half way), their pods as the API server would list them, and the
picker's own config for the service: the picker selects every pool pod, reads each one's role and kv-version, sends
client requests to decode pods only and pairs each with a prefill pod of its own version only."""

from __future__ import annotations

from typing import Any

from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.llm import disaggregation
from loom.operator.kinds.inferenceservice.render import render_deployment
from loom.operator.kinds.inferenceservice.source.model import resolve_model
from loom.operator.kinds.inferenceservice.traffic.picker import picker_config
from loom.workloads.picker.disaggregation import prefill_partners, serving_endpoints
from loom.workloads.picker.kube import ready_replicas

OWNER: dict[str, Any] = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
                         "metadata": {"name": "chat", "namespace": "ml", "uid": "u", "generation": 1}}


def wire(model: str) -> dict[str, Any]:
    return {"model": {"uri": f"s3://models/llama/{model}", "name": "llama"}, "runtime": "vllm",
            "vllm": {"disaggregation": {"kvStorage": {"claimName": "kv"}, "prefill": {"replicas": 1},
                                        "decode": {"replicas": 1}}}}


def pool_pods(model: str, first_ip: int) -> list[dict[str, Any]]:
    """One Ready pod per rendered pool of the service at `model`, with the labels of the pool's template."""
    spec = InferenceServiceSpec.model_validate(wire(model))
    _, deployment = render_deployment({**OWNER, "spec": wire(model)}, spec, "stable",
                                      resolve_model(spec.model, spec.serving_handler), 1, "img:test",
                                      vllm_image="vllm:test")
    pods = []
    for i, pool in enumerate(disaggregation.pools(deployment, spec)):
        labels = pool["spec"]["template"]["metadata"]["labels"]
        pods.append({"metadata": {"name": f"{pool['metadata']['name']}-{model}", "labels": labels},
                     "status": {"podIP": f"10.0.0.{first_ip + i}",
                                "conditions": [{"type": "Ready", "status": "True"}]}})
    return pods


def test_the_picker_pairs_the_operators_pools_within_a_version_during_a_rollout() -> None:
    pods = pool_pods("v1", 1) + pool_pods("v2", 11)
    config = picker_config(OWNER, InferenceServiceSpec.model_validate(wire("v2")), "prefix-cache")
    assert config.disaggregation is not None
    selected = [p for p in pods if config.pod_selector.items() <= p["metadata"]["labels"].items()]
    assert selected == pods  # the picker watches both pools of both versions
    replicas = ready_replicas(selected, config.target_port, config.track_label, config.disaggregation)
    assert sorted(p.role or "" for p in replicas.values()) == ["decode", "decode", "prefill", "prefill"]
    versions = {p.kv_version for p in replicas.values()}
    assert len(versions) == 2 and None not in versions  # a new model is a new kv-version
    decodes = serving_endpoints(replicas)
    assert {replicas[e].role for e in decodes} == {"decode"}
    for endpoint in decodes:
        [partner] = prefill_partners(replicas, endpoint)
        assert replicas[partner].role == "prefill"
        assert replicas[partner].kv_version == replicas[endpoint].kv_version
