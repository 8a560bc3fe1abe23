"""The registry of Loom's kinds: how each is named and shown in kubectl. CRDs are generated from it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .common import ApiModel, StatusBase
from .featureview import FeatureView, FeatureViewSpec, FeatureViewStatus
from .inferencegraph import InferenceGraph, InferenceGraphSpec, InferenceGraphStatus
from .inferenceservice import InferenceService, InferenceServiceSpec, InferenceServiceStatus
from .trainingjob import TrainingJob, TrainingJobSpec, TrainingJobStatus


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

TRAINING_JOB = Kind(
    kind="TrainingJob",
    plural="trainingjobs",
    singular="trainingjob",
    short_names=("ltj",),
    model=TrainingJob,
    spec=TrainingJobSpec,
    status=TrainingJobStatus,
    columns=(
        PrinterColumn("Engine", ".spec.engine"),
        PHASE,
        PrinterColumn("Ready", ".status.workers.ready", "integer", description="Workers ready"),
        PrinterColumn("Desired", ".status.workers.desired", "integer", description="Workers desired"),
        PrinterColumn("Step", ".status.progress.step", "integer"),
        PrinterColumn("Total", ".status.progress.totalSteps", "integer"),
        PrinterColumn("Restarts", ".status.restarts", "integer"),
        PrinterColumn("Loss", ".status.progress.loss", "number", priority=1),
        PrinterColumn("Checkpoint", ".status.checkpoint.latest", priority=1),
        AGE,
    ),
    # The controller also checks the last worker's hostname against the job's worker count (11 workers or more
    # need a shorter name).
    name_rule=NameRule(
        54, dns_label=True, why="its workers' hostnames are <name>-worker-<index> and their Service <name>-workers"
    ),
)

INFERENCE_SERVICE = Kind(
    kind="InferenceService",
    plural="inferenceservices",
    singular="inferenceservice",
    short_names=("lis",),
    model=InferenceService,
    spec=InferenceServiceSpec,
    status=InferenceServiceStatus,
    columns=(
        PrinterColumn("URL", ".status.url"),
        PHASE,
        PrinterColumn("Ready", ".status.readyReplicas", "integer"),
        PrinterColumn("Replicas", ".status.replicas", "integer"),
        PrinterColumn("Runtime", ".spec.runtime"),
        PrinterColumn("Model", ".spec.model.name", priority=1),
        PrinterColumn("Version", ".status.modelVersion"),
        PrinterColumn("Canary", ".status.canary.percent", "integer"),
        PrinterColumn("Desired", ".status.autoscaling.desiredReplicas", "integer", description="Autoscaler wants"),
        PrinterColumn("Metric", ".status.autoscaling.metricValue", "number", priority=1),
        PrinterColumn("Scaled", ".status.autoscaling.lastScaleReason", priority=1),
        PrinterColumn("OpenAI", ".status.openaiBaseUrl", priority=1),
        AGE,
    ),
    name_rule=NameRule(
        53, dns_label=True, why="its Service is <name> and its scale-to-zero activator's Service <name>-activator"
    ),
    scale=True,
)

INFERENCE_GRAPH = Kind(
    kind="InferenceGraph",
    plural="inferencegraphs",
    singular="inferencegraph",
    short_names=("lig",),
    model=InferenceGraph,
    spec=InferenceGraphSpec,
    status=InferenceGraphStatus,
    columns=(
        PrinterColumn("URL", ".status.url"),
        PHASE,
        PrinterColumn("Ready", ".status.readyReplicas", "integer", description="Router replicas ready"),
        PrinterColumn("Services", ".status.services", description="Referenced InferenceServices ready"),
        PrinterColumn("Desired", ".status.autoscaling.desiredReplicas", "integer", description="Autoscaler wants"),
        PrinterColumn("Metric", ".status.autoscaling.metricValue", "number", priority=1),
        AGE,
    ),
    name_rule=NameRule(63, dns_label=True, why="its router's Service is <name>"),
    # The builtin autoscaler (or `kubectl scale`) writes the router's replicas here, as for an InferenceService.
    scale=True,
    scale_replicas_path=".spec.router.replicas",
)

FEATURE_VIEW = Kind(
    kind="FeatureView",
    plural="featureviews",
    singular="featureview",
    short_names=("lfv",),
    model=FeatureView,
    spec=FeatureViewSpec,
    status=FeatureViewStatus,
    columns=(
        PrinterColumn("Project", ".spec.project"),
        PHASE,
        PrinterColumn("Registered", ".status.registered", "boolean"),
        PrinterColumn("Materialized", ".status.lastMaterialization.end", "date"),
        PrinterColumn("URL", ".status.url", priority=1),
        AGE,
    ),
    name_rule=NameRule(63, dns_label=False, why="every object made for it carries it as a label value"),
)

KINDS: tuple[Kind, ...] = (TRAINING_JOB, INFERENCE_SERVICE, INFERENCE_GRAPH, FEATURE_VIEW)
