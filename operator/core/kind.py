"""What describes a kind to Kubernetes: its names, printer columns, name rule and scale subresource.

Each kind declares its own `Kind` beside its model (kinds/<kind>/api.py); api/kinds.py lists them for the CRD
generator and the operator's start-up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .model import ApiModel, StatusBase


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    json_path: str
    type: str = "string"
    priority: int = 0
    description: str = ""


# A DNS-1035 label (a Service name, a hostname): at most 63 characters of these.
DNS_LABEL_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_LABEL_SHAPE = "lower-case letters, digits and '-', starting with a letter and ending with a letter or digit"


@dataclass(frozen=True)
class NameRule:
    """What a Loom object's own name must be for its children to be valid. Kubernetes accepts object names of up
    to 253 characters with dots, but Loom names Services after its objects (DNS-1035 labels, with suffixes) and
    labels every child with the object's name (label values: at most 63 characters), so a longer name would only
    fail later, on every child, in the operator's log. The CRD refuses it instead (a CEL rule on the root, which
    may read metadata.name) and the controllers report it in status for an object created before that rule.
    The render tests hold each `max_length` against the naming functions."""

    max_length: int
    dns_label: bool
    # What is named after the object, for the message.
    why: str

    @property
    def requirement(self) -> str:
        shape = f"a DNS-1035 label ({DNS_LABEL_SHAPE})" if self.dns_label else "a name"
        return f"{shape} of at most {self.max_length} characters: {self.why}"

    @property
    def message(self) -> str:
        return f"metadata.name must be {self.requirement}"

    @property
    def cel(self) -> str:
        """The same rule as `problem`, for the CRD."""
        rule = f"self.metadata.name.size() <= {self.max_length}"
        if self.dns_label:
            rule += f" && self.metadata.name.matches('{DNS_LABEL_PATTERN}')"
        return rule

    def fits(self, name: str) -> bool:
        return len(name) <= self.max_length and (not self.dns_label or re.match(DNS_LABEL_PATTERN, name) is not None)

    def problem(self, name: str) -> str | None:
        """The rule's message when `name` breaks it; None when it fits."""
        return None if self.fits(name) else self.message


@dataclass(frozen=True)
class Kind:
    kind: str
    plural: str
    singular: str
    # Loom's short names start with "l": KServe owns isvc/ig, Kubeflow owns tj-like names.
    short_names: tuple[str, ...]
    model: type[ApiModel]
    spec: type[ApiModel]
    status: type[StatusBase]
    columns: tuple[PrinterColumn, ...]
    name_rule: NameRule
    scale: bool = False
    # The scale subresource's spec path (a JSON path under .spec; the router's replicas for InferenceGraph).
    scale_replicas_path: str = ".spec.replicas"
    categories: tuple[str, ...] = field(default=("loom",))


AGE = PrinterColumn("Age", ".metadata.creationTimestamp", "date")
PHASE = PrinterColumn("Phase", ".status.phase")
