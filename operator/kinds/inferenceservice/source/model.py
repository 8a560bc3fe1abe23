"""Which model an InferenceService serves: the spec's model source resolved to one concrete, comparable identity.

A `ModelRef` is everything the fetch step and the server need to know about the model (where it lives, how to
read it, which handler calls it, the version label). Two refs are equal exactly when the served model is the same,
so "the model changed" (roll out, or start a canary) is a plain comparison. The stable Deployment carries its
ref as an annotation, which is how the controller knows what "previous" is across operator restarts.

`model.fromTrainingJob` is resolved against the TrainingJob's status (read by the controller, passed in here):
its `status.checkpoint.latest` is a concrete checkpoint prefix, so a newer checkpoint is a new ref, which rolls
out by itself.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ValidationError

from loom.workloads.common.oci.reference import SCHEME, ImageReference, parse_reference
from loom.workloads.server.config import BUILTIN_HANDLERS, parse_mlflow_uri

from ....core.model import ApiModel, S3Credentials
from .api import ModelSource

MODEL_ANNOTATION = "loom.dev/model"

StorageKind = Literal["s3", "mlflow", "checkpoint", "oci"]


class ModelRef(ApiModel):
    """One concrete model: what the fetch step downloads and the server loads."""

    storage_uri: str
    storage_kind: StorageKind
    handler: str
    version: str | None = None
    endpoint: str | None = None
    tracking_uri: str | None = None
    secret_ref: S3Credentials | None = None
    pull_secret_name: str | None = None  # oci: the pods' imagePullSecrets

    def to_annotation(self) -> str:
        return json.dumps(self.to_wire(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_annotation(cls, text: str | None) -> ModelRef | None:
        """The ref a Deployment was rendered with; None when missing or unreadable (e.g. edited by hand)."""
        if not text:
            return None
        try:
            return cls.model_validate(json.loads(text))
        except (ValueError, ValidationError):
            return None

    @property
    def display_version(self) -> str:
        """What status shows: the version label, or the source itself when only the fetch step will know."""
        return self.version or self.storage_uri


class ResolveError(Exception):
    """The spec's model cannot be resolved yet (or at all); becomes the ModelLoaded condition's reason."""

    def __init__(self, reason: str, message: str, *, transient: bool = True) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        # Transient errors (a TrainingJob without a checkpoint yet) are waited out; others need a spec change.
        self.transient = transient


def _last_segment(uri: str) -> str | None:
    segment = uri.rstrip("/").rsplit("/", 1)[-1]
    cleaned = "".join(c if c.isalnum() or c in "_.-" else "-" for c in segment).strip("-._")[:63]
    return cleaned or None


def resolve_handler(handler: str, kind: StorageKind | Literal["trainingjob"]) -> str:
    """The handler the server gets. 'auto' is decided here from the source when the server cannot guess itself."""
    if handler != "auto" or "auto" in BUILTIN_HANDLERS:
        return handler
    if kind == "mlflow":
        return "mlflow-pyfunc"
    if kind == "trainingjob":
        return "chargpt"  # the trainer's bundled model: what a TrainingJob produces unless told otherwise
    raise ResolveError(
        "HandlerRequired",
        f"handler: auto cannot be guessed for an {kind} uri; set handler (e.g. torchscript, torch-export, "
        "mlflow-pyfunc, chargpt, noop or module:Class)",
        transient=False,
    )


def resolve_model(
    source: ModelSource,
    handler: str,
    training_job: dict[str, Any] | None = None,
    runtime: str = "default",
    alias_version: str | None = None,
    image: ImageReference | None = None,
) -> ModelRef:
    """The concrete model the spec asks for. `training_job` is the referenced TrainingJob (None: not found);
    runtime vllm serves a TrainingJob's Hugging Face export only; `alias_version` the version a models:/name@alias
    source's alias points to now (the operator follows it); `image` an oci:// source's image by digest, as the
    registry resolved it (io.py)."""
    if source.uri is not None and source.uri.startswith(SCHEME):
        return _from_image(source, handler, image)
    if source.uri is not None:
        return ModelRef(
            storage_uri=source.uri,
            storage_kind="s3",
            handler=resolve_handler(handler, "s3"),
            version=source.version or _last_segment(source.uri),
            endpoint=source.endpoint,
            secret_ref=source.secret_ref,
        )
    if source.mlflow is not None:
        name, version, alias = parse_mlflow_uri(source.mlflow)
        uri = source.mlflow
        if alias is not None and alias_version is not None:
            # Pinned to the version the alias names now: a move is a new ref, so it rolls out (or starts a canary).
            uri, version = f"models:/{name}/{alias_version}", alias_version
        return ModelRef(
            storage_uri=uri,
            storage_kind="mlflow",
            handler=resolve_handler(handler, "mlflow"),
            # An alias is resolved by the fetch step, which the server then reports; a number is known now.
            version=source.version or (version if version and version.isdigit() else None),
            endpoint=source.endpoint,
            tracking_uri=source.tracking_uri,
            secret_ref=source.secret_ref,
        )
    if source.from_training_job is not None:
        if runtime == "vllm":
            _check_hugging_face_export(source, training_job)
        return _from_training_job(source, handler, training_job)
    raise ResolveError("InvalidModel", "set one of model.uri, model.mlflow or model.fromTrainingJob", transient=False)


def _from_image(source: ModelSource, handler: str, image: ImageReference | None) -> ModelRef:
    """A model image: served from the image volume the pod mounts (render.py), pinned by the digest the registry
    resolved, so a tag moved to another image is a new ref (it rolls out) and every replica mounts the same bytes."""
    assert source.uri is not None
    asked = parse_reference(source.uri)  # the API server checked the grammar (api.MODEL_URI_PATTERN)
    if image is None or image.digest is None:
        raise ResolveError("ImageNotResolved", f"{source.uri} has not been looked up in its registry yet")
    if asked.digest is not None and image.digest != asked.digest:
        raise ResolveError("ImageDigestMismatch", f"{source.uri}: the registry serves {image.digest}", transient=False)
    return ModelRef(
        storage_uri=image.pinned(image.digest).uri,
        storage_kind="oci",
        handler=resolve_handler(handler, "oci"),  # runtime vllm loads no handler: the caller passes noop
        version=source.version or asked.tag or image.digest.removeprefix("sha256:")[:12],
        pull_secret_name=source.pull_secret_name,
    )


def final_export_uri(job: dict[str, Any]) -> str | None:
    """Where the trainer exports the final model (full weights + config.json): <checkpoint.uri>/final."""
    uri = ((job.get("spec") or {}).get("checkpoint") or {}).get("uri")
    return f"{str(uri).rstrip('/')}/final" if uri else None


def _check_hugging_face_export(source: ModelSource, job: dict[str, Any] | None) -> None:
    """runtime vllm loads a Hugging Face-format folder: the job's final export in that format, nothing else (its
    sharded training checkpoints are no such folder, so `checkpoint: latest` waits for the final export too)."""
    ref = source.from_training_job
    assert ref is not None
    if job is None:
        raise ResolveError("TrainingJobNotFound", f"TrainingJob {ref.name} does not exist in this namespace")
    job_checkpoint = (job.get("spec") or {}).get("checkpoint") or {}
    if not job_checkpoint.get("uri"):
        raise ResolveError(
            "NoCheckpointStore", f"TrainingJob {ref.name} has no spec.checkpoint: it exports no model", transient=False
        )
    export_format = job_checkpoint.get("exportFormat", "loom")
    if export_format != "huggingface":
        raise ResolveError(
            "NoHuggingFaceExport",
            f"runtime vllm serves a Hugging Face-format folder, but TrainingJob {ref.name} exports {export_format} "
            "(set its spec.checkpoint.exportFormat: huggingface, with a task that writes one, such as "
            "loom.workloads.trainer.examples.llama)",
            transient=False,
        )
    phase = (job.get("status") or {}).get("phase")
    if phase == "Failed":
        raise ResolveError("TrainingJobFailed", f"TrainingJob {ref.name} failed: it has no final model")
    if phase != "Succeeded":
        raise ResolveError(
            "WaitingForTrainingJob",
            f"TrainingJob {ref.name} is {phase or 'Pending'}; runtime vllm waits for its final Hugging Face export "
            "(training checkpoints are not Hugging Face folders)",
        )


def _from_training_job(source: ModelSource, handler: str, job: dict[str, Any] | None) -> ModelRef:
    """A TrainingJob's model: its final export once it succeeded, else (checkpoint: latest) its newest checkpoint.

    The final export is the trainer's serving layout (full weights + config.json) and is written before the job
    succeeds, so a succeeded job is always served from it. While the job runs, `latest` follows
    status.checkpoint.latest: a sharded training checkpoint, which needs a handler that reads that layout (a
    handler that cannot load it leaves the replica unready, and readiness gating keeps the previous model serving).
    """
    ref = source.from_training_job
    assert ref is not None
    if job is None:
        raise ResolveError("TrainingJobNotFound", f"TrainingJob {ref.name} does not exist in this namespace")
    status = job.get("status") or {}
    checkpoint = status.get("checkpoint") or {}
    latest = checkpoint.get("latest")
    phase = status.get("phase")
    step = checkpoint.get("step")
    if step is None:
        step = (status.get("progress") or {}).get("step")
    job_checkpoint = (job.get("spec") or {}).get("checkpoint") or {}
    export = final_export_uri(job)
    version: str | None
    if phase == "Succeeded" and export is not None:
        uri, version = export, (f"final-step-{step}" if step is not None else "final")
    elif ref.checkpoint == "final":
        if phase == "Failed":
            raise ResolveError("TrainingJobFailed", f"TrainingJob {ref.name} failed: it has no final model")
        if export is None:
            raise ResolveError(
                "NoCheckpointStore",
                f"TrainingJob {ref.name} has no spec.checkpoint: it exports no model",
                transient=False,
            )
        raise ResolveError(
            "WaitingForTrainingJob", f"TrainingJob {ref.name} is {phase or 'Pending'}; waiting for its final model"
        )
    elif not latest:
        raise ResolveError("NoCheckpointYet", f"TrainingJob {ref.name} has not written a complete checkpoint yet")
    else:
        # The concrete checkpoint prefix (its manifest exists: the trainer reports only complete checkpoints).
        uri, version = str(latest), (f"step-{step}" if step is not None else _last_segment(str(latest)))
    secret = source.secret_ref
    if secret is None and job_checkpoint.get("secretRef"):
        secret = S3Credentials.model_validate(job_checkpoint["secretRef"])
    return ModelRef(
        storage_uri=uri,
        storage_kind="s3",
        handler=resolve_handler(handler, "trainingjob"),
        version=source.version or version,
        endpoint=source.endpoint or job_checkpoint.get("endpoint"),
        secret_ref=secret,
    )
