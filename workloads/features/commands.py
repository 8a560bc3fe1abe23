"""What each command does, with the real Feast SDK: apply, delete, materialize, historical, serve.

Each function takes an open FeatureStore and the contract, does its work and returns a JSON-ready result
(the CLI prints it and writes it to the termination-message file). Failures the operator should turn into
a condition raise :class:`WorkloadError` subclasses carrying an exit code and Feast's own message.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import sys
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
from feast import Entity, FeatureStore, FeatureView
from feast.diff.property_diff import TransitionType
from feast.diff.registry_diff import diff_registry_objects
from feast.errors import EntityNotFoundException, FeatureViewNotFoundException
from feast.infra.offline_stores.offline_utils import infer_event_timestamp_from_entity_df
from feast.infra.registry.registry import FeastObjectType

from loom.workloads.features import vectors
from loom.workloads.features.config import (
    FeaturesConfig,
    FeatureViewConfig,
    InvalidConfig,
    InvalidSource,
    NotFound,
)
from loom.workloads.features.convert import MANAGED_BY_KEY, MANAGED_BY_TAG, repo_config, to_feast_objects
from loom.workloads.features.embedding import check_documents
from loom.workloads.features.s3compat import arrow_s3, ensure_s3_protocol


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).astimezone(UTC).isoformat()


@contextlib.contextmanager
def feast_output_to_stderr() -> Iterator[None]:
    """Feast prints progress (colours, tqdm bars) to stdout; stdout carries only the result JSON."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def open_store(config: FeaturesConfig) -> FeatureStore:
    """A FeatureStore for the config's store; local folders it writes to are created first."""
    for name, value in config.s3_endpoints().items():
        os.environ.setdefault(name, value)
    ensure_s3_protocol()
    Path(config.repo_path).mkdir(parents=True, exist_ok=True)
    if config.online_store.type == "sqlite":
        Path(config.online_store.path).parent.mkdir(parents=True, exist_ok=True)
    if config.registry.type == "file" and config.registry.path and not config.registry.path.startswith("s3://"):
        Path(config.registry.path).parent.mkdir(parents=True, exist_ok=True)
    return FeatureStore(config=repo_config(config))


def select_views(config: FeaturesConfig, names: Sequence[str] | None) -> list[FeatureViewConfig]:
    if not names:
        return list(config.feature_views)
    unknown = [name for name in names if name not in {v.name for v in config.feature_views}]
    if unknown:
        raise NotFound(f"feature view(s) {', '.join(unknown)} not in project {config.project!r}'s config")
    return [config.view(name) for name in names]


def check_source(store: FeatureStore, view: FeatureViewConfig, feature_view: FeatureView) -> dict[str, str]:
    """The source's columns (name -> Arrow type), read the way Feast reads them; missing columns are errors.

    Feast itself only notices a missing timestamp or key column deep inside materialization, so it is
    checked here, before anything is written, with a message naming the column and its role.
    """
    source = view.source
    if view.vector is not None and view.vector.embedding is not None:
        # Its Feast source is what materialization writes; what must be readable now is the documents.
        return check_documents(view, source_schema)
    batch_source = feature_view.batch_source
    if batch_source is None:
        raise InvalidConfig(f"feature view {view.name!r} has no batch source")
    try:
        columns = dict(batch_source.get_table_column_names_and_types(store.config))
    except Exception as error:  # pyarrow/Feast raise many types for one cause: the file cannot be read
        raise InvalidSource(
            f"feature view {view.name!r}: cannot read source {source.path}: {type(error).__name__}: {error}"
        ) from error
    roles = {source.timestamp_field: "timestamp field"}
    if source.created_timestamp_field:
        roles[source.created_timestamp_field] = "created timestamp field"
    roles.update({entity.join_key: f"join key of entity {entity.name!r}" for entity in view.entities})
    roles.update({feature.name: "feature" for feature in view.features})
    missing = [f"{column!r} ({role})" for column, role in roles.items() if column not in columns]
    if missing:
        raise InvalidSource(
            f"feature view {view.name!r}: source {source.path} has no column {', '.join(missing)}; "
            f"its columns are {', '.join(sorted(columns))}"
        )
    return columns


