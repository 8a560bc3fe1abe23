"""FeatureView: a Feast feature view registered, materialized on a schedule and served online."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .common import ApiModel, DnsName, S3Credentials, SecretKeySelector, StatusBase, cel, validations

FeastDtype = Literal["Int32", "Int64", "Float32", "Float64", "String", "Bool", "Bytes", "UnixTimestamp"]


class Entity(ApiModel):
    name: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    join_keys: list[str] | None = Field(None, description="Columns joining on this entity (default: [name]).")
    value_type: FeastDtype = "Int64"
    description: str | None = None


class Feature(ApiModel):
    name: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    dtype: FeastDtype


class Source(ApiModel):
    """Offline source: a parquet file (path in a volume) or an S3 object."""

    path: str = Field(description="Parquet file path or s3:// URI.", min_length=1, max_length=1024)
    timestamp_field: str = Field("event_timestamp", description="Event time column.")
    created_timestamp_field: str | None = Field(None, description="Row creation time column (dedup).")
    endpoint: str | None = Field(None, description="S3 endpoint URL for non-AWS stores.")
    secret_ref: S3Credentials | None = None


class Materialization(ApiModel):
    schedule: str = Field(
        "@every 1h",
        description="Cron expression or '@every <duration>' for incremental materialization to the online store.",
        max_length=128,
    )


class OnlineStore(ApiModel):
    model_config = validations(
        cel("self.type != 'redis' || has(self.connectionSecretRef)", "redis needs connectionSecretRef"),
    )

    type: Literal["sqlite", "redis"] = "sqlite"
    connection_secret_ref: SecretKeySelector | None = Field(None, description="Redis connection string Secret key.")


class Store(ApiModel):
    registry: str | None = Field(None, description="Registry path or s3:// URI (default: in the view's volume).")
    online: OnlineStore = Field(default_factory=OnlineStore)


class FeatureServer(ApiModel):
    replicas: int = Field(1, ge=0, le=100)


class FeatureViewSpec(ApiModel):
    model_config = validations(
        cel(
            "self.features.all(f, !self.entities.exists(e, e.name == f.name))",
            "a feature may not share its name with an entity",
            field_path=".features",
        ),
    )

    project: DnsName = Field(description="Feast project.")
    entities: list[Entity] = Field(min_length=1, max_length=8)
    features: list[Feature] = Field(min_length=1, max_length=256)
    source: Source
    ttl: str = Field(
        "86400s", pattern=r"^([0-9]+(s|m|h|d))+$", description="How long a feature value stays valid, e.g. 24h."
    )
    online: bool = True
    materialization: Materialization = Field(default_factory=Materialization)
    store: Store = Field(default_factory=Store)
    server: FeatureServer = Field(default_factory=FeatureServer)


class MaterializationWindow(ApiModel):
    start: str | None = None
    end: str | None = None


class FeatureViewStatus(StatusBase):
    phase: Literal["Pending", "Registered", "Materializing", "Ready", "Failed"] | None = None
    registered: bool = False
    last_materialization: MaterializationWindow | None = None
    url: str | None = None


class FeatureView(ApiModel):
    """A Feast feature view kept registered, materialized and served."""

    api_version: Literal["loom.dev/v1alpha1"] = "loom.dev/v1alpha1"
    kind: Literal["FeatureView"] = "FeatureView"
    metadata: dict[str, object] = Field(default_factory=dict)
    spec: FeatureViewSpec
    status: FeatureViewStatus | None = None
