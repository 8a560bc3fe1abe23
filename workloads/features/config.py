"""The Feast workload's configuration: the contract between the operator and the Feast pods.

The operator renders a ``FeaturesConfig`` (one per Feast project: its feature views and the store they
share) into a ConfigMap as camelCase JSON; every command of ``python -m loom.workloads.features`` reads it
back with :meth:`FeaturesConfig.from_file`. This module imports pydantic only, never Feast, so the
operator can import it with a light install.

Credentials never travel through this object. S3 keys reach the pod as AWS_* variables from a Secret;
a Redis connection string or an SQL registry URL (both carry passwords) is named by the environment
variable that holds it, and :meth:`FeaturesConfig.feature_store_yaml` writes ``${VAR}`` references that
Feast itself expands, so the rendered ``feature_store.yaml`` is safe to put in a ConfigMap too.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from loom.workloads.common.config import CamelModel, WorkloadConfig

# Exit codes of every command (the operator maps them to condition reasons).
EXIT_OK = 0
EXIT_FAILED = 1  # unexpected: worth a retry (a store that was briefly unreachable, a crash)
EXIT_INVALID_CONFIG = 2  # the config or a view is invalid (unknown dtype, bad ttl): permanent until edited
EXIT_INVALID_SOURCE = 3  # the source cannot be read or lacks a column (timestamp, join key, feature)
EXIT_NOT_FOUND = 4  # a named feature view is not in the config or not in the registry

# Feast scalar dtypes a feature may have, by the names Feast uses in feast.types.
SCALAR_DTYPES: tuple[str, ...] = (
    "Int32", "Int64", "Float32", "Float64", "String", "Bool", "Bytes", "UnixTimestamp",
)
# Lists of scalars (embeddings, histories): "Array(Float32)". Feast has no Array(Array(..)) online.
ARRAY_DTYPES: tuple[str, ...] = tuple(f"Array({name})" for name in SCALAR_DTYPES)
FEATURE_DTYPES: tuple[str, ...] = SCALAR_DTYPES + ARRAY_DTYPES
# Entity keys Feast can serialize into an online-store key (feast.infra.key_encoding_utils).
ENTITY_DTYPES: tuple[str, ...] = ("Int32", "Int64", "String", "Bytes", "UnixTimestamp")

# The online store a project with a vector view runs: Feast's sqlite store with Loom's sqlite-vec index.
VECTOR_STORE_TYPE = "loom.workloads.features.vector_store.LoomSqliteOnlineStore"

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PROJECT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_]{0,62}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


class WorkloadError(Exception):
    """A failure the operator turns into a condition: ``reason`` and ``exit_code`` say which kind."""

    exit_code = EXIT_FAILED
    reason = "Failed"


class InvalidConfig(WorkloadError):
    exit_code = EXIT_INVALID_CONFIG
    reason = "InvalidConfig"


class InvalidSource(WorkloadError):
    exit_code = EXIT_INVALID_SOURCE
    reason = "InvalidSource"


class NotFound(WorkloadError):
    exit_code = EXIT_NOT_FOUND
    reason = "NotFound"


class UnsupportedDtype(ValueError):
    """A feature or entity names a dtype this workload cannot map to Feast; the message names the field."""


def check_dtype(dtype: str, where: str, allowed: tuple[str, ...] = FEATURE_DTYPES) -> str:
    """``dtype`` if it is one of ``allowed``; otherwise an error naming ``where`` (e.g. "feature 'trips'")."""
    if dtype not in allowed:
        raise UnsupportedDtype(f"{where}: unknown dtype {dtype!r} (supported: {', '.join(allowed)})")
    return dtype


def parse_duration(text: str) -> int:
    """Seconds in a Kubernetes-style duration such as ``1d12h``, ``90m`` or ``86400s``."""
    match = _DURATION.match(text.strip())
    if not text.strip() or match is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 86400s, 90m, 24h, 7d, 1d12h)")
    days, hours, minutes, seconds = (int(group or 0) for group in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


class EntityConfig(CamelModel):
    """A Feast entity. Feast supports one join key per entity: a composite key is several entities."""

    name: str = Field(description="Entity name; also the join key when joinKeys is unset.")
    join_keys: list[str] | None = Field(None, description="Column joining on this entity (one; default: [name]).")
    value_type: str = Field("Int64", description=f"One of {', '.join(ENTITY_DTYPES)}.")
    description: str = ""
    tags: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not _IDENTIFIER.match(value):
            raise ValueError(f"entity name {value!r} must be a Python identifier (letters, digits, '_')")
        return value

    @model_validator(mode="after")
    def _check(self) -> EntityConfig:
        if self.join_keys is not None and len(self.join_keys) != 1:
            raise ValueError(
                f"entity {self.name!r}: Feast entities have exactly one join key (got {self.join_keys}); "
                "declare one entity per key column for a composite key"
            )
        check_dtype(self.value_type, f"entity {self.name!r}", ENTITY_DTYPES)
        return self

    @property
    def join_key(self) -> str:
        return self.join_keys[0] if self.join_keys else self.name


class FeatureConfig(CamelModel):
    name: str
    dtype: str = Field(description=f"One of {', '.join(FEATURE_DTYPES)}.")
    description: str = ""
    tags: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not _IDENTIFIER.match(value):
            raise ValueError(f"feature name {value!r} must be a Python identifier (letters, digits, '_')")
        return value


class SourceConfig(CamelModel):
    """The offline source: one parquet file (or a folder of them) on a volume or in S3."""

    path: str = Field(description="Absolute parquet path or s3://bucket/key.")
    timestamp_field: str = Field("event_timestamp", description="Event time column.")
    created_timestamp_field: str | None = Field(
        None, description="Row creation time column: of two rows with one event time, the later created wins."
    )
    endpoint: str | None = Field(None, description="S3 endpoint URL for non-AWS stores (s3:// paths only).")

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not (value.startswith("s3://") or value.startswith("/")):
            raise ValueError(f"source path {value!r} must be absolute or an s3:// URI (pods have no repo directory)")
        return value

    @property
    def is_s3(self) -> bool:
        return self.path.startswith("s3://")


VECTOR_METRICS: tuple[str, ...] = ("cosine", "l2", "l1")
VECTOR_DTYPE = "Array(Float32)"
MAX_DIMENSION = 8192


class ChunkingConfig(CamelModel):
    """How a document's text is cut before embedding: windows of ``size`` characters, consecutive windows sharing
    ``overlap`` characters (cuts move back to the last whitespace when there is one)."""

    size: int = Field(1000, ge=16, le=100_000, description="Characters per chunk.")
    overlap: int = Field(100, ge=0, le=50_000, description="Characters shared by consecutive chunks.")

    @model_validator(mode="after")
    def _check(self) -> ChunkingConfig:
        if self.overlap >= self.size:
            raise ValueError(f"chunking overlap ({self.overlap}) must be smaller than size ({self.size})")
        return self


class EmbeddingConfig(CamelModel):
    """Documents embedded during materialization by an OpenAI-compatible ``POST <url>/v1/embeddings``.

    The source holds documents (``documentColumn``: an id, ``textColumn``: the text); each is cut into chunks and
    every chunk becomes one row of the view: the join key is ``<document id>#<n>``, the text field the chunk, the
    vector field its embedding, and every other feature is copied from the document's row."""

    url: str = Field(description="Base URL of the embedding service (http://host[:port]).")
    model: str = Field(description="The model name the service serves.")
    document_column: str = Field("document_id", description="Source column identifying a document.")
    text_column: str = Field("text", description="Source column holding the document's text.")
    chunking: ChunkingConfig = Field(default_factory=ChunkingConfig)
    batch_size: int = Field(32, ge=1, le=2048, description="Chunks per embeddings request.")
    api_key_env: str | None = Field(None, description="Variable holding the service's API key (from a Secret).")
    reembed: int = Field(
        0, ge=0, description="Re-embedding generation: an index built by another model is rebuilt only when this "
        "exceeds the generation that built it."
    )
    output_path: str = Field(description="Where the embedded chunks are written (parquet): the view's Feast source.")
    model_source: str | None = Field(
        None, description="Where the service's model comes from (its InferenceService's spec.model): recorded with "
        "the model name as the index's model identity, so a new model under the same name is another model."
    )

    @field_validator("document_column", "text_column")
    @classmethod
    def _column(cls, value: str) -> str:
        if not _IDENTIFIER.match(value):
            raise ValueError(f"column {value!r} must be letters, digits and '_'")
        return value


