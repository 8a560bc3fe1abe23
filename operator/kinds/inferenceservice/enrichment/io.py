"""Feature enrichment's edge and hook: the FeatureView spec.features names, read each pass and resolved (resolve.py).

Until the view exists and is Ready the service waits with a condition saying so (its model does not resolve), and
a server already running keeps the features it was rendered with.
"""

from __future__ import annotations

from loom.workloads.server.config import EnrichmentConfig

from ....core import client as kube
from ....core.model import API_VERSION
from ..api import InferenceServiceSpec
from ..feature import Feature, Observed, ServicePass
from ..source.model import ResolveError
from .resolve import resolve_features


async def read_features(
    spec: InferenceServiceSpec, namespace: str
) -> tuple[EnrichmentConfig | None, ResolveError | None]:
    if spec.features is None:
        return None, None
    view = await kube.get(API_VERSION, "FeatureView", namespace, spec.features.feature_view)
    try:
        return resolve_features(spec.features, view, namespace), None
    except ResolveError as err:
        return None, err


class EnrichmentFeature(Feature):
    """spec.features: requests enriched with a FeatureView's online features (the default runtime)."""

    async def observe(self, p: ServicePass, seen: Observed) -> None:
        if not p.ctx.valid:
            return
        seen.features, seen.features_error = await read_features(p.spec, p.ctx.namespace)
        if seen.features_error is not None:
            seen.desired = None  # nothing is rendered without the features its model was written for
            seen.resolve_error = seen.resolve_error or seen.features_error
