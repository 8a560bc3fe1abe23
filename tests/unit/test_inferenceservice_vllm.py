"""runtime: vllm: the rendered pod (the OpenAI front over vLLM), its config, the API's rules, the LLM metrics'
PromQL, and the default runtime left exactly as it was."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from loom.operator.api.cel import admitted
from loom.operator.autoscale.promql import METRIC_KINDS, PodSelector, build_query
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.render import CONFIG_HASH_ANNOTATION, render_deployment
from loom.operator.kinds.inferenceservice.source.model import resolve_model
from loom.workloads.llm.__main__ import resolve_model_folder
from loom.workloads.llm.config import LlmServerConfig
from loom.workloads.server.fetch import MARKER

IMAGE = "localhost/loom/server:test"
VLLM_IMAGE = "localhost/loom/vllm:test"
BASE: dict[str, Any] = {"model": {"uri": "s3://models/llama/v1", "endpoint": "http://s3:9000", "name": "llama"}}


def render(spec_wire: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    owner = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
             "metadata": {"name": "chat", "namespace": "ml", "uid": "u"}, "spec": spec_wire}
    spec = InferenceServiceSpec.model_validate(spec_wire)
    result: tuple[dict[str, Any], dict[str, Any]] = render_deployment(
        owner, spec, "stable", resolve_model(spec.model, spec.serving_handler), 1, IMAGE,
        vllm_image=VLLM_IMAGE)
    return result


def server(deployment: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def test_the_vllm_pod_runs_the_openai_front_with_its_config_and_the_vllm_image() -> None:
    spec = {**BASE, "runtime": "vllm", "gpus": 2, "vllm": {
        "maxModelLen": 4096, "gpuMemoryUtilization": 0.85, "enablePrefixCaching": True, "maxNumSeqs": 128,
        "dtype": "bfloat16", "extraArgs": ["--swap-space=4"], "tokensPerMinute": 10000, "requestsPerMinute": 60,
    }, "auth": {"apiKeysSecretRef": {"name": "keys", "key": "keys"}}}
    config_map, deployment = render(spec)
    container = server(deployment)
    assert container["command"][:5] == ["python", "-m", "loom.workloads.llm", "--config", "/etc/loom/llm.json"]
    assert "--drain-seconds" in container["command"]  # the same SIGTERM drain as the default runtime
    assert container["image"] == VLLM_IMAGE
    init = deployment["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"][2] == "loom.workloads.server.fetch" and init["image"] == VLLM_IMAGE
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    llm = LlmServerConfig.model_validate_json(config_map["data"]["llm.json"])
    assert llm.model_name == "llama" and llm.port == 8080 and llm.model_dir == "/models"
    assert llm.engine.tensor_parallel_size == 2  # the pod's GPUs unless set
    assert (llm.engine.max_model_len, llm.engine.gpu_memory_utilization, llm.engine.max_num_seqs) == (4096, 0.85, 128)
    assert llm.engine.extra_args == ["--swap-space=4"] and llm.engine.dtype == "bfloat16"
    assert (llm.limits.tokens_per_minute, llm.limits.requests_per_minute) == (10000, 60)
    assert llm.auth.api_keys_file == "/var/run/loom/api-keys/keys"  # a path: the keys never reach the ConfigMap
    assert "server.json" in config_map["data"]  # the fetch step's contract is unchanged


def test_the_default_runtime_is_unchanged_and_a_vllm_option_change_rolls_the_pods() -> None:
    default_map, default_deployment = render({**BASE, "handler": "noop"})
    assert "llm.json" not in default_map["data"]
    assert server(default_deployment)["command"][2] == "loom.workloads.server"
    assert server(default_deployment)["image"] == IMAGE
    _, one = render({**BASE, "runtime": "vllm", "vllm": {"maxNumSeqs": 8}})
    _, two = render({**BASE, "runtime": "vllm", "vllm": {"maxNumSeqs": 16}})
    hashes = {d["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] for d in (one, two)}
    assert len(hashes) == 2
    _, own_image = render({**BASE, "runtime": "vllm", "image": "registry/vllm:mine"})
    assert server(own_image)["image"] == "registry/vllm:mine"


@pytest.mark.parametrize("args", [["--port=1"], ["--served-model-name=x"], ["max-model-len=3"]])
def test_the_passthrough_refuses_loom_s_flags_and_non_flags(args: list[str]) -> None:
    with pytest.raises(ValidationError):
        admitted(InferenceServiceSpec, {**BASE, "runtime": "vllm", "vllm": {"extraArgs": args}})


def test_llm_autoscaling_metrics_read_the_engine_and_front_series() -> None:
    assert {"llm-waiting-requests", "llm-kv-cache-usage", "llm-ttft-p95"} <= set(METRIC_KINDS)
    pods = PodSelector.for_owner("ml", "chat")
    waiting = build_query("llm-waiting-requests", pods)
    assert waiting.scope == "per-pod" and 'vllm:num_requests_waiting{namespace="ml"' in waiting.value
    assert "timestamp(up{" in (waiting.freshness or "")  # the same staleness rule as the server's series
    assert "100 * max by (pod) (vllm:kv_cache_usage_perc{" in build_query("llm-kv-cache-usage", pods).value
    ttft = build_query("llm-ttft-p95", pods, rate_window_seconds=60).value
    assert "histogram_quantile(0.95, sum by (pod, le) (rate(loom_llm_time_to_first_token_seconds_bucket{" in ttft
    assert "[60s]" in ttft and "0 * (up{" in ttft  # an idle pod reads 0, not missing
    spec = InferenceServiceSpec.model_validate(
        {**BASE, "runtime": "vllm", "autoscaling": {"maxReplicas": 3, "metric": "llm-waiting-requests", "target": 4}})
    assert spec.autoscaling is not None and spec.autoscaling.metric == "llm-waiting-requests"


def test_the_front_follows_the_fetch_steps_marker_to_the_model_folder(tmp_path: Path) -> None:
    config = LlmServerConfig(model_name="m", model_dir=str(tmp_path))
    assert resolve_model_folder(config).model_dir == str(tmp_path)
    marker = {"uri": "s3://m/v3", "kind": "s3", "version": "3", "folder": "v-3", "fetched_at": 0.0, "details": {}}
    (tmp_path / MARKER).write_text(json.dumps(marker))
    assert resolve_model_folder(config).model_dir == str(tmp_path / "v-3")


def _rules(schema: dict[str, Any]) -> dict[str, Any]:
    import cel

    return {entry["message"]: cel.compile(entry["rule"]) for entry in schema["x-kubernetes-validations"]}


def test_the_crds_cel_rules_for_runtime_vllm() -> None:
    from loom.operator.api.crd import crd_for
    from loom.operator.api.kinds import INFERENCE_SERVICE

    spec_schema = crd_for(INFERENCE_SERVICE)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = _rules(spec_schema)

    def passes(spec: dict[str, Any]) -> set[str]:
        return {message for message, program in rules.items() if program.execute({"self": spec}) is False}

    assert passes({"runtime": "vllm", "vllm": {}}) == set()
    assert passes({"runtime": "default", "vllm": {}}) == {"vllm options need runtime: vllm"}
    assert passes({"runtime": "default", "autoscaling": {"metric": "llm-kv-cache-usage"}}) == {
        "llm-* autoscaling metrics need runtime: vllm"}
    assert passes({"runtime": "vllm", "autoscaling": {"metric": "llm-kv-cache-usage"}}) == set()
    assert passes({"runtime": "vllm", "features": {}}) == {"runtime vllm takes no feature enrichment"}
    vllm_rules = _rules(spec_schema["properties"]["vllm"])
    failing = {m for m, p in vllm_rules.items() if p.execute({"self": {"extraArgs": ["--port=9", "x"]}}) is False}
    assert len(failing) == 2
    ok = {"self": {"extraArgs": ["--swap-space=4", "--disable-log-stats", "--hostname-x"]}}
    assert all(p.execute(ok) for p in vllm_rules.values())
    # A spec.vllm without extraArgs (the API server fills no default for it): every rule holds, none errors.
    assert all(p.execute({"self": {"maxModelLen": 256}}) is True for p in vllm_rules.values())