class VectorConfig(CamelModel):
    """The view's vector field: one Array(Float32) feature indexed for nearest-neighbour search."""

    field: str = Field(description="The Array(Float32) feature holding each document's vector.")
    dimension: int = Field(ge=1, le=MAX_DIMENSION, description="Length of every vector.")
    metric: Literal["cosine", "l2", "l1"] = Field("cosine", description="Distance of the search.")
    text_field: str | None = Field(None, description="The String feature holding the document's text.")
    embedding: EmbeddingConfig | None = None


class FeatureViewConfig(CamelModel):
    name: str
    entities: list[EntityConfig] = Field(min_length=1)
    features: list[FeatureConfig] = Field(min_length=1)
    source: SourceConfig
    ttl_seconds: int = Field(86400, ge=0, description="How long a value stays valid; 0 means forever.")
    online: bool = True
    description: str = ""
    owner: str = ""
    tags: dict[str, str] = Field(default_factory=dict)
    vector: VectorConfig | None = None

    @field_validator("name")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not _IDENTIFIER.match(value):
            raise ValueError(f"feature view name {value!r} must be letters, digits and '_' (Feast references "
                             "features as view:feature)")
        return value

    @model_validator(mode="after")
    def _check(self) -> FeatureViewConfig:
        for feature in self.features:
            check_dtype(feature.dtype, f"feature view {self.name!r} feature {feature.name!r}")
        columns = [e.join_key for e in self.entities] + [f.name for f in self.features]
        duplicates = sorted({c for c in columns if columns.count(c) > 1})
        if duplicates:
            raise ValueError(f"feature view {self.name!r}: columns declared twice: {', '.join(duplicates)}")
        timestamps = {self.source.timestamp_field, self.source.created_timestamp_field or ""}
        clash = sorted(timestamps & set(columns))
        if clash:
            raise ValueError(f"feature view {self.name!r}: timestamp column(s) {clash} also declared as a feature/key")
        if self.vector is not None:
            self._check_vector(self.vector)
        return self

    def _check_vector(self, vector: VectorConfig) -> None:
        dtypes = {f.name: f.dtype for f in self.features}
        if dtypes.get(vector.field) != VECTOR_DTYPE:
            raise ValueError(
                f"feature view {self.name!r}: vector field {vector.field!r} must be a feature of dtype {VECTOR_DTYPE}"
            )
        if vector.text_field is not None and dtypes.get(vector.text_field) != "String":
            raise ValueError(f"feature view {self.name!r}: text field {vector.text_field!r} must be a String feature")
        if vector.embedding is not None:
            if vector.text_field is None:
                raise ValueError(f"feature view {self.name!r}: an embedded view needs vector.textField")
            if len(self.entities) != 1 or self.entities[0].value_type != "String":
                raise ValueError(
                    f"feature view {self.name!r}: an embedded view has one String entity, the chunk id "
                    "(<document id>#<n>)"
                )