def _changes(current: Any, desired: Any, kind: FeastObjectType) -> list[str]:
    """Names of the properties that differ (Feast's own registry diff, as `feast plan` shows it)."""
    if current is None:
        return ["created"]
    diff = diff_registry_objects(current, desired, kind)
    if diff.transition_type == TransitionType.UNCHANGED:
        return []
    names = {d.property_name for d in diff.feast_object_property_diffs}
    # The source's proto embeds its own created/updated times, so the proto diff flags it whenever anything
    # else changed; DataSource equality ignores those times.
    if "batch_source" in names and getattr(current, "batch_source", None) == getattr(desired, "batch_source", None):
        names.discard("batch_source")
    return sorted(names) or ["updated"]


def _registered_entity(store: FeatureStore, name: str) -> Entity | None:
    try:
        return store.get_entity(name)
    except EntityNotFoundException:
        return None


def _registered_view(store: FeatureStore, name: str) -> FeatureView | None:
    try:
        return store.get_feature_view(name)
    except FeatureViewNotFoundException:
        return None


def apply(store: FeatureStore, config: FeaturesConfig, names: Sequence[str] | None = None) -> dict[str, Any]:
    """Register the views (and their entities) that differ from the registry; unchanged ones are untouched,
    so a second apply writes nothing (not even a new last-updated time)."""
    to_apply: dict[str, Entity | FeatureView] = {}
    views = []
    for view in select_views(config, names):
        entities, feature_view = to_feast_objects(view)
        check_source(store, view, feature_view)
        changes = []
        for entity in entities:
            entity_changes = _changes(_registered_entity(store, entity.name), entity, FeastObjectType.ENTITY)
            if entity_changes:
                to_apply[f"entity/{entity.name}"] = entity
                changes += [f"entity {entity.name}: {c}" for c in entity_changes]
        view_changes = _changes(_registered_view(store, view.name), feature_view, FeastObjectType.FEATURE_VIEW)
        if view_changes:
            to_apply[f"view/{view.name}"] = feature_view
            changes += view_changes
        views.append({"name": view.name, "changed": bool(changes), "changes": changes})
    if to_apply:
        with feast_output_to_stderr():
            store.apply(list(to_apply.values()))
    return {
        "command": "apply",
        "outcome": "Applied" if to_apply else "Unchanged",
        "project": config.project,
        "registry": config.registry.location,
        "featureViews": views,
    }


def delete(store: FeatureStore, config: FeaturesConfig, names: Sequence[str]) -> dict[str, Any]:
    """Remove views from the registry and drop their online tables; deleting an absent view succeeds.
    Entities Loom registered that no remaining view uses are removed too."""
    if not names:
        raise InvalidConfig("delete needs at least one --view")
    deleted, absent = [], []
    for name in names:
        current = _registered_view(store, name)
        if current is None:
            absent.append(name)
            continue
        with feast_output_to_stderr():
            # partial=False tears down the view's online-store table, as `feast apply` does for a removed view.
            store.apply([], objects_to_delete=[current], partial=False)
        deleted.append(name)
    in_use = {entity for view in store.list_feature_views() for entity in view.entities}
    orphans = [
        entity for entity in store.list_entities()
        if entity.name not in in_use and entity.tags.get(MANAGED_BY_KEY) == MANAGED_BY_TAG[MANAGED_BY_KEY]
    ]
    if orphans and deleted:
        with feast_output_to_stderr():
            store.apply([], objects_to_delete=list(orphans), partial=False)
    return {
        "command": "delete",
        "outcome": "Deleted" if deleted else "Absent",
        "project": config.project,
        "deleted": deleted,
        "absent": absent,
        "entitiesDeleted": sorted(e.name for e in orphans) if deleted else [],
    }


class _WriteCounter:
    """Counts the rows Feast hands to the online store (Feast's materialize returns nothing)."""

    def __init__(self, store: FeatureStore) -> None:
        self.rows: dict[str, int] = {}
        self.available = False
        try:
            online_store = store._get_provider().online_store
            original = online_store.online_write_batch
        except AttributeError:
            return

        def counting(config: Any, table: Any, data: Any, progress: Any) -> Any:
            self.rows[table.name] = self.rows.get(table.name, 0) + len(data)
            return original(config, table, data, progress)

        # An instance attribute shadows the method for this store only.
        setattr(online_store, "online_write_batch", counting)  # noqa: B010
        self.available = True


