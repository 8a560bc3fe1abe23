"""spec.trainingData and status.trainingData of a TrainingJob: the point-in-time training set built before the workers
start (retrieval.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ....core.model import ApiModel, DnsName, S3Credentials, cel, validations


class TrainingData(ApiModel):
    """A point-in-time correct training set from a FeatureView (Feast historical retrieval), built once, before
    the workers start, by a Job running the view's project store. Workers read it from `output`
    (env LOOM_TRAINING_DATA, LOOM_TRAINING_DATA_ENDPOINT). Immutable: the set is built once per job."""

    model_config = validations(cel("self == oldSelf", "trainingData is immutable"))

    feature_view: DnsName = Field(description="Name of a FeatureView in the job's namespace.")
    entity_dataframe: str = Field(
        description="s3:// parquet with the join key(s), an event_timestamp column and any labels: one training "
        "row each, joined with each feature's newest value at or before its timestamp (within the view's ttl).",
        min_length=6,
        max_length=1024,
        pattern=r"^s3://[^/]+/.+",
    )
    output: str | None = Field(
        None,
        description="s3:// parquet the training set is written to "
        "(default: s3://<entityDataframe's bucket>/loom-training-data/<namespace>/<job>.parquet).",
        max_length=1024,
        pattern=r"^s3://[^/]+/.+",
    )
    endpoint: str | None = Field(
        None,
        description="S3 endpoint URL of entityDataframe and output (default: the view's source endpoint for the "
        "retrieval, checkpoint.endpoint for the workers).",
        max_length=1024,
    )
    secret_ref: S3Credentials | None = Field(
        None,
        description="S3 credentials for entityDataframe and output, given to the retrieval and the workers "
        "(default: the view's source credentials for the retrieval, checkpoint.secretRef for the workers).",
    )
    full_feature_names: bool = Field(False, description="Name feature columns <view>__<feature>.")


class TrainingDataStatus(ApiModel):
    """The training set built for this job (from the retrieval Job's termination message)."""

    phase: Literal["Pending", "Running", "Succeeded", "Failed"] | None = None
    output: str | None = Field(None, description="Where the training set is (s3://...).")
    rows: int | None = Field(None, description="Training rows: one per entity dataframe row.")
    rows_without_features: int | None = Field(None, description="Rows for which no feature value was in range.")
    job: str | None = Field(None, description="The retrieval Job.")
    completion_time: str | None = None
