"""The chart's webhook values: defaults that never block a write for long, and a schema that refuses the rest.
Rendering and the API server's view of the configuration are in e2e/tests/test_admission_webhook.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from loom.devstack.images import IMAGE_SETTINGS
from loom.operator.settings import OperatorSettings

CHART = Path(__file__).resolve().parents[2] / "charts" / "loom"


def webhook_values() -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / "values.yaml").read_text())["webhook"])


def test_defaults_fail_open_quickly_and_warn_about_missing_references() -> None:
    values = webhook_values()
    assert values["enabled"] is True
    assert values["failurePolicy"] == "Ignore" and values["timeoutSeconds"] <= 10
    assert values["missingReferences"] == "Warn"
    assert OperatorSettings(**IMAGE_SETTINGS).webhook_missing_references == "Warn"


@pytest.mark.parametrize(
    "bad",
    [{"failurePolicy": "Sometimes"}, {"timeoutSeconds": 31}, {"timeoutSeconds": 0}, {"missingReferences": "Ignore"}],
)
def test_the_schema_refuses_what_the_api_server_or_operator_would(bad: dict[str, Any]) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["image"]["registry"] = "registry.example.com/loom"  # valid but for `bad` (the defaults name no image)
    jsonschema.validate(values, schema)
    values["webhook"].update(bad)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, schema)


def test_the_template_sends_only_loom_kinds_and_skips_the_operators_own_writes() -> None:
    text = (CHART / "templates" / "webhook.yaml").read_text()
    assert "apiGroups: [loom.dev]" in text and "operations: [CREATE, UPDATE]" in text
    assert "failurePolicy: {{ $.Values.webhook.failurePolicy }}" in text
    assert "request.userInfo.username != 'system:serviceaccount:%s:%s'" in text
    assert 'lookup "v1" "Secret"' in text  # the certificate is kept across upgrades
