"""The spec fuzzer's pure parts (loom.e2e.chaos.specs), and what it found: the CRD patterns mean the same to
kube-apiserver (Go RE2) as to the pydantic models."""

from __future__ import annotations

import random
import re
from collections import Counter
from typing import Any

import pytest
from pydantic import ValidationError

from loom.devstack.cluster.nodes import KWOK_TOLERATION
from loom.e2e.chaos.specs import Case, cases, k8s_path, kind_named, mutate, spec_schema, tame
from loom.operator.api.cel import admitted
from loom.operator.api.kinds import KINDS

KIND_NAMES = [k.kind for k in KINDS]


def patterns(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        return found + [p for value in node.values() for p in patterns(value)]
    if isinstance(node, list):
        return [p for value in node for p in patterns(value)]
    return []


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_crd_patterns_use_no_class_whose_meaning_differs_between_go_and_python(kind: str) -> None:
    # Go's \w, \d, \s and \b are ASCII; Python's (and pydantic's) are Unicode: "QŢČ:zT" passed the model and was
    # refused at admission. Spelled-out classes mean the same on both sides.
    for pattern in patterns(spec_schema(kind_named(kind))):
        assert not re.search(r"\\[wWdDsSbB]", pattern), pattern


def test_a_unicode_entrypoint_is_refused_by_the_model_as_by_admission() -> None:
    model = kind_named("TrainingJob").spec
    with pytest.raises(ValidationError):
        model.model_validate({"engine": "fsdp", "entrypoint": {"module": "QŢČ:zT"}})
    assert model.model_validate({"engine": "fsdp", "entrypoint": {"module": "pkg.mod_1:task"}})


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_valid_cases_satisfy_the_model_and_mutations_are_labelled(kind: str) -> None:
    drawn = cases(kind, 60, seed=3)
    assert len(drawn) == 60
    assert len({repr(c.spec) + c.label() for c in drawn}) == 60
    labels = Counter(c.label() for c in drawn)
    assert labels["valid"] >= 10 and sum(labels.values()) - labels["valid"] >= 30
    spec_model = kind_named(kind).spec
    for case in drawn:
        if case.mutation is None:
            admitted(spec_model, case.spec)  # the schema-driven draw plus the CEL repairs: a valid spec


def test_cases_are_deterministic_per_seed() -> None:
    first, again = cases("InferenceGraph", 20, seed=1), cases("InferenceGraph", 20, seed=1)
    assert [c.spec for c in first] == [c.spec for c in again]


def test_a_schema_breaking_mutation_is_refused_by_the_model_too() -> None:
    schema = spec_schema(kind_named("InferenceService"))
    spec = {"model": {"uri": "s3://m/x"}, "replicas": 2}
    rnd = random.Random(7)
    seen = set()
    for _ in range(40):
        mutated, mutation = mutate(spec, schema, rnd)
        seen.add(mutation.name)
        if mutation.schema_breaking:
            with pytest.raises(ValidationError):
                kind_named("InferenceService").spec.model_validate(mutated)
    assert {"wrong-type", "unknown-field", "out-of-range"} <= seen


def test_k8s_paths_are_written_as_the_api_server_writes_them() -> None:
    assert k8s_path(("workers", "tolerations", 0, "key")) == "spec.workers.tolerations[0].key"
    assert k8s_path(()) == "spec"


def test_tame_keeps_pods_on_kwok_and_replicas_small() -> None:
    case = Case("TrainingJob", {"engine": "fsdp", "workers": {"replicas": 900, "minReplicas": 3}}, None)
    workers = tame(case, KWOK_TOLERATION)["workers"]
    assert workers["replicas"] == 2 and workers["minReplicas"] == 2
    assert workers["nodeSelector"] == {"type": "kwok"} and workers["tolerations"] == [KWOK_TOLERATION]
    service = tame(Case("InferenceService", {"replicas": 7, "autoscaling": {"maxReplicas": 9, "minReplicas": 4}}, None),
                   KWOK_TOLERATION)
    assert service["replicas"] == 2 and service["autoscaling"] == {"maxReplicas": 2, "minReplicas": 2}


def test_a_drawn_disaggregated_service_is_repaired_into_one_admission_takes_and_tamed_per_pool() -> None:
    from loom.e2e.chaos.specs import REPAIRS

    split = {"kvStorage": {"claimName": "kv"}, "prefill": {"replicas": 40}, "decode": {"replicas": 9}}
    spec: dict[str, Any] = {
        "runtime": "vllm", "model": {"uri": "s3://m/x"}, "replicas": 3,
        "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "target": 4}, "rollout": {"canaryPercent": 10},
        "adapters": [{"name": "a", "uri": "s3://b/a"}], "routing": {"inferencePool": {}},
        "vllm": {"disaggregation": split, "parallelism": {"tensor": 2},
                 "extraArgs": ["--kv-transfer-config={}", "--enable-chunked-prefill", "--max-num-batched-tokens=64"]},
    }  # fmt: skip
    with pytest.raises(ValidationError):
        admitted(kind_named("InferenceService").spec, spec)
    REPAIRS["InferenceService"](spec, random.Random(0))
    admitted(kind_named("InferenceService").spec, spec)
    assert spec["vllm"]["extraArgs"] == ["--max-num-batched-tokens=64"]
    tamed = tame(Case("InferenceService", spec, None), KWOK_TOLERATION)["vllm"]["disaggregation"]
    assert (tamed["prefill"]["replicas"], tamed["decode"]["replicas"]) == (2, 2)


def test_a_valid_object_refused_only_by_cel_rules_is_no_problem_but_a_schema_refusal_is() -> None:
    from loom.e2e.chaos.admission import Outcome, problem, refused_by_cel

    valid = Case("InferenceService", {"model": {"uri": "s3://m/x"}}, None)
    cel = 'InferenceService.loom.dev "s" is invalid: [spec.model: Invalid value: "object": set exactly one of uri, ' \
          'mlflow or fromTrainingJob, spec.autoscaling.minReplicas: Invalid value: "object": minReplicas must be <= ' \
          "maxReplicas]"
    schema = 'TrainingJob.loom.dev "t" is invalid: spec.entrypoint.module: Invalid value: "QŢČ:zT": ' \
             "spec.entrypoint.module in body should match '^[A-Za-z_]'"
    by_cel = Outcome(valid, "s", False, 422, cel)
    assert refused_by_cel(by_cel) and problem(by_cel) is None
    by_schema = Outcome(Case("TrainingJob", {}, None), "t", False, 422, schema)
    assert not refused_by_cel(by_schema)
    assert "refused a valid object" in (problem(by_schema) or "")
    mixed = Outcome(valid, "s", False, 422, cel[:-1] + ", spec.replicas: Invalid value: 5000: must be <= 1000]")
    assert not refused_by_cel(mixed)
