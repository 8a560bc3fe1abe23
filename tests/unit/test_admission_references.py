"""References to missing objects (warned or rejected) and the handler's verdict for one write."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from loom.operator.admission import Violation, handlers
from loom.operator.admission.graph import graph_violations
from loom.operator.admission.references import (
    Reference,
    changed,
    graph_references,
    missing_violations,
    service_references,
)

GRAPH = {
    "nodes": {
        "root": {"routerType": "Sequence", "steps": [{"serviceName": "pre"}, {"nodeName": "pick"}]},
        "pick": {"routerType": "Switch", "steps": [{"serviceName": "big", "condition": "true"}]},
    }
}


def test_references_are_found_with_their_field_paths() -> None:
    assert graph_references(GRAPH) == [
        Reference("spec.nodes[root].steps[0].serviceName", "InferenceService", "pre"),
        Reference("spec.nodes[pick].steps[0].serviceName", "InferenceService", "big"),
    ]
    spec = {"model": {"fromTrainingJob": {"name": "gpt"}}, "features": {"featureView": "drivers"}}
    assert service_references(spec) == [
        Reference("spec.model.fromTrainingJob.name", "TrainingJob", "gpt"),
        Reference("spec.features.featureView", "FeatureView", "drivers"),
    ]
    assert service_references({"model": {"uri": "s3://b/m"}}) == []


def test_only_references_a_write_adds_or_changes_are_judged() -> None:
    before = graph_references(GRAPH)
    after = [*before[:1], Reference("spec.nodes[pick].steps[0].serviceName", "InferenceService", "bigger")]
    assert changed(after, before) == [after[1]]
    assert changed(before, []) == before


def test_missing_ones_name_kind_name_and_namespace() -> None:
    refs = graph_references(GRAPH)
    assert missing_violations(refs[1:], "team") == [
        Violation("spec.nodes[pick].steps[0].serviceName", "InferenceService 'big' not found in namespace 'team'")
    ]


def test_warn_admits_with_a_warning_and_reject_refuses() -> None:
    error, missing = Violation("spec.a", "bad"), Violation("spec.b", "InferenceService 'x' not found")
    assert handlers.verdict([error], [missing], "Warn") == ([error], ["spec.b: InferenceService 'x' not found"])
    assert handlers.verdict([error], [missing], "Reject") == ([error, missing], [])


def run_judge(
    monkeypatch: pytest.MonkeyPatch,
    *,
    new: dict[str, Any],
    old: dict[str, Any] | None = None,
    existing: set[str] = frozenset(),  # type: ignore[assignment]
    policy: Any = "Warn",
) -> tuple[list[str], list[str]]:
    """(warnings, lookups made); raises kopf.AdmissionError like the handler."""
    looked: list[str] = []

    async def get(api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        looked.append(f"{kind}/{name}")
        return {"metadata": {"name": name}} if name in existing else None

    monkeypatch.setattr(handlers.kube, "get", get)
    warnings: list[str] = []
    asyncio.run(
        handlers.judge(
            operation="UPDATE" if old else "CREATE",
            old=old,
            new=new,
            namespace="team",
            errors=lambda o, n: graph_violations(n.get("spec") or {}),
            references=graph_references,
            policy=policy,
            warnings=warnings,
        )
    )
    return warnings, looked


def test_a_missing_service_is_a_warning_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    warnings, looked = run_judge(monkeypatch, new={"spec": GRAPH}, existing={"pre"})
    assert warnings == ["spec.nodes[pick].steps[0].serviceName: InferenceService 'big' not found in namespace 'team'"]
    assert sorted(looked) == ["InferenceService/big", "InferenceService/pre"]


def test_a_missing_service_is_refused_with_reject(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = r"spec\.nodes\[pick\]\.steps\[0\]\.serviceName: InferenceService 'big'"
    with pytest.raises(kopf.AdmissionError, match=expected):
        run_judge(monkeypatch, new={"spec": GRAPH}, existing={"pre"}, policy="Reject")


def test_a_cycle_is_refused_with_every_violation_in_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    cyclic = {"nodes": {"root": {"routerType": "Sequence", "steps": [{"nodeName": "root", "condition": "(("}]}}}
    with pytest.raises(kopf.AdmissionError) as caught:
        run_judge(monkeypatch, new={"spec": cyclic})
    message = str(caught.value)
    assert "spec.nodes[root].steps[0].nodeName: nodes form a cycle: root -> root" in message
    assert "spec.nodes[root].steps[0].condition: does not compile" in message
    assert caught.value.code == 422


def test_an_update_leaving_spec_alone_is_always_admitted(monkeypatch: pytest.MonkeyPatch) -> None:
    """E.g. removing a finalizer from a graph that was admitted while the webhook was down."""
    cyclic = {"nodes": {"root": {"routerType": "Sequence", "steps": [{"nodeName": "root"}]}}}
    body = {"metadata": {"finalizers": []}, "spec": cyclic}
    warnings, looked = run_judge(monkeypatch, new=body, old={"metadata": {"finalizers": ["x"]}, "spec": cyclic})
    assert warnings == [] and looked == []


def test_unchanged_references_are_not_looked_up_again(monkeypatch: pytest.MonkeyPatch) -> None:
    new = {"spec": {**GRAPH, "router": {"replicas": 2}}}
    warnings, looked = run_judge(monkeypatch, new=new, old={"spec": GRAPH}, policy="Reject")
    assert warnings == [] and looked == []


def test_a_failed_lookup_is_a_warning_never_a_rejection(monkeypatch: pytest.MonkeyPatch) -> None:
    async def get(*_: Any) -> None:
        raise TimeoutError("API server slow")

    monkeypatch.setattr(handlers.kube, "get", get)
    warnings: list[str] = []
    asyncio.run(
        handlers.judge(
            operation="CREATE", old=None, new={"spec": GRAPH}, namespace="team", errors=lambda o, n: [],
            references=graph_references, policy="Reject", warnings=warnings,
        )
    )  # fmt: skip
    assert warnings and all(w.startswith("could not check InferenceService") for w in warnings)
