"""images/push.py (`make images push`) without a registry: the tag it pushes, the registries it refuses, and the
values and flags it prints, which must install exactly the pushed images. The push itself, with buildah to the
local stack's registry, is e2e/tests/test_image_registry.py."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from loom.e2e.stack_images import push_tool

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "loom"
push = push_tool()
DIGESTS = {name: f"sha256:{i}" + "a" * 63 for i, name in enumerate(push.NAMES)}


def test_the_images_are_tagged_with_the_charts_app_version_which_is_the_packages_version() -> None:
    assert push.app_version() == yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    # `loom --version` in the operator image reports the package's version: the same one.
    assert push.app_version() == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


@pytest.mark.parametrize("registry", ["registry.example.com/loom", "127.0.0.1:5000/loom", "localhost/a/b", "r.io/"])
def test_a_registry_with_a_host_is_taken(registry: str) -> None:
    assert push.check_registry(registry) == registry.rstrip("/")


@pytest.mark.parametrize("registry", ["", "loom", "loom/images", "https://registry.example.com/loom", "r.io/Loom"])
def test_a_registry_without_a_host_is_refused_saying_what_to_set(registry: str) -> None:
    with pytest.raises(ValueError, match=r"REGISTRY=.*registry host and path"):
        push.check_registry(registry)


def test_the_values_pin_every_image_and_pass_the_charts_schema() -> None:
    values = push.helm_values("registry.example.com/loom", DIGESTS)
    assert values == {
        "image": {"registry": "registry.example.com/loom", "digest": DIGESTS["operator"]},
        "workloadImages": {
            "trainer": {"digest": DIGESTS["trainer"]},
            "server": {"digest": DIGESTS["server"]},
            "router": {"digest": DIGESTS["server"]},  # the InferenceGraph router runs the server image
            "features": {"digest": DIGESTS["features"]},
            "vllm": {"digest": DIGESTS["vllm"]},
        },
    }
    chart: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    for key, value in values.items():
        for field, inner in value.items():  # type: ignore[attr-defined]
            chart[key][field] = {**chart[key][field], **inner} if isinstance(inner, dict) else inner
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert list(jsonschema.Draft7Validator(schema).iter_errors(chart)) == []


def test_the_flags_set_the_same_values() -> None:
    values = push.helm_values("r.io/loom", {"operator": DIGESTS["operator"], "server": DIGESTS["server"]})
    assert push.helm_flags(values) == [
        "--set", "image.registry=r.io/loom",
        "--set", f"image.digest={DIGESTS['operator']}",
        "--set", f"workloadImages.server.digest={DIGESTS['server']}",
        "--set", f"workloadImages.router.digest={DIGESTS['server']}",
    ]  # fmt: skip


def test_a_digest_that_is_not_sha256_is_refused() -> None:
    with pytest.raises(ValueError, match="sha256"):
        push.helm_values("r.io/loom", {"operator": "sha256:short"})
    with pytest.raises(ValueError, match="not an image of Loom"):
        push.helm_values("r.io/loom", {"router": DIGESTS["server"]})
