"""Cluster-wide endpoint defaults (the chart's `defaults.*` values, operator settings `LOOM_DEFAULT_*`) applied to
the fields an object leaves unset, as KServe's storage defaults and Kubeflow's platform config do.

Pure: the defaults come in as an argument and the spec goes out with them filled in, together with what was used
(status.endpointDefaults shows it) and what neither the object nor the operator names (Ready=False,
EndpointNotConfigured). Defaults only ever fill a gap: a field the object sets is kept, and with no defaults
configured the spec comes back unchanged, so existing objects render byte-identical children (no rollout on an
upgrade that only adds defaults). The credentials default is a Secret *name* in the object's namespace, injected
into pods by reference; the operator never reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .core.model import S3Credentials
from .kinds.featureview.api import FeatureViewSpec
from .kinds.inferenceservice.api import InferenceServiceSpec
from .kinds.inferenceservice.source.model import ResolveError
from .kinds.trainingjob.api import TrainingJobSpec

if TYPE_CHECKING:
    from .settings import OperatorSettings

REASON = "EndpointNotConfigured"
# The chart value that sets the MLflow default, named where one is missing (README "Install on a real cluster",
# charts/loom/values.yaml).
MLFLOW_VALUE = "defaults.mlflow.trackingUri"

S = TypeVar("S")


@dataclass(frozen=True)
class EndpointDefaults:
    """The operator's defaults; None: no default (the field keeps its own meaning, e.g. AWS for no S3 endpoint)."""

    s3_endpoint: str | None = None
    s3_secret_name: str | None = None
    mlflow_tracking_uri: str | None = None

    @classmethod
    def from_settings(cls, settings: OperatorSettings) -> EndpointDefaults:
        return cls(
            s3_endpoint=settings.default_s3_endpoint,
            s3_secret_name=settings.default_s3_secret_name,
            mlflow_tracking_uri=settings.default_mlflow_tracking_uri,
        )


@dataclass(frozen=True)
class Missing:
    """A field that needs a value the object does not give and the operator has no default for."""

    path: str  # e.g. spec.tracking.mlflow.trackingUri
    value: str  # the chart value that would give it one

    def message(self) -> str:
        return f"{self.path} is not set and the operator has no default: set it, or the chart value {self.value}"


@dataclass
class Defaulted(Generic[S]):
    spec: S
    used: dict[str, str] = field(default_factory=dict)  # field path -> default applied (never a secret value)
    missing: list[Missing] = field(default_factory=list)

    def status_field(self) -> dict[str, str] | None:
        return dict(self.used) or None

    def problem(self) -> str | None:
        """One sentence for a condition message naming every missing field; None when nothing is missing."""
        return "; ".join(m.message() for m in self.missing) or None


def _s3(
    path: str, endpoint: str | None, secret: S3Credentials | None, d: EndpointDefaults, used: dict[str, str]
) -> tuple[str | None, S3Credentials | None]:
    """An S3 location's endpoint and credentials with the defaults filled into what is unset."""
    if endpoint is None and d.s3_endpoint:
        endpoint = d.s3_endpoint
        used[f"{path}.endpoint"] = endpoint
    if secret is None and d.s3_secret_name:
        secret = S3Credentials(name=d.s3_secret_name)
        used[f"{path}.secretRef.name"] = d.s3_secret_name
    return endpoint, secret


def training_job(spec: TrainingJobSpec, d: EndpointDefaults) -> Defaulted[TrainingJobSpec]:
    """checkpoint.endpoint/secretRef, tracking.mlflow.trackingUri. trainingData keeps its own fallbacks (the
    view's source for the retrieval, the checkpoint's, now defaulted, for the workers)."""
    used: dict[str, str] = {}
    missing: list[Missing] = []
    update: dict[str, object] = {}
    if spec.checkpoint is not None:
        endpoint, secret = _s3("spec.checkpoint", spec.checkpoint.endpoint, spec.checkpoint.secret_ref, d, used)
        if used:
            update["checkpoint"] = spec.checkpoint.model_copy(update={"endpoint": endpoint, "secret_ref": secret})
    mlflow = spec.tracking.mlflow if spec.tracking else None
    if mlflow is not None and spec.tracking is not None and mlflow.tracking_uri is None:
        path = "spec.tracking.mlflow.trackingUri"
        if d.mlflow_tracking_uri:
            used[path] = d.mlflow_tracking_uri
            filled = mlflow.model_copy(update={"tracking_uri": d.mlflow_tracking_uri})
            update["tracking"] = spec.tracking.model_copy(update={"mlflow": filled})
        else:
            missing.append(Missing(path, MLFLOW_VALUE))
    base = spec.finetune.base_model if spec.finetune else None
    if spec.finetune is not None and base is not None and base.mlflow is not None and base.tracking_uri is None \
            and mlflow is None:
        path = "spec.finetune.baseModel.trackingUri"
        if d.mlflow_tracking_uri:
            used[path] = d.mlflow_tracking_uri
            filled_base = base.model_copy(update={"tracking_uri": d.mlflow_tracking_uri})
            update["finetune"] = spec.finetune.model_copy(update={"base_model": filled_base})
        else:
            missing.append(Missing(path, MLFLOW_VALUE))
    return Defaulted(spec.model_copy(update=update) if update else spec, used, missing)


