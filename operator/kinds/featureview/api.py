"""FeatureView: a Feast feature view registered, materialized on a schedule and served online.

The dtype and value-type enums repeat, literally, the tuples of the Feast workload's contract
(loom.workloads.features.config: FEATURE_DTYPES, ENTITY_DTYPES); tests/unit/test_featureview_render.py fails when
they drift, so admission accepts exactly what the pods can build.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ...autoscale.spec import Autoscaling, AutoscalingStatus
from ...core.kind import AGE, PHASE, Kind, NameRule, PrinterColumn
from ...core.model import ApiModel, S3Credentials, SecretKeySelector, StatusBase, cel, validations
from .vector.api import VECTOR_RULES, VectorSearch, VectorSearchStatus

FeatureDtype = Literal[
    "Int32",
    "Int64",
    "Float32",
    "Float64",
    "String",
    "Bool",
    "Bytes",
    "UnixTimestamp",
    "Array(Int32)",
    "Array(Int64)",
    "Array(Float32)",
    "Array(Float64)",
    "Array(String)",
    "Array(Bool)",
    "Array(Bytes)",
    "Array(UnixTimestamp)",
]
# Feast can serialize only these into an online-store key.
EntityDtype = Literal["Int32", "Int64", "String", "Bytes", "UnixTimestamp"]

IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]*$"
# A Feast project is letters, digits and '_'; Loom also names Kubernetes objects after it ('_' becomes '-'), so
# lower case, and short enough for "<project>-features" and Job names.
PROJECT_PATTERN = r"^[a-z0-9]([a-z0-9_-]{0,38}[a-z0-9])?$"
# A Kubernetes-style duration as the workload parses it: days, hours, minutes, seconds, in that order.
DURATION_PATTERN = r"^([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?$"
DEFAULT_HOST_PATH = "/var/lib/loom/features"

Tags = dict[str, str]


class Entity(ApiModel):
    """A Feast entity: what a feature value is about (a driver, a customer). One join key column."""

    name: str = Field(min_length=1, max_length=63, pattern=IDENTIFIER)
    join_keys: list[Annotated[str, Field(max_length=63, pattern=IDENTIFIER)]] | None = Field(
        None,
        min_length=1,
        max_length=1,
        description="The column joining on this entity (exactly one, Feast's rule; default: [name]). "
        "For a composite key declare several entities.",
    )
    value_type: EntityDtype = Field("Int64", description="Type of the key column.")
    description: str = Field("", max_length=1024)
    tags: Tags = Field(default_factory=dict)


class Feature(ApiModel):
    name: str = Field(min_length=1, max_length=63, pattern=IDENTIFIER)
    dtype: FeatureDtype = Field(description="A Feast type, e.g. Float32, Int64, String, Array(Float32).")
    description: str = Field("", max_length=1024)
    tags: Tags = Field(default_factory=dict)


class Source(ApiModel):
    """Offline source: a parquet file (or folder of them) on the project's volume, or an S3 object."""

    path: str = Field(
        description="Absolute parquet path in the pods or s3://bucket/key.",
        min_length=2,
        max_length=1024,
        pattern=r"^(/|s3://).+",
    )
    timestamp_field: str = Field("event_timestamp", description="Event time column.", max_length=63)
    created_timestamp_field: str | None = Field(
        None, description="Row creation time column: of two rows with one event time, the later created wins."
    )
    endpoint: str | None = Field(None, description="S3 endpoint URL for non-AWS stores.", max_length=512)
    secret_ref: S3Credentials | None = Field(None, description="S3 credentials (AWS_* keys) for an s3:// source.")


class Materialization(ApiModel):
    model_config = validations(
        cel(
            "!self.schedule.startsWith('@every')",
            "schedule is a CronJob schedule: cron syntax ('0 * * * *') or @hourly/@daily/..., not @every",
            field_path=".schedule",
        ),
    )

    schedule: str = Field(
        "0 * * * *",
        min_length=1,
        max_length=128,
        description="Cron schedule (UTC) of incremental materialization into the online store; "
        "annotate the object with loom.dev/materialize-now=<token> for an immediate run.",
    )
    suspend: bool = Field(False, description="Pause scheduled runs (an annotation-triggered run still happens).")


class Registry(ApiModel):
    """Where the Feast registry lives: a file on the project's volume (default) or an S3 object."""

    path: str | None = Field(
        None,
        description="Absolute path on the project's volume or s3://bucket/key (default: registry.db on the volume).",
        max_length=1024,
        pattern=r"^(/|s3://).+",
    )
    endpoint: str | None = Field(None, description="S3 endpoint URL for an s3:// registry.", max_length=512)
    secret_ref: S3Credentials | None = Field(None, description="S3 credentials for an s3:// registry.")
    cache_ttl_seconds: int = Field(60, ge=0, description="How long readers cache the registry.")


class OnlineStore(ApiModel):
    model_config = validations(
        cel("self.type != 'redis' || has(self.connectionSecretRef)", "redis needs connectionSecretRef"),
    )

    type: Literal["sqlite", "redis"] = Field(
        "sqlite", description="sqlite: a file on the project's volume (one node). redis: many nodes and replicas."
    )
    connection_secret_ref: SecretKeySelector | None = Field(
        None, description="redis: Secret key holding 'host:port[,password=...,ssl=true]'."
    )
    key_ttl_seconds: int | None = Field(None, ge=1, description="redis: expire keys after this long.")


class OfflineStore(ApiModel):
    type: Literal["file"] = Field("file", description="Parquet files read by Feast's file offline store.")


