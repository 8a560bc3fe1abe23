"""An InferenceService's `spec.features` resolved against its FeatureView (pure): what the server's enrichment needs.

The server (loom.workloads.server.enrichment) gets the Feast view name, every feature of the view with its dtype,
the entity keys and the project's feature server URL (the view's status.url, else the name the FeatureView
controller gives the project's Service). Until the view exists and is Ready (registered, its server answering)
the InferenceService waits with a condition saying so, and a service already running keeps running unchanged:
the server must never run without the features its model was written for.
"""

from __future__ import annotations

from pydantic import ValidationError

from loom.workloads.server.config import EnrichedFeature, EnrichmentConfig

from ....core.kit import Manifest
from ...featureview.api import FeatureViewSpec
from ...featureview.config import feast_view_name, server_url
from ..source.model import ResolveError
from .api import FeatureEnrichment


def _ready(view: Manifest) -> tuple[bool, str]:
    for cond in (view.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            detail = f"{cond.get('reason') or ''}: {cond.get('message') or ''}".strip(": ")
            return cond.get("status") == "True", detail
    return False, "no Ready condition yet"


def resolve_features(features: FeatureEnrichment, view: Manifest | None, namespace: str) -> EnrichmentConfig:
    """The server's enrichment config; ResolveError (FeatureViewNotFound, FeatureViewNotReady: waited out;
    FeatureViewMismatch: needs a spec change) when it cannot be built now."""
    name = features.feature_view
    if view is None:
        raise ResolveError("FeatureViewNotFound", f"FeatureView {name} does not exist in namespace {namespace}")
    try:
        spec = FeatureViewSpec.model_validate(view.get("spec") or {})
    except ValidationError as exc:
        raise ResolveError("FeatureViewNotReady", f"FeatureView {name} has an unreadable spec: {exc}") from exc
    join_keys = [(e.join_keys or [e.name])[0] for e in spec.entities]
    wrong = [key for key in features.entity_keys if key not in join_keys]
    absent = [key for key in join_keys if key not in features.entity_keys]
    if wrong or absent:
        parts = []
        if wrong:
            parts.append(f"{', '.join(wrong)} not a join key of FeatureView {name}")
        if absent:
            parts.append(f"join key(s) {', '.join(absent)} missing")
        raise ResolveError(
            "FeatureViewMismatch",
            f"features.entityKeys {features.entity_keys}: {'; '.join(parts)} (the view's join keys: {join_keys})",
            transient=False,
        )
    if not spec.online:
        raise ResolveError(
            "FeatureViewMismatch", f"FeatureView {name} has online: false; it has no online features", transient=False
        )
    ready, detail = _ready(view)
    if not ready:
        raise ResolveError("FeatureViewNotReady", f"waiting for FeatureView {name} to be Ready ({detail})")
    url = (view.get("status") or {}).get("url") or server_url(namespace, spec.project)
    return EnrichmentConfig(
        url=url,
        feature_view=feast_view_name(name),
        features=[EnrichedFeature(name=f.name, dtype=f.dtype) for f in spec.features],
        entity_keys=list(features.entity_keys),
    )
