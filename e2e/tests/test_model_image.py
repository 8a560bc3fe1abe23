"""`loom model push` and `loom model pull` against the local stack's registry (CNCF distribution, its HTTP API as any
registry speaks it; issue 48): a model folder round-trips byte for byte, a second push of the same folder sends no
layer, a new adapter sends only the adapter, a tag names the digest the push printed; a digest the registry never
received and an image that is not a model are refused with errors that say so.
The node agent's image volumes (it has no runtime: it unpacks the layers itself) use the same pull. Whether a real
runtime mounts what was pushed: e2e/tests/test_model_oci_real_node.py (containerd on the real node)."""

from __future__ import annotations

import filecmp
import json
import os
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from loom.client.model_image import model
from loom.devstack.agent.plan import ConfigError
from loom.devstack.agent.volumes import pull_image
from loom.devstack.cluster import Cluster
from loom.workloads.common.oci.image import CONFIG_MEDIA_TYPE, MANIFEST_MEDIA_TYPE, Blob
from loom.workloads.common.oci.reference import parse_reference
from loom.workloads.common.oci.registry import Registry, RegistryError
from loom.workloads.common.oci.transfer import pull_folder, resolve

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(120)]
LARGE = 1 << 20


def run(*args: str) -> tuple[str, str]:
    """`loom model ...`: (stdout, stderr); fails the test on a non-zero exit."""
    result = CliRunner().invoke(model, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout.strip(), result.stderr.strip()


def uploaded(stderr: str) -> int:
    """The layer bytes a push says it sent ("pushed 3 layers: N bytes uploaded, M already in the registry")."""
    return int(stderr.split(": ", 1)[1].split(" bytes uploaded")[0])


def same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files_a)


def test_a_model_folder_round_trips_and_unchanged_layers_are_never_sent_again(
    cluster: Cluster, tmp_path: Path
) -> None:
    assert cluster.registry, "this stack runs no image registry: `loom dev up` again"
    source = tmp_path / "model"
    (source / "adapters" / "support").mkdir(parents=True)
    (source / "weights.safetensors").write_bytes(os.urandom(3 * LARGE))  # a layer of its own
    (source / "adapters" / "support" / "adapter.bin").write_bytes(os.urandom(LARGE + 5))  # another
    (source / "config.json").write_text('{"n_layer": 1}')  # the small ones share a layer
    (source / "adapters" / "support" / "config.json").write_text("{}")
    repository = f"{cluster.registry}/e2e-{uuid.uuid4().hex[:8]}/chargpt"

    first, said = run("push", str(source), f"{repository}:v1")
    assert first.startswith(f"oci://{repository}@sha256:") and "pushed 3 layers" in said
    assert uploaded(said) > 4 * LARGE
    again, said = run("push", str(source), f"{repository}:v1")
    assert again == first and uploaded(said) == 0  # the same folder is the same image: nothing sent

    # A new adapter: only its layer goes over the wire, the base weights stay where they are.
    (source / "adapters" / "support" / "adapter.bin").write_bytes(os.urandom(LARGE + 5))
    second, said = run("push", str(source), f"{repository}:v2")
    assert second != first and LARGE < uploaded(said) < 2 * LARGE

    # Pulled back by tag: byte for byte the folder pushed, and the tag names the digest the push printed.
    out, said = run("pull", f"{repository}:v2", str(tmp_path / "pulled"))
    assert out == second and same_tree(source, tmp_path / "pulled")
    image = parse_reference(f"{repository}:v1")
    with Registry(image.registry) as registry:
        pinned, _ = resolve(image, registry)
        assert pinned.uri == first
        pulled = pull_folder(parse_reference(first), registry, tmp_path / "v1")
    assert pulled.fetched_bytes > 4 * LARGE and (tmp_path / "v1" / "weights.safetensors").read_bytes() == (
        source / "weights.safetensors"
    ).read_bytes()


def test_a_missing_digest_and_an_image_that_is_not_a_model_are_refused(cluster: Cluster, tmp_path: Path) -> None:
    repository = f"e2e-{uuid.uuid4().hex[:8]}/app"
    with Registry(cluster.registry) as registry:
        missing = parse_reference(f"{cluster.registry}/{repository}@sha256:{'0' * 64}")
        with pytest.raises(RegistryError) as not_found:
            resolve(missing, registry)
        assert not_found.value.kind == "NotFound" and f"{repository}@sha256:{'0' * 64} not found" in str(
            not_found.value
        )
        # An application image (an image config, a gzip layer, no model annotation) pushed under a tag.
        config = Blob(CONFIG_MEDIA_TYPE, b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers"}}')
        registry.upload_blob(repository, config.digest, config.data)
        document = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE, "config": config.descriptor(), "layers": []}
        app = Blob(MANIFEST_MEDIA_TYPE, json.dumps(document).encode())
        registry.put_manifest(repository, "app", app.media_type, app.data)
        with pytest.raises(RegistryError) as not_a_model:
            resolve(parse_reference(f"{cluster.registry}/{repository}:app"), registry)
        assert not_a_model.value.kind == "NotAModel" and "is not a model image" in str(not_a_model.value)
    failed = CliRunner().invoke(model, ["pull", f"{cluster.registry}/{repository}:app", str(tmp_path / "x")])
    assert failed.exit_code != 0 and "is not a model image" in failed.output


def test_the_node_agent_unpacks_an_image_volume_itself(cluster: Cluster, tmp_path: Path) -> None:
    """The node agent has no container runtime: it unpacks a model image's layers into the pod's volume folder
    (devstack/agent/volumes.pull_image); a pull that cannot be done is the container's ErrImagePull."""
    source = tmp_path / "model"
    source.mkdir()
    (source / "weights.bin").write_bytes(os.urandom(LARGE + 1))
    (source / "config.json").write_text("{}")
    image, _ = run("push", str(source), f"{cluster.registry}/e2e-{uuid.uuid4().hex[:8]}/agent:v1")
    folder = tmp_path / "pod" / "volumes" / "model-image"
    folder.mkdir(parents=True)  # an earlier attempt's empty folder
    volume = {"name": "model-image", "image": {"reference": image.removeprefix("oci://"), "pullPolicy": "IfNotPresent"}}
    pull_image(volume, folder)
    assert same_tree(source, folder) and not folder.with_name("model-image.pulling").exists()
    pull_image(volume, folder)  # a restarted pod keeps what it has
    missing = {**volume, "image": {"reference": image.removeprefix("oci://").split("@")[0] + "@sha256:" + "0" * 64}}
    with pytest.raises(ConfigError) as failed:
        pull_image(missing, tmp_path / "other")
    assert failed.value.reason == "ErrImagePull" and "not found" in failed.value.message
