"""Loom's images: the chart names none (Loom publishes none), `make images push` pushes them to a real registry,
and a digest-pinned install names exactly what was pushed (issue 32).

The registry is the local stack's CNCF distribution registry (devstack/cluster/go/registry, started by
`loom dev up` on loopback, plain HTTP). The images pushed are small stand-ins that buildah builds here in under a
second each (loom.e2e.stack_images.build_stand_ins): the real five take half an hour (images/README.md), and the
push, the digests and the chart's references do not depend on what the layers hold. Every reference the chart
renders is then looked up in the registry through its HTTP API v2, as a runtime pulling it would.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.images import REPO
from loom.e2e.helm_operator import CHART, helm
from loom.e2e.stack_images import build_stand_ins, push_tool
from loom.operator.settings import OperatorSettings

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(300)]

push = push_tool()
VERSION = push.app_version()
# LOOM_<KEY>_IMAGE and the image each names (the InferenceGraph router runs the server image).
WORKLOAD_ENV = {f"LOOM_{key.upper()}_IMAGE": name for key, name in push.WORKLOADS.items()}
MANIFEST_TYPES = "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"


def rendered(cluster: Cluster, *args: str) -> tuple[str, dict[str, str]]:
    """The operator's image and its LOOM_*_IMAGE variables, from `helm template` with these arguments."""
    docs = [d for d in yaml.safe_load_all(helm(cluster, "template", "t", str(CHART), *args).stdout) if d]
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if e["name"] in WORKLOAD_ENV}
    return container["image"], env


@pytest.fixture(scope="module")
def registry(cluster: Cluster) -> str:
    """host:port of the stack's registry, answering."""
    assert cluster.registry, "this stack runs no image registry (started before it existed): `loom dev up` again"
    assert httpx.get(f"http://{cluster.registry}/v2/", timeout=10).status_code == 200
    return cluster.registry


def test_helm_template_without_image_values_fails_naming_the_value(cluster: Cluster) -> None:
    bare = helm(cluster, "template", "t", str(CHART), check=False)
    assert bare.returncode != 0 and "/image/registry" in bare.stderr, bare.stderr  # the value to set
    # Past the schema (--skip-schema-validation), the template itself refuses, saying what to set.
    unchecked = helm(cluster, "template", "t", str(CHART), "--skip-schema-validation", check=False)
    assert unchecked.returncode != 0 and "set image.registry" in unchecked.stderr, unchecked.stderr
    # A registry path without a host would resolve to the default public registry's namespace of that name.
    unqualified = helm(cluster, "template", "t", str(CHART), "--set", "image.registry=loom", check=False)
    assert unqualified.returncode != 0 and "/image/registry" in unqualified.stderr, unqualified.stderr
    # The operator image alone leaves the workload images without one.
    operator_only = ("--set", "image.repository=registry.example.com/loom/operator")
    alone = helm(cluster, "template", "t", str(CHART), *operator_only, "--skip-schema-validation", check=False)
    assert alone.returncode != 0 and "workloadImages.trainer.repository" in alone.stderr, alone.stderr


def test_image_registry_renders_into_the_operator_and_every_workload_image(cluster: Cluster) -> None:
    image, env = rendered(cluster, "--set", "image.registry=registry.example.com/ml")
    assert image == f"registry.example.com/ml/operator:{VERSION}"
    assert env == {key: f"registry.example.com/ml/{name}:{VERSION}" for key, name in WORKLOAD_ENV.items()}
    # The operator starts with exactly these (it refuses unqualified ones) and hands them to the pods it renders.
    settings = OperatorSettings.from_env(env)
    assert settings.router_image == settings.server_image == f"registry.example.com/ml/server:{VERSION}"


def manifest(registry: str, reference: str) -> tuple[int, dict[str, Any]]:
    """GET /v2/<name>/manifests/<digest> for `<registry>/<name>@<digest>`, checked against the digest it names;
    (status, manifest)."""
    name, _, digest = reference.removeprefix(f"{registry}/").partition("@")
    assert digest.startswith("sha256:"), f"{reference} is not pinned by digest"
    response = httpx.get(f"http://{registry}/v2/{name}/manifests/{digest}", headers={"Accept": MANIFEST_TYPES})
    if response.status_code != 200:
        return response.status_code, {}
    assert response.headers["Docker-Content-Digest"] == digest
    assert "sha256:" + hashlib.sha256(response.content).hexdigest() == digest  # the content is what it names
    return 200, dict(response.json())


def labels(registry: str, reference: str, body: dict[str, Any]) -> dict[str, str]:
    """The image config's labels (its config blob, fetched by digest)."""
    name = reference.removeprefix(f"{registry}/").partition("@")[0]
    blob = httpx.get(f"http://{registry}/v2/{name}/blobs/{body['config']['digest']}", follow_redirects=True)
    assert blob.status_code == 200
    return dict(blob.json()["config"].get("Labels") or {})


def test_make_images_push_then_a_digest_pinned_install_resolves_in_the_registry(
    cluster: Cluster, registry: str, tmp_path: Path
) -> None:
    build_stand_ins(tmp_path)
    target = f"{registry}/loom-{tmp_path.name[-6:].lower()}"  # a path of this test's own
    env = {**cluster.env, "LOOM_IMAGES_STATE": str(tmp_path)}
    result = subprocess.run(
        ["make", "-C", str(REPO), "--no-print-directory", "push", f"REGISTRY={target}", "TLS_VERIFY=false"],
        env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # It prints the helm flags and writes the same values for `helm install -f`.
    values = json.loads((tmp_path / "pushed-values.yaml").read_text())
    flags = " ".join(push.helm_flags(values))
    assert flags in result.stdout and f"--set image.registry={target}" in flags
    # Each image is in the registry under the chart's appVersion tag, and the tag names the printed digest.
    repository = target.split("/", 1)[1]
    for name in push.NAMES:
        url = f"http://{registry}/v2/{repository}/{name}/manifests/{VERSION}"
        by_tag = httpx.head(url, headers={"Accept": MANIFEST_TYPES}, timeout=10)
        digest = values["image"]["digest"] if name == "operator" else values["workloadImages"][name]["digest"]
        assert by_tag.status_code == 200 and by_tag.headers["Docker-Content-Digest"] == digest, name

    # The chart rendered with those values: every reference pinned, and each resolves to the image it should be.
    image, workload_env = rendered(cluster, "-f", str(tmp_path / "pushed-values.yaml"))
    references = [("operator", image)] + [(WORKLOAD_ENV[key], ref) for key, ref in sorted(workload_env.items())]
    assert len(references) == 6  # the operator, trainer, server, router, features and vllm
    for name, reference in references:
        assert reference.startswith(f"{target}/{name}@sha256:"), reference
        status, body = manifest(registry, reference)
        assert status == 200, reference
        assert labels(registry, reference, body)["dev.loom.image"] == name, reference
    # The lookup can fail: a digest the registry never received is not found.
    missing = image.rsplit("@", 1)[0] + "@sha256:" + "0" * 64
    assert manifest(registry, missing)[0] == 404
