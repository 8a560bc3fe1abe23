"""Resource quantities are checked where a spec is admitted, not first when the operator creates a Pod from it (the
API server checks a quantity only in a Pod: a bad one left a TrainingJob reading "worker pods created" while every
pass failed)."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from loom.operator.core.model import QUANTITY_PATTERN, ResourceRequirements
from loom.operator.kinds.trainingjob.api import TrainingJobSpec


@pytest.mark.parametrize("value", [2, "2", "500m", "1.5", ".5", "4Gi", "400Gi", "1e3", "128974848"])
def test_kubernetes_quantities_are_accepted(value: int | str) -> None:
    assert ResourceRequirements.model_validate({"requests": {"cpu": value}}).requests == {"cpu": value}


@pytest.mark.parametrize("value", ["lots", "2 cores", "1,5", "4GB", ""])
def test_anything_else_is_refused_with_the_field_named(value: str) -> None:
    with pytest.raises(ValidationError, match="is not a Kubernetes quantity"):
        TrainingJobSpec.model_validate({
            "engine": "fsdp", "entrypoint": {"module": "m:t"},
            "workers": {"replicas": 1, "resources": {"requests": {"cpu": value}}},
        })
    assert not re.match(QUANTITY_PATTERN, value)  # the CRD's pattern refuses it at admission too


def test_the_crd_schema_carries_the_pattern() -> None:
    schema = ResourceRequirements.model_json_schema()
    quantity = schema["properties"]["limits"]["anyOf"][0]["additionalProperties"]
    assert quantity["pattern"] == QUANTITY_PATTERN and quantity["x-kubernetes-int-or-string"] is True
