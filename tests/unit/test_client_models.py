"""loom.client's builders and validation: typed objects from the API's models, refused here with the API server's
own rules (pydantic types and ranges, the CRDs' CEL rules, the kinds' name rules), and every CRD field has an SDK
counterpart: a field of a model that loom.client exports."""

from __future__ import annotations

import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

import loom.client as sdk
from loom.client import (
    CheckpointSpec,
    Entrypoint,
    InvalidObject,
    TrainingJobSpec,
    Workers,
    from_function,
    load,
    parse,
    training_job,
    validate,
)

REPO = Path(__file__).resolve().parents[2]
# The examples of Loom objects (the Kueue queue setup holds none: tests/unit/test_examples.py).
EXAMPLES = sorted(
    p
    for p in (REPO / "examples").glob("*.yaml")
    if any(str(d.get("apiVersion", "")).startswith("loom.dev/") for d in yaml.safe_load_all(p.read_text()) if d)
)


def chargpt_spec(**changes: Any) -> TrainingJobSpec:
    fields: dict[str, Any] = {
        "engine": "fsdp",
        "entrypoint": Entrypoint(module="loom.workloads.trainer.examples.chargpt:task"),
        "max_steps": 120,
        "workers": Workers(replicas=2, min_replicas=1),
        "checkpoint": CheckpointSpec(uri="s3://loom-checkpoints/chargpt", every_steps=20),
    }
    return TrainingJobSpec(**{**fields, **changes})


def test_a_built_job_is_the_manifest_kubectl_would_apply() -> None:
    job = training_job("chargpt", chargpt_spec(), namespace="team-a", labels={"team": "a"})
    wire = job.to_wire()
    assert wire["apiVersion"] == "loom.dev/v1alpha1" and wire["kind"] == "TrainingJob"
    assert wire["metadata"] == {"name": "chargpt", "namespace": "team-a", "labels": {"team": "a"}}
    assert wire["spec"]["workers"] == {"replicas": 2, "minReplicas": 1, "gpusPerWorker": 0}
    assert wire["spec"]["checkpoint"]["uri"] == "s3://loom-checkpoints/chargpt"
    assert wire["spec"]["checkpoint"]["everySteps"] == 20
    assert validate(job) is job


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads_typed_and_validates(path: Path) -> None:
    objects = load(path)
    raw = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert [o.kind for o in objects] == [d["kind"] for d in raw]
    for obj in objects:
        validate(obj)


def test_a_field_out_of_range_is_refused_with_its_path() -> None:
    with pytest.raises(Exception) as caught:
        Workers(replicas=0)
    assert "replicas" in str(caught.value) and "greater than or equal to 1" in str(caught.value)


def test_yaml_with_wrong_fields_is_refused_with_every_path() -> None:
    text = """
apiVersion: loom.dev/v1alpha1
kind: TrainingJob
metadata: {name: gpt}
spec:
  engine: jax
  entrypoint: {module: "pkg.mod:task"}
  workers: {replicas: 2, gpuPerWorker: 1}
"""
    with pytest.raises(InvalidObject) as caught:
        parse(text)
    problems = "\n".join(caught.value.problems)
    assert "spec.engine" in problems
    assert "spec.workers.gpuPerWorker: Extra inputs are not permitted" in problems


def test_the_crds_cel_rules_are_checked_before_the_cluster() -> None:
    job = training_job("gpt", chargpt_spec(workers=Workers(replicas=2, min_replicas=3)))
    job.spec.entrypoint = Entrypoint(module="a.b:c", command=["python", "x.py"])
    with pytest.raises(InvalidObject) as caught:
        validate(job)
    assert caught.value.problems == [
        "spec.entrypoint: set exactly one of module or command",
        "spec.workers.minReplicas: minReplicas must be <= replicas",
    ]


def test_a_name_loom_cannot_name_children_after_is_refused_with_the_kinds_reason() -> None:
    job = training_job("x" * 55, chargpt_spec())
    with pytest.raises(InvalidObject) as caught:
        validate(job)
    [problem] = caught.value.problems
    assert problem.startswith("metadata.name: metadata.name must be a DNS-1035 label")
    assert "at most 54 characters" in problem
    assert "<name>-worker-<index>" in problem