def training_job_manifest(job: dict[str, Any], d: EndpointDefaults) -> dict[str, Any]:
    """A TrainingJob as the API server returns it, its checkpoint's unset S3 fields filled as its own controller
    fills them: for readers of another object's spec (an InferenceService serving the job's checkpoints must read
    them from where the job wrote them). A copy; the job itself is unchanged."""
    spec = job.get("spec") or {}
    checkpoint = spec.get("checkpoint")
    if not checkpoint:
        return job
    filled = dict(checkpoint)
    if not filled.get("endpoint") and d.s3_endpoint:
        filled["endpoint"] = d.s3_endpoint
    if not filled.get("secretRef") and d.s3_secret_name:
        filled["secretRef"] = {"name": d.s3_secret_name}
    return {**job, "spec": {**spec, "checkpoint": filled}} if filled != checkpoint else job


def inference_service(spec: InferenceServiceSpec, d: EndpointDefaults) -> Defaulted[InferenceServiceSpec]:
    """model.endpoint/secretRef for s3:// and models:/ sources (a fromTrainingJob source takes the job's, filled by
    `training_job_manifest`; an oci:// one needs none) and model.trackingUri for models:/ sources."""
    used: dict[str, str] = {}
    missing: list[Missing] = []
    model = spec.model
    if model.from_training_job is not None or (model.uri or "").startswith("oci://"):
        return Defaulted(spec)  # a model image needs no S3 or MLflow: its registry is in its reference
    endpoint, secret = _s3("spec.model", model.endpoint, model.secret_ref, d, used)
    tracking_uri = model.tracking_uri
    if model.mlflow is not None and tracking_uri is None:
        if d.mlflow_tracking_uri:
            tracking_uri = d.mlflow_tracking_uri
            used["spec.model.trackingUri"] = tracking_uri
        else:
            missing.append(Missing("spec.model.trackingUri", MLFLOW_VALUE))
    if not used:
        return Defaulted(spec, used, missing)
    filled = model.model_copy(update={"endpoint": endpoint, "secret_ref": secret, "tracking_uri": tracking_uri})
    return Defaulted(spec.model_copy(update={"model": filled}), used, missing)


def feature_view(spec: FeatureViewSpec, d: EndpointDefaults) -> Defaulted[FeatureViewSpec]:
    """source and store.registry endpoint/secretRef, only where they are s3:// (a path on the project's volume
    needs neither)."""
    used: dict[str, str] = {}
    update: dict[str, object] = {}
    if spec.source.path.startswith("s3://"):
        endpoint, secret = _s3("spec.source", spec.source.endpoint, spec.source.secret_ref, d, used)
        if used:
            update["source"] = spec.source.model_copy(update={"endpoint": endpoint, "secret_ref": secret})
    registry = spec.store.registry
    if registry.path is not None and registry.path.startswith("s3://"):
        before = len(used)
        endpoint, secret = _s3("spec.store.registry", registry.endpoint, registry.secret_ref, d, used)
        if len(used) > before:
            filled = registry.model_copy(update={"endpoint": endpoint, "secret_ref": secret})
            update["store"] = spec.store.model_copy(update={"registry": filled})
    return Defaulted(spec.model_copy(update=update) if update else spec, used)


def model_problem(defaulted: Defaulted[InferenceServiceSpec]) -> ResolveError | None:
    """An InferenceService whose model needs an endpoint nobody names: reported like a model that does not resolve
    (ModelLoaded, RolledOut and Ready False, reason EndpointNotConfigured), phase Pending rather than Failed: the
    operator's configuration can fix it without a spec change, and every pass looks again."""
    problem = defaulted.problem()
    return ResolveError(REASON, problem, transient=True) if problem else None
