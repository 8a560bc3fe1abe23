"""The generated CRDs on a real kube-apiserver: accepted server-side, and bad objects rejected at admission
with the field path and a readable message (OpenAPI types, enums, ranges, patterns and CEL rules)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from loom.e2e.pytest_operator import apply_crds
from loom.operator.api.cel import cel_problems
from loom.operator.api.kinds import KINDS

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def crds_installed(cluster: Any) -> Any:
    apply_crds(cluster)
    return cluster


def apply(cluster: Any, namespace: str, obj: dict[str, Any]) -> Any:
    return cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(obj), check=False)


def tj(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "engine": "fsdp",
        "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task"},
        "workers": {"replicas": 2},
    }
    body.update(spec)
    return {"apiVersion": "loom.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "t1"}, "spec": body}


def test_crds_are_established_and_categorised(crds_installed: Any, namespace: str) -> None:
    assert apply(crds_installed, namespace, tj()).returncode == 0
    listed = crds_installed.kubectl("get", "loom", "-n", namespace, "-o", "name").stdout
    assert "trainingjob.loom.dev/t1" in listed
    by_short_name = crds_installed.kubectl("get", "ltj", "-n", namespace, "-o", "name").stdout
    assert "t1" in by_short_name
    explained = crds_installed.kubectl("explain", "trainingjobs.spec.checkpoint.uri").stdout
    assert "s3://bucket/prefix" in explained


@pytest.mark.parametrize(
    ("obj", "path", "message"),
    [
        (tj(workers={"replicas": 2, "minReplicas": 3}), "spec.workers.minReplicas", "minReplicas must be <= replicas"),
        (tj(engine="horovod"), "spec.engine", "Unsupported value"),
        (tj(checkpoint={"uri": "gs://bucket/x"}), "spec.checkpoint.uri", "should match"),
        (tj(entrypoint={"module": "m:f", "command": ["x"]}), "spec.entrypoint", "exactly one of module or command"),
        (tj(deepspeed={"zeroStage": 2}), "spec.deepspeed", "deepspeed options need engine: deepspeed"),
        (
            {
                "apiVersion": "loom.dev/v1alpha1",
                "kind": "InferenceGraph",
                "metadata": {"name": "g"},
                "spec": {"nodes": {"first": {"routerType": "Sequence", "steps": [{"serviceName": "a"}]}}},
            },
            "spec.nodes",
            "nodes must contain a node named root",
        ),
        (
            {
                "apiVersion": "loom.dev/v1alpha1",
                "kind": "InferenceGraph",
                "metadata": {"name": "g"},
                "spec": {
                    "nodes": {
                        "root": {
                            "routerType": "Splitter",
                            "steps": [{"serviceName": "a", "weight": 70}, {"serviceName": "b", "weight": 20}],
                        }
                    }
                },
            },
            "spec.nodes[root]",
            "Splitter weights must sum to 100",
        ),
        (
            {
                "apiVersion": "loom.dev/v1alpha1",
                "kind": "InferenceService",
                "metadata": {"name": "s"},
                "spec": {
                    "model": {"uri": "s3://m/x"},
                    "replicas": 2,
                    "autoscaling": {"minReplicas": 3, "maxReplicas": 2, "target": 50},
                },
            },
            "spec.autoscaling.minReplicas",
            "minReplicas must be <= maxReplicas",
        ),
        (
            {
                "apiVersion": "loom.dev/v1alpha1",
                "kind": "InferenceService",
                "metadata": {"name": "s"},
                "spec": {
                    "model": {"uri": "s3://m/x"},
                    "autoscaling": {"maxReplicas": 2, "target": 50, "metric": "prometheus"},
                },
            },
            "spec.autoscaling.query",
            "query is required for metric prometheus",
        ),
        (
            {
                "apiVersion": "loom.dev/v1alpha1",
                "kind": "InferenceService",
                "metadata": {"name": "s"},
                "spec": {"model": {"uri": "s3://m/x", "mlflow": "models:/m/1"}},
            },
            "spec.model",
            "set exactly one of uri, mlflow or fromTrainingJob",
        ),
    ],
    ids=[
        "min>replicas",
        "engine-enum",
        "uri-pattern",
        "entrypoint-one-of",
        "engine-options",
        "graph-root",
        "splitter-weights",
        "autoscaling-range",
        "autoscaling-query",
        "model-one-source",
    ],
)
def test_bad_objects_are_rejected_with_field_path(
    crds_installed: Any, namespace: str, obj: dict[str, Any], path: str, message: str
) -> None:
    result = apply(crds_installed, namespace, obj)
    assert result.returncode != 0, "the API server accepted an invalid object"
    assert path in result.stderr, result.stderr
    assert message in result.stderr, result.stderr


def loom(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "loom.dev/v1alpha1", "kind": kind, "metadata": {"name": "x"}, "spec": spec}


# Objects only CEL rules refuse, several rules each: no pydantic validator repeats them, so the SDK and the unit
# tests see them through loom.operator.api.cel alone.
REFUSED_BY_CEL = [
    tj(register={"model": "m"}),
    tj(checkpoint={"uri": "s3://ckpt/x", "exportFormat": "huggingface"},
       finetune={"method": "qlora", "baseModel": {"uri": "s3://m/b", "mlflow": "models:/a/1"}}),
    loom("InferenceService", {
        "model": {"uri": "s3://m/x", "name": "llama"}, "runtime": "vllm", "vllm": {"extraArgs": ["--port=1", "x"]},
        "adapters": [{"name": "pirate", "uri": "s3://a/b"},
                     {"name": "poet", "uri": "s3://a/c", "mlflow": "models:/p/1"},
                     {"name": "pirate", "uri": "s3://a/d"}, {"name": "llama", "uri": "s3://a/e"}],
        "rollout": {"canaryPercent": 10, "analysis": {
            "steps": [{"weight": 50}, {"weight": 50}, {"weight": 20}],
            "checks": [{"name": "a", "metric": "error-rate"}, {"name": "a", "metric": "prometheus", "max": 1}]}},
    }),
    loom("InferenceService", {
        "model": {"uri": "s3://m/x"}, "adapters": [],
        "autoscaling": {"minReplicas": 3, "maxReplicas": 2, "target": 1, "metric": "prometheus", "idleSeconds": 5},
    }),
    loom("InferenceGraph", {
        "nodes": {"root": {"routerType": "Splitter", "steps": [{"serviceName": "a", "weight": 30},
                                                               {"serviceName": "b", "weight": 30}]}},
        "router": {"autoscaling": {"minReplicas": 0, "maxReplicas": 2, "target": 1, "engine": "keda",
                                   "metric": "gpu-utilization"}},
    }),
    loom("FeatureView", {
        "project": "p", "entities": [{"name": "e"}], "features": [{"name": "f", "dtype": "Int64"}],
        "source": {"path": "/d.parquet"},
        "server": {"autoscaling": {"minReplicas": 0, "maxReplicas": 2, "target": 1, "metric": "concurrency"}},
    }),
]  # fmt: skip


def refusals(stderr: str) -> list[str]:
    """`<path>: <message>` for each line of a refusal, the API server's "Invalid value" wording left out."""
    listed = stderr.split("is invalid: ", 1)[-1].strip()
    lines = [line[2:] for line in listed.splitlines() if line.startswith("* ")] or [listed]
    return sorted(re.sub(r': Invalid value: ("[^"]*": )?', ": ", line) for line in lines)