def test_graph_rules_are_checked_inside_maps_and_lists() -> None:
    [graph] = load(REPO / "examples" / "inferencegraph-ab-splitter.yaml")
    assert isinstance(graph, sdk.InferenceGraph)
    graph.spec.nodes["root"].steps[0].weight = None
    # The other step takes the whole traffic: the weights still sum to 100, so only the three rules below break.
    graph.spec.nodes["root"].steps[1].weight = 100
    graph.spec.nodes["root"].steps[1].node_name = "other"
    with pytest.raises(InvalidObject) as caught:
        validate(graph)
    assert caught.value.problems == [
        "spec.nodes: every step's nodeName must name a node of this graph",
        "spec.nodes[root]: every Splitter step needs a weight",
        "spec.nodes[root].steps[1]: set exactly one of serviceName or nodeName",
    ]


def test_objects_of_other_kinds_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="not a Loom object"):
        parse("apiVersion: v1\nkind: Secret\nmetadata: {name: s}\n")


def task_factory() -> None:
    """A top-level function: what from_function accepts."""


def test_from_function_names_a_top_level_function_and_passes_its_args() -> None:
    job = from_function(task_factory, "quick", args={"nLayer": 2, "data": "s3://b/k"}, max_steps=10)
    module = task_factory.__module__
    assert job.spec.entrypoint.module == f"{module}:task_factory"
    assert job.spec.entrypoint.args == ["nLayer=2", 'data="s3://b/k"']
    assert job.spec.max_steps == 10


def test_from_function_refuses_what_workers_could_not_import() -> None:
    def local() -> None: ...

    with pytest.raises(ValueError, match="not a top-level function"):
        from_function(local, "x")
    with pytest.raises(ValueError, match="not a top-level function"):
        from_function(lambda: None, "x")
    main = types.FunctionType(task_factory.__code__, {"__name__": "__main__"}, "notebook_task")
    main.__module__ = "__main__"
    main.__qualname__ = "notebook_task"
    with pytest.raises(ValueError, match="defined in __main__"):
        from_function(main, "x")


# ------------------------------------------------------------------------------------------- CRD coverage


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through Optional, list, dict, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def _field_by_wire_name(model: type[BaseModel], wire: str) -> Any:
    for name, info in model.model_fields.items():
        if (info.alias or name) == wire or name == wire:
            return info
    return None


def _walk(model: type[BaseModel], schema: dict[str, Any], path: str, missing: list[str]) -> int:
    count = 0
    if getattr(sdk, model.__name__, None) is not model:
        missing.append(f"{path}: model {model.__name__} is not exported by loom.client")
    for wire, sub in (schema.get("properties") or {}).items():
        count += 1
        info = _field_by_wire_name(model, wire)
        if info is None:
            missing.append(f"{path}.{wire}: no field of {model.__name__}")
            continue
        node = sub.get("items") if sub.get("type") == "array" else sub
        if isinstance(sub.get("additionalProperties"), dict):
            node = sub["additionalProperties"]
        if node and node.get("properties"):
            models = _models_in(info.annotation)
            if not models:
                missing.append(f"{path}.{wire}: the CRD has sub-fields, the SDK's type {info.annotation} none")
                continue
            count += _walk(models[0], node, f"{path}.{wire}", missing)
    return count


@pytest.mark.parametrize("crd_file", sorted((REPO / "crds").glob("loom.dev_*.yaml")), ids=lambda p: p.name)
def test_every_crd_field_has_an_sdk_counterpart(crd_file: Path) -> None:
    crd = yaml.safe_load(crd_file.read_text())
    kind = crd["spec"]["names"]["kind"]
    model = getattr(sdk, kind)
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    missing: list[str] = []
    walked = _walk(model, root, kind, missing)
    assert not missing, "\n".join(missing)
    assert walked > 20  # the walk went deep: spec and status fields, not just the root's five


def test_the_coverage_walk_notices_a_crd_field_the_models_lack() -> None:
    crd = yaml.safe_load((REPO / "crds" / "loom.dev_trainingjobs.yaml").read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    root["properties"]["spec"]["properties"]["workers"]["properties"]["gpuType"] = {"type": "string"}
    missing: list[str] = []
    _walk(sdk.TrainingJob, root, "TrainingJob", missing)
    assert missing == ["TrainingJob.spec.workers.gpuType: no field of Workers"]


def test_the_sdk_imports_without_torch_feast_mlflow_or_kopf() -> None:
    code = (
        "import sys, loom.client, loom.client.cli\n"
        "heavy = {'torch', 'feast', 'mlflow', 'kopf', 'deepspeed', 'numpy', 'openai'}\n"
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"
