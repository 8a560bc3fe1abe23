"""What tests need beside the local stack's image names (loom.devstack.images, imported from there): the chart's
values, the push tool, stand-in images, distinct image settings. The vllm image runs from the checkout's
.venv-vllm on the stack (loom.devstack.cluster.paths.AGENT_IMAGE_ENVIRONMENTS).
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

from loom.devstack.images import REGISTRY, REPO, WORKLOADS

# For a test's `helm install`: every Loom image from one registry path.
CHART_VALUES: dict[str, dict[str, str]] = {"image": {"registry": REGISTRY}}


def push_tool() -> ModuleType:
    """images/push.py (`make images push`), a standard-library script outside the package, as a module."""
    spec = importlib.util.spec_from_file_location("loom_images_push", REPO / "images" / "push.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(argv: list[str]) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout.strip()


def build_stand_ins(
    state: Path, names: tuple[str, ...] = ("operator", "trainer", "server", "features", "vllm")
) -> None:
    """The smallest images buildah builds, under the names images/build.sh gives the real ones
    (localhost/loom/<name>:<appVersion>) in the storage `make push` pushes from: `scratch` plus one file and a label
    naming the image, so that each has its own digest (a push that swapped two would be caught). Under a second
    each; the real five take longer (images/README.md), and pushing, digests and the chart's references do
    not depend on what the layers hold."""
    buildah = ["buildah", "--root", str(state / "storage"), "--runroot", str(state / "run"), "--storage-driver", "vfs"]
    version = push_tool().app_version()
    for name in names:
        content = state / f"{name}.txt"
        content.write_text(f"a stand-in for the loom/{name} image in a test of `make images push`\n")
        ctr = _run([*buildah, "from", "scratch"])
        _run([*buildah, "copy", "--quiet", ctr, str(content), "/stand-in.txt"])
        _run([*buildah, "config", "--label", f"dev.loom.image={name}", ctr])
        target = f"localhost/loom/{name}:{version}"
        _run([*buildah, "commit", "--quiet", "--rm", ctr, target])


def pod_images(manifest: dict[str, Any]) -> set[str]:
    """Every container image of a Pod, or of the pod template of a Deployment, Job or CronJob."""
    spec = manifest.get("spec") or {}
    if manifest.get("kind") == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    pod = spec["template"]["spec"] if "template" in spec else spec
    return {c["image"] for key in ("initContainers", "containers") for c in pod.get(key) or []}


# Distinct images per setting, from a registry no default could name: a pod showing one proves which setting fed it.
DISTINCT_IMAGE_SETTINGS: dict[str, str] = {
    f"{key}_image": f"registry.test/wired/{key}@sha256:{index}" + "0" * 63 for index, key in enumerate(WORKLOADS)
}
