"""Admission: what the CRDs' CEL rules cannot check, checked by a validating webhook the operator serves.

CEL sees one object at a time and cannot compile CEL, so these live here, as pure functions over the wire form
(camelCase dicts, already checked against the CRD schema and its CEL rules when the webhook is called), each
returning `Violation`s (field path, readable message):

- `graph`: what the InferenceGraph controller would report as GraphValid=False (the same function): nodes that
  call each other in a cycle, step conditions that do not compile, the router's structural rules (Splitter
  weights, unique Ensemble step names, ...).
- `immutability`: TrainingJob fields that cannot change once the job has started.
- `references`: InferenceGraph steps naming InferenceServices, an InferenceService naming a TrainingJob or a
  FeatureView, that do not exist. Warned about by default, rejected on request (GitOps: see that module).

`handlers` wires them into Kopf's admission support (`@kopf.on.validate`); `server` configures Kopf's TLS webhook
server from the certificate the chart mounts. The chart's ValidatingWebhookConfiguration (templates/webhook.yaml)
sends only CREATE and UPDATE of loom.dev kinds here, so a down operator never affects any other write, and its
failurePolicy (Ignore by default) decides what happens to Loom writes meanwhile (charts/loom/README.md).
"""

from __future__ import annotations

from typing import NamedTuple


class Violation(NamedTuple):
    """One problem: where (a field path such as `spec.nodes[root].steps[0].nodeName`) and what, readably."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def step_path(node: str, index: int, field: str) -> str:
    """The field path of one step field of an InferenceGraph node (map keys in brackets, as the API server
    writes them)."""
    return f"spec.nodes[{node}].steps[{index}].{field}"
