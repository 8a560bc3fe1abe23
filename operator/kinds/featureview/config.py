"""FeatureView -> the Feast workload's FeaturesConfig (pure): names, the project's members and store.

One Feast project is shared by every FeatureView naming it in a namespace. `plan_project` builds its config from
its views, oldest first, one at a time, so a view the workload would refuse (or one declaring another store) is
left out alone, with its reason, and never takes the project's other views down with it. The store and the
server's replicas come from the project's oldest view.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import ValidationError

from loom.workloads.features.config import (
    ChunkingConfig,
    EmbeddingConfig,
    EntityConfig,
    FeatureConfig,
    FeaturesConfig,
    FeatureViewConfig,
    OfflineStoreSettings,
    OnlineStoreSettings,
    RegistrySettings,
    ServeSettings,
    SourceConfig,
    VectorConfig,
    parse_duration,
    project_name,
)

from ...core.model import InvalidSpec as InvalidSpec  # re-exported
from ...core.model import S3Credentials
from ..inferenceservice.render import service_url
from .api import FeatureViewSpec, Store
from .vector.api import VectorSearch

DATA_DIR = "/var/lib/loom/features"  # the project's folder inside every Feast pod
HTTP_PORT = 6566
METRICS_PORT = 8000
REDIS_ENV = "LOOM_FEAST_REDIS"


# ------------------------------------------------------------------------------------------- names


def feast_view_name(name: str) -> str:
    """A Kubernetes name as a Feast feature view name (Feast references features as `view:feature`)."""
    ident = re.sub(r"[^A-Za-z0-9_]", "_", name)
    return ident if re.match(r"^[A-Za-z_]", ident) else f"v_{ident}"


def feature_refs(name: str, features: list[str]) -> list[str]:
    """What Feast's /get-online-features takes for the view's features: `<feast view name>:<feature>`."""
    view = feast_view_name(name)
    return [f"{view}:{feature}" for feature in features]


def project_prefix(project: str) -> str:
    """The project as a Kubernetes name part ('_' is not allowed there)."""
    return project.replace("_", "-")


def project_object_name(project: str) -> str:
    """ConfigMap, Deployment and Service of the project."""
    return f"{project_prefix(project)}-features"


def short_hash(text: str, length: int = 8) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def _bounded(name: str, limit: int) -> str:
    """`name` cut to `limit` characters, keeping it unique with a hash of the whole (Job names feed a label)."""
    if len(name) <= limit:
        return name
    return f"{name[: limit - 9].rstrip('-.')}-{short_hash(name)}"


def apply_job_name(view: str, content_hash: str) -> str:
    return f"{_bounded(view, 45)}-apply-{content_hash}"


def cronjob_name(view: str) -> str:
    # CronJob names are at most 52 characters (the controller appends an 11-character suffix to its Jobs).
    return f"{_bounded(view, 40)}-materialize"


def manual_job_name(view: str, token: str) -> str:
    return f"{_bounded(view, 45)}-mat-{short_hash(token)}"


def delete_job_name(project: str, view: str) -> str:
    return f"{_bounded(project_prefix(project), 45)}-delete-{short_hash(view)}"


def server_url(namespace: str, project: str) -> str:
    return f"http://{project_object_name(project)}.{namespace}.svc"


def model_source(service: Mapping[str, object] | None) -> str | None:
    """An InferenceService's spec.model as one line (no credentials there: a secretRef names a Secret), or None."""
    spec = (service or {}).get("spec")
    model = spec.get("model") if isinstance(spec, dict) else None
    return json.dumps(model, sort_keys=True, separators=(",", ":")) if model else None


def embedding_url(namespace: str, service: str) -> str:
    """The embedding InferenceService's base URL (its Service; POST <url>/v1/embeddings)."""
    return service_url({"metadata": {"name": service, "namespace": namespace}})


def embedding_key_env(name: str) -> str:
    """The variable holding the API key of view `name`'s embedding service (from its Secret)."""
    return f"LOOM_EMBEDDING_KEY_{feast_view_name(name).upper()}"


def embedded_path(name: str) -> str:
    """Where an embedded view's chunks are written: its Feast source, in the project's folder."""
    return f"{DATA_DIR}/embedded/{feast_view_name(name)}.parquet"


def host_folder(namespace: str, spec: FeatureViewSpec) -> str:
    return f"{spec.store.volume.host_path.rstrip('/')}/{namespace}/{project_prefix(spec.project)}"


# ------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Member:
    """One FeatureView of the project, as the pass read it."""

    name: str
    uid: str
    created: str  # creationTimestamp: the oldest view sets the project's store
    spec: FeatureViewSpec
    namespace: str = ""  # where an embedded view's embedding service is


@dataclass(frozen=True)
class Rejection:
    reason: str
    message: str


@dataclass(frozen=True)
class ProjectPlan:
    """The project's FeaturesConfig and what was left out of it, and why."""

    project: str
    primary: Member
    members: tuple[Member, ...]  # the views in the config, oldest first
    config: FeaturesConfig
    credentials: S3Credentials | None
    rejected: dict[str, Rejection] = field(default_factory=dict)


def vector_config(name: str, namespace: str, vector: VectorSearch, model_source: str | None = None) -> VectorConfig:
    embedding = vector.embedding
    return VectorConfig(
        field=vector.field,
        dimension=vector.dimension,
        metric=vector.metric,
        text_field=vector.text_field,
        embedding=None
        if embedding is None
        else EmbeddingConfig(
            url=embedding_url(namespace, embedding.service),
            model=embedding.model,
            document_column=embedding.document_column,
            text_column=embedding.text_column,
            chunking=ChunkingConfig(size=embedding.chunking.size, overlap=embedding.chunking.overlap),
            batch_size=embedding.batch_size,
            api_key_env=embedding_key_env(name) if embedding.api_key_secret_ref is not None else None,
            reembed=embedding.reembed,
            output_path=embedded_path(name),
            model_source=model_source,
        ),
    )


