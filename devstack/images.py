"""The image names the local stack answers to. Loom publishes no image, so the chart and the operator have no
default (issue 32). The stack's node agent records a pod's image and runs this checkout's code, so nothing is
pulled: the stack names the images `make images` builds on this machine (buildah gives local images the
`localhost/` prefix), a qualified name no registry namespace of anyone else can answer to. Used by `loom dev env`
(for an operator run here) and by the tests (and beside them, loom.e2e.stack_images)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERSION: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
REGISTRY = "localhost/loom"
# The workload images the operator puts into pods; the router runs from the server image.
WORKLOADS = {"trainer": "trainer", "server": "server", "router": "server", "features": "features", "vllm": "vllm"}


def image(name: str, registry: str = REGISTRY) -> str:
    return f"{registry}/{name}:{VERSION}"


# For OperatorSettings(**IMAGE_SETTINGS, ...), and the environment of a `loom operator` process.
IMAGE_SETTINGS: dict[str, str] = {f"{key}_image": image(name) for key, name in WORKLOADS.items()}
IMAGE_ENV: dict[str, str] = {f"LOOM_{key.upper()}": value for key, value in IMAGE_SETTINGS.items()}