class RegistrySettings(CamelModel):
    """Where the Feast registry lives.

    ``file``: one registry file, a path on a volume or an s3:// object (read-modify-write, so one writer at
    a time: Loom's apply pods are serialized per project). ``sql``: Feast's SQL registry, its SQLAlchemy URL
    read from the environment variable ``urlEnv`` (it carries a password).
    """

    type: Literal["file", "sql"] = "file"
    path: str | None = Field(None, description="file: absolute path or s3://bucket/key of registry.db.")
    url_env: str | None = Field(None, description="sql: environment variable holding the SQLAlchemy URL.")
    endpoint: str | None = Field(None, description="S3 endpoint URL for an s3:// registry on non-AWS stores.")
    cache_ttl_seconds: int = Field(60, ge=0, description="How long readers cache the registry (0: never refresh).")

    @model_validator(mode="after")
    def _check(self) -> RegistrySettings:
        if self.type == "file":
            if not self.path:
                raise ValueError("registry type file needs a path (absolute or s3://)")
            if not (self.path.startswith("s3://") or self.path.startswith("/")):
                raise ValueError(f"registry path {self.path!r} must be absolute or an s3:// URI")
            if self.url_env:
                raise ValueError("urlEnv is for registry type sql")
        else:
            if not self.url_env or not _ENV_NAME.match(self.url_env):
                raise ValueError("registry type sql needs urlEnv: the variable holding the SQLAlchemy URL")
            if self.path:
                raise ValueError("registry type sql takes its URL from urlEnv, not path (the URL holds a password)")
        return self

    @property
    def location(self) -> str:
        """Where the registry is, without credentials (for status)."""
        return self.path if self.type == "file" and self.path else f"sql (${{{self.url_env}}})"


class OnlineStoreSettings(CamelModel):
    """``sqlite``: a file on a volume (one node). ``redis``: a Redis server, connection string from env."""

    type: Literal["sqlite", "redis"] = "sqlite"
    path: str = Field("/var/lib/loom/features/online.db", description="sqlite: database file on a volume.")
    vector_path: str = Field(
        "/var/lib/loom/features/vectors.db", description="sqlite: the vector indexes (sqlite-vec) beside it."
    )
    connection_string_env: str = Field(
        "LOOM_FEAST_REDIS", description="redis: variable holding 'host:port[,password=...,ssl=true]'."
    )
    key_ttl_seconds: int | None = Field(None, ge=1, description="redis: expire keys after this long.")

    @field_validator("connection_string_env")
    @classmethod
    def _env(cls, value: str) -> str:
        if not _ENV_NAME.match(value):
            raise ValueError(f"connectionStringEnv {value!r} is not an environment variable name")
        return value


