"""Following models:/name@alias (pure): when MLflow is due to be asked where the alias points (at most once per
aliasPollSeconds per service; io.py asks), and which version the MLflow writes concern (the rejection tag on a
rolled-back version, the promotion alias moved to a promoted one).

The last answer is kept in status.alias with its time, so neither a resync, a burst of watch events nor an operator
restart asks MLflow sooner. When MLflow cannot be reached the version last seen keeps serving (the error in
status); with no version ever seen the model does not resolve yet (RegistryUnavailable, waited out).
"""

from __future__ import annotations

from datetime import datetime

from loom.workloads.server.config import parse_mlflow_uri

from ....core.model import Manifest, parse_time
from .api import AliasStatus, ModelSource
from .model import ModelRef


def previous_alias(body: Manifest) -> AliasStatus | None:
    raw = (body.get("status") or {}).get("alias")
    try:
        return AliasStatus.model_validate(raw) if raw else None
    except ValueError:
        return None


def followed(source: ModelSource) -> tuple[str, str] | None:
    """(model, alias) when the source follows an alias."""
    if source.mlflow is None:
        return None
    name, _version, alias = parse_mlflow_uri(source.mlflow)
    return (name, alias) if alias is not None else None


def due(source: ModelSource, previous: AliasStatus | None, now: datetime) -> bool:
    target = followed(source)
    if target is None:
        return False
    if previous is None or (previous.model, previous.alias) != target or previous.version is None:
        return True
    checked = parse_time(previous.checked_at)
    return checked is None or (now - checked).total_seconds() >= source.alias_poll_seconds


def change_reason(status: AliasStatus | None) -> str | None:
    if status is None or status.version is None or status.previous_version is None:
        return None
    return (f"alias {status.alias} of {status.model} moved from version {status.previous_version} to "
            f"{status.version} at {status.changed_at}")  # fmt: skip


def mlflow_version(ref: ModelRef) -> tuple[str, str] | None:
    if ref.storage_kind != "mlflow" or ref.tracking_uri is None:
        return None
    name, version, _alias = parse_mlflow_uri(ref.storage_uri)
    return (name, version) if version is not None else None


def restore_target(
    name: str, followed_alias: str | None, promote_alias: str | None, stable: ModelRef | None
) -> tuple[str, str] | None:
    """(alias, version) to move the followed alias back to on a rejection: only when it is the promotion alias and
    the stable version is a version of the same registered model."""
    if followed_alias is None or followed_alias != promote_alias or stable is None:
        return None
    serving = mlflow_version(stable)
    if serving is None or serving[0] != name:
        return None
    return followed_alias, serving[1]
