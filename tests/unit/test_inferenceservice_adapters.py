"""spec.adapters on the operator's side: the API's rules, the rendered adapter list (beside llm.json, outside the
pod template's hash, so a new list restarts nothing), a TrainingJob's adapter resolved, and status from what the
replicas report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from loom.operator.api.cel import admitted
from loom.operator.kinds.inferenceservice.api import InferenceServiceSpec
from loom.operator.kinds.inferenceservice.llm.adapters import (
    adapter_status,
    name_problem,
    resolve_adapters,
    settled,
)
from loom.operator.kinds.inferenceservice.render import CONFIG_HASH_ANNOTATION, render_deployment
from loom.operator.kinds.inferenceservice.source.model import resolve_model
from loom.workloads.llm.adapters import AdapterList
from loom.workloads.llm.config import LlmServerConfig
from loom.workloads.llm.engine import engine_argv, engine_environment

OWNER = {"apiVersion": "loom.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "chat", "namespace": "ml", "uid": "u"}}
BASE: dict[str, Any] = {"model": {"uri": "s3://models/llama/v1", "endpoint": "http://s3:9000", "name": "llama"},
                        "runtime": "vllm"}
TWO = [{"name": "pirate", "uri": "s3://adapters/pirate"}, {"name": "poet", "mlflow": "models:/poet/3"}]


def spec_of(**extra: Any) -> InferenceServiceSpec:
    return admitted(InferenceServiceSpec, {**BASE, **extra})


def render(spec: InferenceServiceSpec, jobs: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    resolved = resolve_adapters(spec, jobs or {}, "http://mlflow:5000")
    result: tuple[dict[str, Any], dict[str, Any]] = render_deployment(
        OWNER, spec, "stable", resolve_model(spec.model, spec.serving_handler), 1, "server:t", vllm_image="vllm:t",
        adapters=resolved.to_list())
    return result


# ------------------------------------------------------------------------------------------- validation


def test_adapter_names_must_be_unique_and_differ_from_the_base_model() -> None:
    with pytest.raises(ValidationError, match="unique: pirate"):
        spec_of(adapters=[TWO[0], {**TWO[0], "uri": "s3://adapters/other"}])
    with pytest.raises(ValidationError, match="base model's name"):
        spec_of(adapters=[{"name": "llama", "uri": "s3://a/b"}])
    # The base model's default name is the object's: only the operator can see that clash.
    spec = InferenceServiceSpec.model_validate({"model": {"uri": "s3://m/x"}, "runtime": "vllm",
                                                "adapters": [{"name": "chat", "uri": "s3://a/b"}]})
    assert "base model's name" in (name_problem(OWNER, spec) or "")
    assert name_problem(OWNER, spec_of(adapters=TWO)) is None


def test_an_adapter_has_exactly_one_source_and_needs_runtime_vllm() -> None:
    with pytest.raises(ValidationError, match="exactly one of uri, mlflow or fromTrainingJob"):
        spec_of(adapters=[{"name": "a", "uri": "s3://a/b", "mlflow": "models:/a/1"}])
    with pytest.raises(ValidationError, match="exactly one"):
        spec_of(adapters=[{"name": "a"}])
    with pytest.raises(ValidationError, match="adapters need runtime: vllm"):
        admitted(InferenceServiceSpec, {"model": {"uri": "s3://m/x"}, "handler": "noop", "adapters": TWO})
    with pytest.raises(ValidationError):
        spec_of(adapters=[{"name": "bad name", "uri": "s3://a/b"}])
    with pytest.raises(ValidationError):
        spec_of(vllm={"maxAdapterRank": 12})  # vLLM's ranks only


def test_the_crd_carries_the_same_rules() -> None:
    crd = yaml.safe_load((Path(__file__).parents[2] / "crds" / "loom.dev_inferenceservices.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = " ".join(r["message"] for r in schema["x-kubernetes-validations"])
    assert "adapter names must be unique" in rules and "base model's name" in rules
    assert "adapters need runtime: vllm" in rules
    adapter = schema["properties"]["adapters"]["items"]
    assert "set exactly one of uri, mlflow or fromTrainingJob" in adapter["x-kubernetes-validations"][0]["message"]


# ------------------------------------------------------------------------------------------- rendering


def test_the_adapter_list_is_its_own_file_and_lora_is_on() -> None:
    config_map, _ = render(spec_of(adapters=TWO, vllm={"maxLoadedAdapters": 4, "maxAdapterRank": 32}))
    llm = LlmServerConfig.model_validate_json(config_map["data"]["llm.json"])
    assert llm.adapters_file == "/etc/loom/adapters.json" and llm.adapters_dir == "/models/adapters"
    argv = engine_argv(llm)
    assert "--enable-lora" in argv and "--max-loras=4" in argv and "--max-lora-rank=32" in argv
    assert engine_environment(llm, {})["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    listed = AdapterList.model_validate_json(config_map["data"]["adapters.json"]).adapters
    assert [(a.name, a.kind, a.uri) for a in listed] == [
        ("pirate", "s3", "s3://adapters/pirate"), ("poet", "mlflow", "models:/poet/3")]
    assert listed[1].tracking_uri == "http://mlflow:5000"  # the default tracking URL travels with the adapter
    assert "AWS_SECRET" not in json.dumps(config_map["data"])


def test_a_changed_adapter_list_changes_no_pod_template() -> None:
    one_map, one = render(spec_of(adapters=TWO[:1]))
    two_map, two = render(spec_of(adapters=TWO))
    none_map, none = render(spec_of(adapters=[]))
    assert one_map["data"]["adapters.json"] != two_map["data"]["adapters.json"]
    assert one["spec"]["template"] == two["spec"]["template"] == none["spec"]["template"]
    assert json.loads(none_map["data"]["adapters.json"]) == {"adapters": []}
    # No adapters field at all: LoRA is off, no list; turning it on is a new template (the engine restarts).
    off_map, off = render(spec_of())
    assert "adapters.json" not in off_map["data"]
    assert "--enable-lora" not in engine_argv(LlmServerConfig.model_validate_json(off_map["data"]["llm.json"]))
    hash_of = CONFIG_HASH_ANNOTATION
    assert off["spec"]["template"]["metadata"]["annotations"][hash_of] != \
        none["spec"]["template"]["metadata"]["annotations"][hash_of]


# ------------------------------------------------------------------------------------------- TrainingJob adapters


def job(phase: str, uid: str = "1234567890", step: int = 30) -> dict[str, Any]:
    return {"metadata": {"name": "tune", "uid": uid},
            "spec": {"checkpoint": {"uri": "s3://ckpt/tune"}},
            "status": {"phase": phase, "checkpoint": {"step": step}}}


def test_a_training_jobs_adapter_is_its_peft_export_once_it_succeeded() -> None:
    spec = spec_of(adapters=[{"name": "tuned", "fromTrainingJob": {"name": "tune"}}])
    waiting = resolve_adapters(spec, {"tune": job("Running")}, None)
    assert waiting.sources == [] and "waiting for its adapter export" in waiting.pending["tuned"]
    assert "does not exist" in resolve_adapters(spec, {"tune": None}, None).pending["tuned"]
    assert "failed" in resolve_adapters(spec, {"tune": job("Failed")}, None).pending["tuned"]
    done = resolve_adapters(spec, {"tune": job("Succeeded")}, None).sources
    assert [(a.uri, a.version) for a in done] == [("s3://ckpt/tune/final", "final-step-30-12345678")]
    # The job finishing again (re-created: a new uid) is a new version: the replicas load it in place.
    again = resolve_adapters(spec, {"tune": job("Succeeded", uid="abcdefabcdef")}, None).sources
    assert again[0].engine_name != done[0].engine_name and again[0].name == done[0].name


def test_an_mlflow_adapter_without_a_tracking_url_waits_with_the_reason() -> None:
    resolved = resolve_adapters(spec_of(adapters=TWO), {}, None)
    assert [a.name for a in resolved.sources] == ["pirate"]
    assert "tracking URL" in resolved.pending["poet"]


# ------------------------------------------------------------------------------------------- status


def test_status_shows_each_adapter_per_replica_and_a_failure_with_its_reason() -> None:
    resolved = resolve_adapters(spec_of(adapters=[*TWO, {"name": "tuned", "fromTrainingJob": {"name": "tune"}}]),
                                {"tune": job("Running")}, "http://mlflow:5000")
    pirate, poet = resolved.sources
    reports: dict[str, dict[str, Any] | str] = {
        "chat-a": {"adapters": [{"name": "pirate", "key": pirate.key, "state": "Loaded"},
                                {"name": "poet", "key": poet.key, "state": "Failed", "reason": "no adapter_config"}]},
        "chat-b": {"adapters": [{"name": "pirate", "key": pirate.key, "state": "Loaded"},
                                {"name": "poet", "key": "older", "state": "Loaded"}]},
        "chat-c": "its adapter states could not be read: ConnectError",
    }
    states = {s.name: s for s in adapter_status(resolved, reports)}
    assert states["pirate"].state == "Loading"  # chat-c has not said
    assert [(r.pod, r.state) for r in states["pirate"].replicas] == [
        ("chat-a", "Loaded"), ("chat-b", "Loaded"), ("chat-c", "Pending")]
    assert states["poet"].state == "Failed" and states["poet"].reason == "chat-a: no adapter_config"
    assert states["poet"].replicas[1].state == "Pending"  # chat-b still runs the previous list
    assert states["tuned"].state == "Pending" and "waiting" in (states["tuned"].reason or "")
    assert not settled(list(states.values()))  # chat-b has not read the new list
    loaded = {"chat-a": {"adapters": [{"name": "pirate", "key": pirate.key, "state": "Loaded"},
                                      {"name": "poet", "key": poet.key, "state": "Failed", "reason": "x"}]}}
    assert settled(adapter_status(resolved, loaded))  # a failure and a job still running: nothing to poll for
    loading = {"chat-a": {"adapters": [{"name": "pirate", "key": pirate.key, "state": "Loading"}]}}
    assert not settled(adapter_status(resolved, loading))
    assert settled(adapter_status(resolved, {}))  # no ready replica (starting, or at zero): events bring the pass


def test_a_service_without_adapters_renders_the_config_it_rendered_before_adapters_existed() -> None:
    """No key of the adapters' in llm.json: an operator upgrade does not restart every vllm service."""
    config_map, _ = render(spec_of())
    llm = json.loads(config_map["data"]["llm.json"])
    assert not {"adaptersFile", "adaptersDir", "adaptersPollS"} & set(llm)
    assert not {"enableLora", "maxLoras", "maxLoraRank"} & set(llm["engine"])
