"""InferenceService spec.model: where the served model comes from (an S3 folder, the MLflow registry, a
TrainingJob's checkpoints), and status.alias, the followed MLflow alias as last asked."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loom.workloads.common.oci.reference import URI_PATTERN as OCI_URI_PATTERN

from ....core.model import ApiModel, DnsName, S3Credentials, cel, validations

# An S3 prefix, or a model image by tag and/or digest (the reference grammar of loom.workloads.common.oci).
MODEL_URI_PATTERN = r"^(s3://.+|" + OCI_URI_PATTERN[1:-1] + r")$"


class FromTrainingJob(ApiModel):
    """Serve what a TrainingJob in the same namespace produced; a newer checkpoint rolls out by itself."""

    name: DnsName = Field(description="TrainingJob name.")
    checkpoint: Literal["latest", "final"] = Field(
        "latest", description="latest: follow every new checkpoint; final: only the one written on success."
    )


class ModelSource(ApiModel):
    """Where the model comes from. It is fetched at boot into a cache volume, never baked into the image."""

    model_config = validations(
        cel(
            "[has(self.uri), has(self.mlflow), has(self.fromTrainingJob)].filter(x, x).size() == 1",
            "set exactly one of uri, mlflow or fromTrainingJob",
        ),
        cel(
            "!has(self.pullSecretName) || "
            "(has(self.uri) && self.uri.startsWith('oci://') && self.uri.contains('@sha256:'))",
            "pullSecretName is for an oci:// uri pinned by digest (@sha256:...): the operator cannot look a tag up in "
            "a registry that asks for credentials",
            field_path=".pullSecretName",
        ),
    )

    name: DnsName | None = Field(None, description="Model name in the inference protocol (default: object name).")
    uri: str | None = Field(
        None,
        description="s3://bucket/prefix of a model folder, or oci://<registry>/<repository>[:tag][@sha256:...] of "
        "a model image (`loom model push`): mounted read-only as an image volume, pulled once per node, no download "
        "at pod start; a tag is resolved to its digest (status.modelImage).",
        pattern=MODEL_URI_PATTERN,
        max_length=1024,
    )
    mlflow: str | None = Field(
        None,
        description="MLflow registry URI: models:/name/version or models:/name@alias (resolved version in status).",
        pattern=r"^models:/[^/@]+(/[0-9]+|@[A-Za-z0-9_\-]+)$",
        max_length=512,
    )
    from_training_job: FromTrainingJob | None = None
    pull_secret_name: DnsName | None = Field(
        None,
        description="For an oci:// uri in a registry that asks for credentials: a kubernetes.io/dockerconfigjson "
        "Secret in this namespace, given to the pods as imagePullSecrets (the kubelet pulls with it; a refusal is the "
        "new pod's ErrImagePull in ModelLoaded while the serving replicas stay). The operator never reads it, so it "
        "does not look such an image up: the uri must name its digest.",
    )
    version: str | None = Field(
        None,
        description="Version label the server reports and status shows (default: the MLflow version, the "
        "checkpoint step, or the last path segment of the uri).",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$",
        max_length=63,
    )
    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URL for mlflow sources (default: the operator's, defaults.mlflow.trackingUri).",
        max_length=1024,
    )
    endpoint: str | None = Field(
        None, description="S3 endpoint URL for non-AWS stores (default: the operator's, defaults.s3.endpoint).",
        max_length=1024,
    )
    secret_ref: S3Credentials | None = Field(
        None, description="Secret with S3 credentials for fetching (default: the operator's, defaults.s3.secretName)."
    )
    alias_poll_seconds: int = Field(
        30, ge=5, le=86400, description="For models:/name@alias: how often the operator asks MLflow where the alias "
        "points (never more often, per service); a move rolls the new version out (as a canary under analysis)."
    )


class AliasStatus(ApiModel):
    """Where a followed MLflow alias pointed when last asked."""

    model: str
    alias: str
    version: str | None = None
    checked_at: str | None = Field(None, description="When MLflow was last asked.")
    changed_at: str | None = Field(None, description="When the alias was last seen to move.")
    previous_version: str | None = None
    error: str | None = Field(None, description="Why the last question to MLflow failed (the version kept).")
