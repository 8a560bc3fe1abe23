"""The vector feature's I/O edge: where each embedding service's model comes from, and passes of the views an
embedding service embeds for when its model changes.

The model source (the InferenceService's spec.model, `config.model_source`) is recorded with the model's name as
the vector index's model identity (loom.workloads.features.embedding): a new model under the same name is then
another model, and materialization stops (ReembedNeeded) instead of mixing two models' vectors in one index.
"""

from __future__ import annotations

from typing import Any

import kopf

from ....core import client as kube
from ....core.model import API_VERSION, GROUP, VERSION
from ....core.runner import LastSeen, Runner
from ..config import Member, model_source

KIND = "FeatureView"


async def model_sources(namespace: str, members: list[Member]) -> dict[str, str]:
    """Embedding service name -> its model source, for the services the project's views embed with (read from the
    watch cache); a service that does not exist yet is left out."""
    vectors = [m.spec.vector for m in members if m.spec.vector is not None]
    sources: dict[str, str] = {}
    for service in sorted({v.embedding.service for v in vectors if v.embedding is not None}):
        source = model_source(await kube.get(API_VERSION, "InferenceService", namespace, service))
        if source is not None:
            sources[service] = source
    return sources


def register_embedder_trigger(runner: Runner) -> None:
    """An embedding service whose model changes: a pass of each view it embeds for, so the project's config
    carries the new model source before a materialization embeds with the new model under the old identity."""
    seen: LastSeen[str | None] = LastSeen()

    @kopf.on.event(GROUP, VERSION, "inferenceservices")
    async def _embedder_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
        meta = body.get("metadata", {})
        namespace, service = meta.get("namespace"), meta.get("name")
        if not namespace or not service:
            return
        if type == "DELETED":
            seen.forget((namespace, service))
        elif not seen.changed((namespace, service), model_source(dict(body))):
            return
        for obj in await kube.list_objects(API_VERSION, KIND, namespace):
            embedding = ((obj.get("spec") or {}).get("vector") or {}).get("embedding") or {}
            if embedding.get("service") == service:
                await runner.trigger(namespace, obj["metadata"]["name"])