@pytest.mark.parametrize("obj", REFUSED_BY_CEL, ids=lambda o: f"{o['kind']}-{REFUSED_BY_CEL.index(o)}")
def test_the_api_packages_cel_evaluator_refuses_with_the_api_servers_lines(
    crds_installed: Any, namespace: str, obj: dict[str, Any]
) -> None:
    """loom.operator.api.cel (the SDK's validate, the unit tests' `admitted`) is the one place the CRDs' CEL rules
    are checked before admission: it must say what the API server says, messageExpressions included."""
    kind = next(k for k in KINDS if k.kind == obj["kind"])
    wire = kind.model.model_validate(obj).to_wire()  # defaulted, as the API server defaults it before validating
    result = apply(crds_installed, namespace, wire)
    assert result.returncode != 0, "the API server accepted an invalid object"
    assert refusals(result.stderr) == sorted(cel_problems(kind, wire)), result.stderr


def test_engine_is_immutable(crds_installed: Any, namespace: str) -> None:
    assert apply(crds_installed, namespace, tj()).returncode == 0
    changed = tj(engine="deepspeed")
    result = apply(crds_installed, namespace, changed)
    assert result.returncode != 0
    assert "engine is immutable" in result.stderr


def test_unknown_fields_are_refused(crds_installed: Any, namespace: str) -> None:
    result = apply(crds_installed, namespace, tj(workers={"replicas": 1, "gpus": 2}))
    assert result.returncode != 0
    assert "gpus" in result.stderr


def test_every_example_is_accepted(crds_installed: Any, namespace: str) -> None:
    for path in sorted((REPO / "examples").glob("*.yaml")):
        result = crds_installed.kubectl(
            "apply", "--server-side", "--dry-run=server", "-n", namespace, "-f", str(path), check=False
        )
        assert result.returncode == 0, f"{path.name}: {result.stderr}"


def example_spec(kind: str) -> dict[str, Any]:
    """The spec of the first example of `kind` in examples/ (valid as written: test_every_example_is_accepted)."""
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == kind:
                return dict(doc["spec"])
    raise AssertionError(f"no example of {kind}")


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_an_object_name_loom_cannot_name_its_children_after_is_refused(
    crds_installed: Any, namespace: str, kind: Any
) -> None:
    """The CRD's root rule (NameRule) on the real API server: the longest name is accepted, one character more is
    refused with the rule's message; so is a dotted name where Loom names a Service after the object."""

    def dry_run(name: str) -> Any:
        obj = {"apiVersion": "loom.dev/v1alpha1", "kind": kind.kind, "metadata": {"name": name}}
        obj["spec"] = example_spec(kind.kind)
        return crds_installed.kubectl(
            "apply", "--server-side", "--dry-run=server", "-n", namespace, "-f", "-",
            stdin=yaml.safe_dump(obj), check=False,
        )  # fmt: skip

    accepted = dry_run("n" * kind.name_rule.max_length)
    assert accepted.returncode == 0, accepted.stderr
    refused = dry_run("n" * (kind.name_rule.max_length + 1))
    assert refused.returncode != 0 and kind.name_rule.message in refused.stderr, refused.stderr
    dotted = dry_run("drivers.v2")
    assert (dotted.returncode == 0) is kind.name_rule.fits("drivers.v2"), dotted.stderr
