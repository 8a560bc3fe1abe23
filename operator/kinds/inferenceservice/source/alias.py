"""Following models:/name@alias: where the alias points, asked of MLflow at most once per aliasPollSeconds per
service (the edge), and what the InferenceService's MLflow writes are: the rejection tag on a rolled-back version,
the promotion alias moved to a promoted one.

The last answer is kept in status.alias with its time, so neither a resync, a burst of watch events nor an operator
restart asks MLflow sooner. When MLflow cannot be reached the version last seen keeps serving (the error in
status); with no version ever seen the model does not resolve yet (RegistryUnavailable, waited out).
"""

from __future__ import annotations

from datetime import datetime

from loom.workloads.server.config import parse_mlflow_uri

from ....core.model import Manifest, format_time, parse_time
from ....core.registry import REJECTED_TAG, Registry, RegistryError
from ..api import AliasStatus, ModelSource
from ..canary.api import RolloutStatus
from .model import ModelRef, ResolveError


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


async def resolve_alias(
    source: ModelSource, previous: AliasStatus | None, now: datetime
) -> tuple[AliasStatus | None, ResolveError | None]:
    """The alias' status now (asking MLflow only when due) and the error when no version can be served."""
    target = followed(source)
    if target is None:
        return None, None
    model, alias = target
    same = previous is not None and (previous.model, previous.alias) == target
    kept = previous if same else None
    if not due(source, kept, now):
        return kept, None
    stamp = format_time(now)
    try:
        assert source.tracking_uri is not None  # defaulted from the operator's, or refused before this
        async with Registry(source.tracking_uri) as registry:
            found = await registry.by_alias(model, alias)
    except RegistryError as error:
        if kept is not None and kept.version is not None:
            return kept.model_copy(update={"checked_at": stamp, "error": str(error)[:300]}), None
        status = AliasStatus(model=model, alias=alias, checked_at=stamp, error=str(error)[:300])
        return status, ResolveError("RegistryUnavailable", str(error)[:300])
    if found is None:
        status = AliasStatus(model=model, alias=alias, checked_at=stamp, error=f"alias {alias} not found")
        return status, ResolveError("AliasNotFound", f"registered model {model} has no alias {alias}")
    if kept is not None and kept.version == found.version:
        return kept.model_copy(update={"checked_at": stamp, "error": None}), None
    return AliasStatus(
        model=model, alias=alias, version=found.version, checked_at=stamp, changed_at=stamp,
        previous_version=kept.version if kept else None,
    ), None  # fmt: skip


def change_reason(status: AliasStatus | None) -> str | None:
    if status is None or status.version is None or status.previous_version is None:
        return None
    return (f"alias {status.alias} of {status.model} moved from version {status.previous_version} to "
            f"{status.version} at {status.changed_at}")  # fmt: skip


def _mlflow_version(ref: ModelRef) -> tuple[str, str] | None:
    if ref.storage_kind != "mlflow" or ref.tracking_uri is None:
        return None
    name, version, _alias = parse_mlflow_uri(ref.storage_uri)
    return (name, version) if version is not None else None


async def registry_writes(
    rollout: RolloutStatus,
    desired: ModelRef,
    *,
    promote_alias: str | None,
    promoted: bool,
    followed_alias: str | None = None,
    stable: ModelRef | None = None,
) -> RolloutStatus:
    """Tag the rejected version (once) and move the promotion alias (once); what was done goes into status, what
    failed is tried again by the next pass.

    A service that follows the alias it promotes (`champion`, say) reads a move of that alias as a candidate to
    judge. When the candidate is rejected the alias goes back to the version that serves (`stable`), so the
    registry never names a rejected version as the one in production (and a service created later does not serve
    it unjudged). Only while the alias still names the rejected version: a newer move is left alone.
    """
    target = _mlflow_version(desired)
    if target is None or desired.tracking_uri is None:
        return rollout
    name, version = target
    rejected = list(rollout.rejected)
    untagged = any(e.model_version == version and not e.tagged for e in rejected)
    to_move = promoted and promote_alias is not None and rollout.promoted_alias != f"{promote_alias}={version}"
    if not untagged and not to_move:
        return rollout  # nothing to write: no connection to MLflow
    restore = _restore_target(name, followed_alias, promote_alias, stable)
    try:
        async with Registry(desired.tracking_uri) as registry:
            for i, entry in enumerate(rejected):
                if entry.model_version == version and not entry.tagged:
                    if restore is not None:  # before the tag: a failure here leaves both to the next pass
                        current = await registry.by_alias(name, restore[0])
                        if current is not None and current.version == version:
                            await registry.set_alias(name, restore[0], restore[1])
                    await registry.set_version_tag(name, version, REJECTED_TAG, f"{entry.reason}: {entry.message}")
                    rejected[i] = entry.model_copy(update={"tagged": True})
            moved = f"{promote_alias}={version}"
            if promoted and promote_alias is not None and rollout.promoted_alias != moved:
                await registry.set_alias(name, promote_alias, version)
                rollout = rollout.model_copy(update={"promoted_alias": moved})
    except RegistryError:
        pass  # not recorded: the next pass tries again
    return rollout.model_copy(update={"rejected": rejected})


def _restore_target(
    name: str, followed_alias: str | None, promote_alias: str | None, stable: ModelRef | None
) -> tuple[str, str] | None:
    """(alias, version) to move the followed alias back to on a rejection: only when it is the promotion alias and
    the stable version is a version of the same registered model."""
    if followed_alias is None or followed_alias != promote_alias or stable is None:
        return None
    serving = _mlflow_version(stable)
    if serving is None or serving[0] != name:
        return None
    return followed_alias, serving[1]
