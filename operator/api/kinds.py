"""The registry of Loom's kinds: how each is named and shown in kubectl. CRDs are generated from it."""

from __future__ import annotations

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
        PrinterColumn("Version", ".status.modelVersion"),
        PrinterColumn("Canary", ".status.canary.percent", "integer"),
        PrinterColumn("Desired", ".status.autoscaling.desiredReplicas", "integer", description="Autoscaler wants"),
        PrinterColumn("Metric", ".status.autoscaling.metricValue", "number", priority=1),
        PrinterColumn("Scaled", ".status.autoscaling.lastScaleReason", priority=1),
        AGE,
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
)

KINDS: tuple[Kind, ...] = (TRAINING_JOB, INFERENCE_SERVICE, INFERENCE_GRAPH, FEATURE_VIEW)