class OfflineStoreSettings(CamelModel):
    """Parquet files read by Feast's file (Dask) offline store."""

    type: Literal["file"] = "file"


class ServeSettings(CamelModel):
    host: str = "0.0.0.0"
    port: int = Field(6566, ge=1, le=65535, description="Feast's feature server HTTP port.")
    metrics: bool = Field(True, description="Prometheus metrics on metricsPort (Feast's own exporter).")
    metrics_port: int = Field(8000, ge=1, le=65535, description="Port of Feast's Prometheus exporter.")
    workers: int = Field(1, ge=1, le=64)
    registry_ttl_seconds: int = Field(5, ge=1, description="How often the server re-reads the registry.")


class FeaturesConfig(WorkloadConfig):
    """One Feast project: its store (shared by every view of the project) and its feature views."""

    json_indent: ClassVar[int | None] = 2

    project: str
    feature_views: list[FeatureViewConfig] = Field(default_factory=list)
    registry: RegistrySettings
    online_store: OnlineStoreSettings = Field(default_factory=OnlineStoreSettings)
    offline_store: OfflineStoreSettings = Field(default_factory=OfflineStoreSettings)
    serve: ServeSettings = Field(default_factory=ServeSettings)
    repo_path: str = Field("/tmp/loom-feast", description="Scratch directory Feast treats as its repo.")

    @field_validator("project")
    @classmethod
    def _project(cls, value: str) -> str:
        # Feast allows letters, digits and underscores only; a Kubernetes name's '-' becomes '_'.
        if not _PROJECT.match(value):
            raise ValueError(
                f"Feast project {value!r} must be 1-63 letters, digits or '_', not starting with '_'"
            )
        return value

    @model_validator(mode="after")
    def _unique(self) -> FeaturesConfig:
        if self.has_vectors and self.online_store.type != "sqlite":
            raise ValueError(
                f"vector search needs the sqlite online store (sqlite-vec); this project uses {self.online_store.type}"
            )
        names = [view.name for view in self.feature_views]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"feature views declared twice: {', '.join(duplicates)}")
        # One project shares its entities: a name must mean the same key everywhere.
        seen: dict[str, tuple[str, str]] = {}
        for view in self.feature_views:
            for entity in view.entities:
                key = (entity.join_key, entity.value_type)
                if seen.setdefault(entity.name, key) != key:
                    raise ValueError(f"entity {entity.name!r} is declared with different join keys or value types")
        return self

    @property
    def has_vectors(self) -> bool:
        return any(view.vector is not None for view in self.feature_views)

    def view(self, name: str) -> FeatureViewConfig:
        for view in self.feature_views:
            if view.name == name:
                return view
        raise KeyError(name)

    def feature_store_yaml(self) -> dict[str, Any]:
        """Feast's ``feature_store.yaml`` for this store, with ``${VAR}`` for every secret (Feast expands them).

        The same document builds the workload's RepoConfig, so what the official ``feast`` CLI sees in a pod
        and what Loom's commands use cannot differ.
        """
        registry: dict[str, Any]
        if self.registry.type == "file":
            registry = {"registry_type": "file", "path": self.registry.path}
        else:
            registry = {"registry_type": "sql", "path": f"${{{self.registry.url_env}}}"}
        registry["cache_ttl_seconds"] = self.registry.cache_ttl_seconds
        online: dict[str, Any]
        if self.online_store.type == "sqlite" and self.has_vectors:
            online = {"type": VECTOR_STORE_TYPE, "path": self.online_store.path,
                      "vector_path": self.online_store.vector_path}
        elif self.online_store.type == "sqlite":
            online = {"type": "sqlite", "path": self.online_store.path}
        else:
            online = {"type": "redis", "connection_string": f"${{{self.online_store.connection_string_env}}}"}
            if self.online_store.key_ttl_seconds is not None:
                online["key_ttl_seconds"] = self.online_store.key_ttl_seconds
        return {
            "project": self.project,
            "provider": "local",
            "registry": registry,
            "online_store": online,
            "offline_store": {"type": self.offline_store.type},
            "entity_key_serialization_version": 3,
        }

    def s3_endpoints(self) -> dict[str, str]:
        """Environment the pod needs so Feast's S3 clients reach a non-AWS endpoint (no credentials)."""
        env: dict[str, str] = {}
        if self.registry.endpoint:
            # Feast's S3 registry store reads its endpoint from this variable only.
            env["FEAST_S3_ENDPOINT_URL"] = self.registry.endpoint
        return env


def project_name(name: str) -> str:
    """A Kubernetes-style name as a Feast project name ('-' and '.' are not allowed there)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name).lstrip("_")[:63]
