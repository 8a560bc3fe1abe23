"""ServerConfig: the operator-to-server contract (camelCase JSON, validation, torch-free import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from loom.workloads.server.config import RateLimitConfig, ServerConfig, parse_mlflow_uri


def test_camel_case_round_trip(tmp_path: Path) -> None:
    config = ServerConfig.model_validate(
        {
            "modelName": "chargpt",
            "handler": "chargpt",
            "storageUri": "models:/chargpt@champion",
            "batching": {"maxBatchSize": 16, "maxLatencyMs": 2, "maxQueue": 64},
            "auth": {"apiKeysFile": "/etc/loom/keys/keys", "rateLimit": {"requestsPerSecond": 5, "burst": 10}},
            "metricsPort": 9090,
        }
    )
    assert config.resolved_storage_kind == "mlflow"
    assert config.batching.max_batch_size == 16
    assert config.auth.rate_limit is not None and config.auth.rate_limit.burst == 10
    path = tmp_path / "server.json"
    path.write_text(config.to_json())
    assert "maxBatchSize" in json.loads(path.read_text())["batching"]
    assert ServerConfig.from_file(path) == config


def test_snake_case_names_are_accepted_too() -> None:
    assert ServerConfig(model_name="m", model_dir="/cache").model_dir == "/cache"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"handler": "tensorflow"}, "handler must be one of"),
        ({"modelName": "bad/name"}, "modelName must be"),
        ({"storageUri": "models:/a/b/c"}, "models:/name/version"),
        ({"storageUri": "gs://bucket/x", "storageKind": "s3"}, "needs an s3:// storageUri"),
        ({"metricsPort": 8080}, "metricsPort must differ"),
        ({"batching": {"maxBatchSize": 0}}, "greater than or equal to 1"),
        ({"auth": {"rateLimit": {"requestsPerSecond": 0}}}, "greater than 0"),
        ({"unknownField": 1}, "Extra inputs are not permitted"),
    ],
)
def test_bad_configs_are_rejected(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ServerConfig.model_validate({"modelName": "m", **fields})


def test_custom_handler_and_storage_kinds() -> None:
    assert ServerConfig(model_name="m", handler="my_pkg.models:Ranker").handler == "my_pkg.models:Ranker"
    assert ServerConfig(model_name="m", storage_uri="s3://b/p").resolved_storage_kind == "s3"
    checkpoint = ServerConfig(model_name="m", storage_uri="s3://b/job/ckpt", storage_kind="checkpoint")
    assert checkpoint.resolved_storage_kind == "checkpoint"
    assert ServerConfig(model_name="m", storage_uri="/data/model").resolved_storage_kind == "local"


@pytest.mark.parametrize(
    ("uri", "parts"),
    [
        ("models:/m/3", ("m", "3", None)),
        ("models:/m@prod", ("m", None, "prod")),
        ("models:/m/latest", ("m", "latest", None)),
    ],
)
def test_parse_mlflow_uri(uri: str, parts: tuple[str, str | None, str | None]) -> None:
    assert parse_mlflow_uri(uri) == parts


def test_config_imports_without_torch_or_starlette() -> None:
    code = (
        "import sys, loom.workloads.server.config as c; "
        "bad = [m for m in ('torch', 'starlette', 'boto3', 'numpy', 'mlflow') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == ""


def test_defaults_match_what_an_inference_service_renders() -> None:
    config = ServerConfig(model_name="m")
    assert (config.batching.max_batch_size, config.batching.max_latency_ms, config.batching.max_queue) == (8, 10, 256)
    assert RateLimitConfig(requests_per_second=1).burst == 10