def view_config(
    name: str, spec: FeatureViewSpec, namespace: str = "", model_sources: Mapping[str, str] | None = None
) -> FeatureViewConfig:
    """The workload's view of one FeatureView, by keyword (raises ValidationError/ValueError on what the pods
    would refuse)."""
    return FeatureViewConfig(
        name=feast_view_name(name),
        entities=[
            EntityConfig(
                name=e.name,
                join_keys=list(e.join_keys) if e.join_keys else None,
                value_type=e.value_type,
                description=e.description,
                tags=dict(e.tags),
            )
            for e in spec.entities
        ],
        features=[
            FeatureConfig(name=f.name, dtype=f.dtype, description=f.description, tags=dict(f.tags))
            for f in spec.features
        ],
        source=SourceConfig(
            path=spec.source.path,
            timestamp_field=spec.source.timestamp_field,
            created_timestamp_field=spec.source.created_timestamp_field,
            endpoint=spec.source.endpoint,
        ),
        ttl_seconds=parse_duration(spec.ttl),
        online=spec.online,
        description=spec.description,
        owner=spec.owner,
        tags=dict(spec.tags),
        vector=None
        if spec.vector is None
        else vector_config(
            name,
            namespace,
            spec.vector,
            (model_sources or {}).get(spec.vector.embedding.service) if spec.vector.embedding is not None else None,
        ),
    )


def store_settings(store: Store) -> tuple[RegistrySettings, OnlineStoreSettings, OfflineStoreSettings]:
    """The project's store as the workload takes it; default files live in the mounted project folder."""
    registry = RegistrySettings(
        type="file",
        path=store.registry.path or f"{DATA_DIR}/registry.db",
        endpoint=store.registry.endpoint,
        cache_ttl_seconds=store.registry.cache_ttl_seconds,
    )
    if store.online.type == "redis":
        online = OnlineStoreSettings(
            type="redis", connection_string_env=REDIS_ENV, key_ttl_seconds=store.online.key_ttl_seconds
        )
    else:
        online = OnlineStoreSettings(type="sqlite", path=f"{DATA_DIR}/online.db")
    return registry, online, OfflineStoreSettings(type=store.offline.type)


def _store_key(store: Store) -> str:
    return json.dumps(store.to_wire(), sort_keys=True)


def _credentials(spec: FeatureViewSpec) -> set[str]:
    refs = [spec.source.secret_ref, spec.store.registry.secret_ref]
    return {json.dumps(r.to_wire(), sort_keys=True) for r in refs if r is not None}


def _error_text(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(str(e.get("msg", "")).removeprefix("Value error, ") for e in exc.errors())
    return str(exc)


def plan_project(project: str, members: list[Member], model_sources: Mapping[str, str] | None = None) -> ProjectPlan:
    """Every view of `project` that can join the config, oldest first; the others with the reason they can't.

    Views are added one at a time, so one bad view (an entity redeclared with another key type) is refused alone
    and never takes the project's other views down with it. `model_sources`: an embedding InferenceService's name
    -> its spec.model (model_source), what the index records with the model's name."""
    if not members:
        raise ValueError(f"project {project!r} has no views")
    ordered = sorted(members, key=lambda m: (m.created, m.name))
    primary = ordered[0]
    registry, online, offline = store_settings(primary.spec.store)
    serve = ServeSettings(port=HTTP_PORT, metrics_port=METRICS_PORT)
    views: list[FeatureViewConfig] = []
    included: list[Member] = []
    creds: set[str] = set()
    rejected: dict[str, Rejection] = {}
    config = FeaturesConfig(
        project=project_name(project), registry=registry, online_store=online, offline_store=offline, serve=serve
    )
    for member in ordered:
        if _store_key(member.spec.store) != _store_key(primary.spec.store):
            rejected[member.name] = Rejection(
                "StoreConflict",
                f"project {project!r} uses the store of FeatureView {primary.name!r}; declare the same store",
            )
            continue
        wanted = creds | _credentials(member.spec)
        if len(wanted) > 1:
            rejected[member.name] = Rejection(
                "CredentialsConflict",
                f"the pods of project {project!r} take one S3 secretRef; this view names another",
            )
            continue
        try:
            candidate = FeaturesConfig(
                project=config.project,
                feature_views=[*views, view_config(member.name, member.spec, member.namespace, model_sources)],
                registry=registry,
                online_store=online,
                offline_store=offline,
                serve=serve,
            )
        except (ValidationError, ValueError) as exc:
            rejected[member.name] = Rejection("InvalidConfig", _error_text(exc))
            continue
        config, views, creds = candidate, list(candidate.feature_views), wanted
        included.append(member)
    credentials = S3Credentials.model_validate(json.loads(next(iter(creds)))) if creds else None
    return ProjectPlan(project, primary, tuple(included), config, credentials, rejected)


def apply_hash(plan: ProjectPlan, name: str) -> str:
    """What an apply of view `name` depends on: its own definition and where the store is. A change of another
    view of the project does not re-apply this one."""
    view = plan.config.view(feast_view_name(name))
    store = plan.config.model_dump(mode="json", by_alias=True, include={"project", "registry", "online_store"})
    return short_hash(view.model_dump_json(by_alias=True) + json.dumps(store, sort_keys=True))