def ttl_bound(start: datetime, end: datetime, ttl_seconds: int) -> datetime:
    """An explicit window never reaches further back than the view's ttl before its end: Feast's online
    reads do not check ttl, so a value older than that must never reach the online store."""
    return max(start, end - timedelta(seconds=ttl_seconds)) if ttl_seconds > 0 else start


def materialize(
    store: FeatureStore,
    config: FeaturesConfig,
    names: Sequence[str] | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
) -> dict[str, Any]:
    """Incremental materialization up to ``end`` (default now) or, with ``start``, exactly that window.

    The window of each view comes back from the registry (Feast records every materialized interval), so
    what the result reports is what Feast will resume from next time.
    """
    end = end or datetime.now(UTC)
    if start is not None and start >= end:
        raise InvalidConfig(f"materialization window start {_iso(start)} is not before end {_iso(end)}")
    views = [v for v in select_views(config, names) if v.online]
    for view in views:
        registered = _registered_view(store, view.name)
        if registered is None:
            raise NotFound(f"feature view {view.name!r} is not registered in project {config.project!r}: apply it")
        check_source(store, view, registered)
    embedded = {
        v.name: vectors.prepare(config, v, end, read_parquet, write_parquet)
        for v in views
        if v.vector is not None and v.vector.embedding is not None
    }
    counter = _WriteCounter(store)
    view_names = [v.name for v in views]
    with feast_output_to_stderr():
        if start is None:
            incremental = [name for name in view_names if name not in embedded]
            if incremental:
                store.materialize_incremental(end_date=end, feature_views=incremental)
            for view in views:
                if view.name in embedded:
                    store.materialize(start_date=vectors.window_start(view, end), end_date=end,
                                      feature_views=[view.name])
        else:
            for view in views:
                store.materialize(start_date=ttl_bound(start, end, view.ttl_seconds), end_date=end,
                                  feature_views=[view.name])
    results = []
    for view in views:
        name = view.name
        intervals = store.get_feature_view(name).materialization_intervals
        window_start, window_end = intervals[-1] if intervals else (start, end)
        result: dict[str, Any] = {
            "name": name,
            "start": _iso(window_start),
            "end": _iso(window_end),
            "rowsWritten": counter.rows.get(name, 0) if counter.available else None,
        }
        if view.vector is not None:
            result["vectorIndex"] = vectors.finish(config, view, embedded.get(name))
        results.append(result)
    starts = [r["start"] for r in results if r["start"]]
    return {
        "command": "materialize",
        "outcome": "Succeeded",
        "mode": "incremental" if start is None else "window",
        "project": config.project,
        "window": {"start": min(starts) if starts else _iso(start), "end": _iso(end)},
        "requestedStart": _iso(start),
        "rowsWritten": sum(r["rowsWritten"] or 0 for r in results) if counter.available else None,
        "featureViews": results,
    }


def _filesystem(path: str, endpoint: str | None) -> tuple[Any, str]:
    if path.startswith("s3://"):
        return arrow_s3(endpoint), path.removeprefix("s3://")
    return None, path


def read_parquet(path: str, endpoint: str | None = None) -> pd.DataFrame:
    filesystem, location = _filesystem(path, endpoint)
    try:
        return pq.read_table(location, filesystem=filesystem).to_pandas()
    except Exception as error:
        raise InvalidSource(f"cannot read parquet {path}: {type(error).__name__}: {error}") from error


def source_schema(path: str, endpoint: str | None = None) -> dict[str, str]:
    """A parquet file's columns (name -> Arrow type) without reading its rows."""
    filesystem, location = _filesystem(path, endpoint)
    try:
        schema = pq.read_schema(location, filesystem=filesystem)
    except Exception as error:
        raise InvalidSource(f"cannot read source {path}: {type(error).__name__}: {error}") from error
    return {field.name: str(field.type) for field in schema}