class Volume(ApiModel):
    """The project's shared folder (file registry, sqlite online store): a hostPath, so the apply/materialize
    Jobs and the feature server see one folder. It works on one node only; use an s3:// registry and redis for
    more."""

    host_path: str = Field(
        DEFAULT_HOST_PATH,
        pattern=r"^/.*",
        max_length=512,
        description="Host folder; the project's files live in <hostPath>/<namespace>/<project>.",
    )


class Store(ApiModel):
    """The project's store. Every FeatureView of a project must declare the same store."""

    registry: Registry = Field(default_factory=Registry)
    online: OnlineStore = Field(default_factory=OnlineStore)
    offline: OfflineStore = Field(default_factory=OfflineStore)
    volume: Volume = Field(default_factory=Volume)


class FeatureServer(ApiModel):
    """The project's Feast feature server. One server serves every view of a project: its replicas are the most any
    view asks for, and its autoscaling is the oldest view's that sets one (the others' are ignored, said in their
    status)."""

    model_config = validations(
        cel(
            "!has(self.autoscaling) || self.autoscaling.minReplicas >= 1",
            "the feature server does not scale to zero: autoscaling.minReplicas must be >= 1",
            field_path=".autoscaling.minReplicas",
        ),
        cel(
            "!has(self.autoscaling) || !has(self.autoscaling.engine) || self.autoscaling.engine == 'builtin'",
            "the feature server is autoscaled by engine builtin only",
            field_path=".autoscaling.engine",
        ),
        cel(
            "!has(self.autoscaling) || self.autoscaling.metric == 'prometheus'",
            "the feature server scales on metric prometheus (a PromQL query, e.g. over Feast's own metrics)",
            field_path=".autoscaling.metric",
        ),
    )

    replicas: int = Field(1, ge=0, le=100, description="Feast feature server replicas of the project.")
    autoscaling: Autoscaling | None = Field(
        None,
        description="Scale the project's feature server on a PromQL query (metric prometheus), as an "
        "InferenceService's autoscaling (engine builtin, minReplicas >= 1); replicas are then the autoscaler's.",
    )


class FeatureViewSpec(ApiModel):
    model_config = validations(
        *VECTOR_RULES,
        cel(
            "self.features.all(f, !self.entities.exists(e, e.name == f.name))",
            "a feature may not share its name with an entity",
            field_path=".features",
        ),
        cel("self.project == oldSelf.project", "project is immutable", field_path=".project"),
    )

    project: str = Field(
        description="Feast project (lower case letters, digits, '-' and '_'; '-' becomes '_' in Feast).",
        min_length=1,
        max_length=40,
        pattern=PROJECT_PATTERN,
    )
    entities: list[Entity] = Field(min_length=1, max_length=8)
    features: list[Feature] = Field(min_length=1, max_length=256)
    source: Source
    ttl: str = Field(
        "86400s",
        min_length=2,
        max_length=32,
        pattern=DURATION_PATTERN,
        description="How long a value stays valid, e.g. 24h or 1d12h; 0s means forever.",
    )
    online: bool = Field(True, description="Materialize into the online store and serve.")
    description: str = Field("", max_length=4096)
    owner: str = Field("", max_length=253, description="Who owns the view (an e-mail, a team).")
    tags: Tags = Field(default_factory=dict)
    materialization: Materialization = Field(default_factory=Materialization)
    store: Store = Field(default_factory=Store)
    server: FeatureServer = Field(default_factory=FeatureServer)
    vector: VectorSearch | None = Field(
        None, description="Index one Array(Float32) feature for vector search (documents for retrieval)."
    )


class LastMaterialization(ApiModel):
    start: str | None = Field(None, description="Start of the window written to the online store (RFC 3339).")
    end: str | None = Field(None, description="End of the window (RFC 3339).")
    outcome: Literal["Running", "Succeeded", "Failed"] | None = None
    rows_written: int | None = None
    job: str | None = Field(None, description="The Job that ran it.")
    message: str | None = None
    completion_time: str | None = None


class FeatureViewStatus(StatusBase):
    phase: Literal["Pending", "Registered", "Materializing", "Ready", "Failed"] | None = None
    registered: bool = False
    project: str | None = Field(None, description="The Feast project name (as Feast spells it).")
    feast_view: str | None = Field(
        None,
        description="The view's name in Feast, which differs from metadata.name ('-' becomes '_'): a lookup with "
        "the Kubernetes name answers 404.",
    )
    feature_refs: list[str] | None = Field(
        None,
        description="Feature references ready to use in POST <url>/get-online-features and in training sets "
        "(<feastView>:<feature>).",
    )
    registry: str | None = Field(None, description="Where the registry is (no credentials).")
    online_store: str | None = Field(None, description="Online store kind: sqlite or redis.")
    url: str | None = Field(None, description="Feast feature server URL (POST /get-online-features).")
    last_materialization: LastMaterialization | None = None
    next_materialization: str | None = Field(None, description="Next scheduled run (RFC 3339).")
    autoscaling: AutoscalingStatus | None = Field(
        None, description="The project feature server's autoscaler (on the view whose autoscaling is in force)."
    )
    vector_search: VectorSearchStatus | None = None


class FeatureView(ApiModel):
    """A Feast feature view kept registered, materialized and served."""

    api_version: Literal["loom.dev/v1alpha1"] = "loom.dev/v1alpha1"
    kind: Literal["FeatureView"] = "FeatureView"
    metadata: dict[str, object] = Field(default_factory=dict)
    spec: FeatureViewSpec
    status: FeatureViewStatus | None = None


# The kind as Kubernetes shows it (the CRD's names, columns and name rule; api/kinds.py lists every kind).
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
