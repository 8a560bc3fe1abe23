"""InferenceService spec.features: the FeatureView whose online features enrich each request (the default runtime)."""

from __future__ import annotations

from pydantic import Field

from ....core.model import ApiModel, DnsName


class FeatureEnrichment(ApiModel):
    feature_view: DnsName = Field(description="FeatureView whose online features enrich requests.")
    entity_keys: list[str] = Field(min_length=1, max_length=16, description="Request inputs used as entity keys.")