def write_parquet(frame: pd.DataFrame, path: str, endpoint: str | None = None) -> None:
    filesystem, location = _filesystem(path, endpoint)
    if filesystem is None:
        Path(location).parent.mkdir(parents=True, exist_ok=True)
        partial = f"{location}.partial"
        frame.to_parquet(partial, index=False)
        os.replace(partial, location)  # a reader never sees half a training set
    else:
        buffer = io.BytesIO()
        frame.to_parquet(buffer, index=False)
        with filesystem.open_output_stream(location) as stream:
            stream.write(buffer.getvalue())


def keep_every_entity_row(entity_df: pd.DataFrame, joined: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The training set with one row per entity row, in the entity dataframe's order.

    Feast's file (Dask) offline store drops entity rows that found no feature value within the ttl and
    collapses rows sharing keys and timestamp; a training set must keep both (a label without features is
    still a sample, two labels at one instant are two samples). Feast's per-key values are joined back
    onto the caller's rows, so a missing value is an explicit null, never a lost row.
    """
    features = [c for c in joined.columns if c not in entity_df.columns]
    left, right = entity_df.copy(), joined[keys + features].drop_duplicates(keys)
    # Feast hands timestamps back at its own resolution; align both sides before joining on them.
    for frame in (left, right):
        frame[keys[-1]] = pd.to_datetime(frame[keys[-1]], utc=True).astype("datetime64[ns, UTC]")
    return left.merge(right, on=keys, how="left", validate="many_to_one")


def historical(
    store: FeatureStore,
    config: FeaturesConfig,
    entities: str,
    output: str,
    names: Sequence[str] | None = None,
    full_feature_names: bool = False,
    endpoint: str | None = None,
) -> dict[str, Any]:
    """A point-in-time correct training set: for each entity row, each feature's newest value at or before
    the row's timestamp and within the view's ttl (Feast's historical retrieval), written as parquet.

    s3:// entity and output paths use ``endpoint``, else the first S3 source's endpoint, else the
    AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL variables."""
    views = select_views(config, names)
    endpoint = endpoint or next((v.source.endpoint for v in views if v.source.endpoint), None)
    for view in views:
        if _registered_view(store, view.name) is None:
            raise NotFound(f"feature view {view.name!r} is not registered in project {config.project!r}: apply it")
        check_source(store, view, to_feast_objects(view)[1])
    entity_df = read_parquet(entities, endpoint)
    references = [f"{view.name}:{feature.name}" for view in views for feature in view.features]
    with feast_output_to_stderr():
        joined = store.get_historical_features(
            entity_df=entity_df, features=references, full_feature_names=full_feature_names
        ).to_df()
        timestamp = infer_event_timestamp_from_entity_df(dict(entity_df.dtypes))
    keys = [*sorted({entity.join_key for view in views for entity in view.entities}), timestamp]
    frame = keep_every_entity_row(entity_df, joined, keys)
    feature_columns = [c for c in frame.columns if c not in entity_df.columns]
    write_parquet(frame, output, endpoint)
    return {
        "command": "historical",
        "outcome": "Succeeded",
        "project": config.project,
        "output": output,
        "rows": len(frame),
        "rowsWithoutFeatures": int(frame[feature_columns].isna().all(axis=1).sum()) if feature_columns else 0,
        "columns": list(frame.columns),
        "features": references,
    }


def serve(store: FeatureStore, config: FeaturesConfig) -> None:
    """Feast's own feature server (what `feast serve` runs): /get-online-features, /health, /push, ...;
    Prometheus metrics from Feast's exporter on ``serve.metricsPort`` when enabled."""
    settings = config.serve
    if settings.metrics:
        # Feast starts its exporter on a fixed port 8000; two servers on one address (the local stack's
        # node agent, a pod with sidecars) would collide, so the configured port is passed in.
        import feast.metrics as feast_metrics

        feast_metrics.start_metrics_server = functools.partial(
            feast_metrics.start_metrics_server, port=settings.metrics_port
        )
    store.serve(
        host=settings.host,
        port=settings.port,
        type_="http",
        no_access_log=True,
        workers=settings.workers,
        metrics=settings.metrics,
        registry_ttl_sec=settings.registry_ttl_seconds,
    )
