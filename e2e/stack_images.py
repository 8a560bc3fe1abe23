"""The images test installs and test operators name.

Loom publishes no image, so the chart and the operator have no default (issue 32). The local stack's node agent
records a pod's image and runs this checkout's code, so nothing is pulled there: tests name the images
`make images` builds on this machine (buildah gives local images the `localhost/` prefix), a qualified name no
registry namespace of anyone else can answer to.
"""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
VERSION: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
REGISTRY = "localhost/loom"
# The workload images the operator puts into pods; the router runs from the server image.
WORKLOADS = {"trainer": "trainer", "server": "server", "router": "server", "features": "features"}


def image(name: str, registry: str = REGISTRY) -> str:
    return f"{registry}/{name}:{VERSION}"


# For OperatorSettings(**IMAGE_SETTINGS, ...), and the environment of a `loom operator` process.
IMAGE_SETTINGS: dict[str, str] = {f"{key}_image": image(name) for key, name in WORKLOADS.items()}
IMAGE_ENV: dict[str, str] = {f"LOOM_{key.upper()}": value for key, value in IMAGE_SETTINGS.items()}
# For a test's `helm install`: every Loom image from one registry path.
CHART_VALUES: dict[str, dict[str, str]] = {"image": {"registry": REGISTRY}}


def push_tool() -> ModuleType:
    """images/push.py (`make images push`), a standard-library script outside the package, as a module."""
    spec = importlib.util.spec_from_file_location("loom_images_push", REPO / "images" / "push.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
