"""Operator settings and Kopf configuration, and the honest placeholder status."""

from __future__ import annotations

import kopf

from loom.operator.controllers.placeholder import not_implemented_status
from loom.operator.main import configure
from loom.operator.settings import FINALIZER, OperatorSettings


def test_settings_from_env() -> None:
    s = OperatorSettings.from_env({"LOOM_NAMESPACES": "a, b", "LOOM_METRICS_PORT": "9100"})
    assert s.namespaces == ["a", "b"]
    assert s.metrics_port == 9100
    assert OperatorSettings.from_env({}).namespaces == []


def test_kopf_uses_loom_prefix_and_finalizer() -> None:
    settings = kopf.OperatorSettings()
    configure(settings, OperatorSettings(watch_server_timeout_s=120))
    assert settings.persistence.finalizer == FINALIZER == "loom.dev/finalizer"
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert settings.persistence.progress_storage.prefix == "loom.dev"
    assert settings.watching.server_timeout == 120


def test_placeholder_says_not_implemented() -> None:
    status = not_implemented_status("FeatureView", 3, {})
    (ready,) = status["conditions"]
    assert ready["type"] == "Ready" and ready["status"] == "Unknown" and ready["reason"] == "NotImplemented"
    assert ready["observedGeneration"] == 3 and status["observedGeneration"] == 3
