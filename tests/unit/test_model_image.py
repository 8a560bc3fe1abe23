"""Models as OCI images, the pure parts (loom.workloads.common.oci): references, the layer plan, deterministic layers,
the manifests a runtime mounts, and the unpacking's refusals. The push and pull against the stack's real registry:
e2e/tests/test_model_image.py."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from loom.workloads.common.oci.image import (
    FILEPATH_ANNOTATION,
    LAYER_MEDIA_TYPE,
    MODELPACK_ARTIFACT_TYPE,
    is_model_manifest,
    model_image,
    plan_layers,
    platform_manifest,
)
from loom.workloads.common.oci.layers import extract_layer, folder_files, write_layer
from loom.workloads.common.oci.reference import ReferenceError, parse_reference, registry_base_url

DIGEST = "sha256:" + "ab" * 32


def test_references_parse_print_and_pin() -> None:
    image = parse_reference("oci://registry.example.com:5000/ml/chargpt:v3")
    assert (image.registry, image.repository, image.tag, image.digest) == ("registry.example.com:5000", "ml/chargpt",
                                                                           "v3", None)  # fmt: skip
    assert image.reference == "v3" and str(image) == "registry.example.com:5000/ml/chargpt:v3"
    pinned = image.pinned(DIGEST)
    assert pinned.uri == f"oci://registry.example.com:5000/ml/chargpt@{DIGEST}" and pinned.reference == DIGEST
    both = parse_reference(f"localhost/m:v1@{DIGEST}")
    assert (both.tag, both.digest, both.reference) == ("v1", DIGEST, DIGEST)  # the digest wins
    assert parse_reference("127.0.0.1:5000/m").reference == "latest"


@pytest.mark.parametrize("text", [
    "team/model",  # no registry host: would mean the default public registry's namespace
    "registry.example.com/Upper/case",
    "registry.example.com/m@sha256:short",
    "registry.example.com/",
    "s3://bucket/model",
])  # fmt: skip
def test_bad_references_are_refused_saying_what_is_expected(text: str) -> None:
    with pytest.raises(ReferenceError, match="expected \\[oci://\\]<registry host>/<repository>"):
        parse_reference(text)


def test_plain_http_only_on_loopback() -> None:
    assert registry_base_url("127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert registry_base_url("localhost") == "http://localhost"
    assert registry_base_url("registry.example.com") == "https://registry.example.com"
    assert registry_base_url("127.0.0.1.example.com") == "https://127.0.0.1.example.com"


def test_each_large_file_is_a_layer_of_its_own_and_small_ones_share_one() -> None:
    files = {"config.json": 10, "tokenizer.json": 999, "model.safetensors": 5000, "adapters/a/weights.bin": 1000}
    assert plan_layers(files, large_file_bytes=1000) == [
        ("config.json", "tokenizer.json"), ("adapters/a/weights.bin",), ("model.safetensors",),
    ]  # fmt: skip
    assert plan_layers({"only.bin": 5000}, large_file_bytes=1000) == [("only.bin",)]
    with pytest.raises(ValueError, match="no files"):
        plan_layers({})


def _folder(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_a_layer_depends_only_on_its_files_paths_and_contents(tmp_path: Path) -> None:
    files = {"weights.bin": os.urandom(4096), "sub/dir/adapter.bin": b"adapter"}
    one = _folder(tmp_path / "one", files)
    two = _folder(tmp_path / "two", files)
    os.utime(two / "weights.bin", (1, 1))  # another time, another mode: the same layer
    (two / "weights.bin").chmod(0o600)
    first = write_layer(one, sorted(files), tmp_path / "one.tar")
    second = write_layer(two, reversed(sorted(files)), tmp_path / "two.tar")
    assert first == second and (tmp_path / "one.tar").read_bytes() == (tmp_path / "two.tar").read_bytes()
    assert first.size == (tmp_path / "one.tar").stat().st_size
    with tarfile.open(tmp_path / "one.tar") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert list(members) == ["sub", "sub/dir", "sub/dir/adapter.bin", "weights.bin"]  # parents first
    assert {(m.mtime, m.uid, m.mode) for m in members.values() if m.isfile()} == {(0, 0, 0o644)}
    (two / "weights.bin").write_bytes(os.urandom(4096))
    assert write_layer(two, ["weights.bin"], tmp_path / "three.tar").digest != first.digest


def test_the_image_is_an_index_of_per_platform_manifests_over_the_same_layers(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m", {"config.json": b"{}", "vocab.txt": b"ab", "weights.bin": os.urandom(2048)})
    plan = plan_layers(folder_files(folder), large_file_bytes=1024)
    layers = [write_layer(folder, files, tmp_path / f"{i}.tar") for i, files in enumerate(plan)]
    image = model_image(layers, "chargpt", "7")
    assert image.digest == model_image(layers, "chargpt", "7").digest  # no time, no host: the same digest
    assert image.digest != model_image(layers, "chargpt", "8").digest
    index = json.loads(image.index.data)
    assert {(m["platform"]["os"], m["platform"]["architecture"]) for m in index["manifests"]} == {
        ("linux", "amd64"), ("linux", "arm64"),
    }  # fmt: skip
    assert platform_manifest(index, "linux", "arm64")["digest"] == image.manifests[1].digest
    manifest = json.loads(image.manifests[0].data)
    # What a runtime mounts: an image config and plain tar layers; ModelPack's artifactType and file paths beside.
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert manifest["artifactType"] == MODELPACK_ARTIFACT_TYPE
    assert [layer["mediaType"] for layer in manifest["layers"]] == [LAYER_MEDIA_TYPE, LAYER_MEDIA_TYPE]
    assert manifest["layers"][1]["annotations"] == {FILEPATH_ANNOTATION: "weights.bin"}
    assert "annotations" not in manifest["layers"][0]  # the small files' shared layer names no single file
    config = json.loads(image.blobs[0].data)
    assert config["rootfs"]["diff_ids"] == [layer.digest for layer in layers]  # uncompressed: digest = diff id
    assert config["config"]["Labels"] == {"dev.loom.model": "chargpt", "dev.loom.model.version": "7"}
    assert is_model_manifest(manifest) and is_model_manifest(index)


def test_an_application_image_is_not_a_model() -> None:
    app = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "config": {}, "layers": [
        {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": DIGEST, "size": 1}]}  # fmt: skip
    assert not is_model_manifest(app)
    # ModelPack's own layer types are a model, but not one a runtime can mount as a volume.
    modelpack = {"artifactType": MODELPACK_ARTIFACT_TYPE, "layers": [
        {"mediaType": "application/vnd.cncf.model.weight.v1.tar", "digest": DIGEST, "size": 1}]}  # fmt: skip
    assert not is_model_manifest(modelpack)


def _tar(*members: tarfile.TarInfo) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for member in members:
            tar.addfile(member, io.BytesIO(b"x" * member.size) if member.isfile() else None)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("member,why", [
    (tarfile.TarInfo("../escape"), "outside the model folder"),
    (tarfile.TarInfo("/etc/passwd"), "outside the model folder"),
])  # fmt: skip
def test_unpacking_refuses_entries_outside_the_folder(tmp_path: Path, member: tarfile.TarInfo, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        extract_layer(_tar(member), tmp_path / "dest")
    assert not (tmp_path / "escape").exists()


def test_unpacking_refuses_links(tmp_path: Path) -> None:
    link = tarfile.TarInfo("weights.bin")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/shadow"
    with pytest.raises(ValueError, match="not a regular file"):
        extract_layer(_tar(link), tmp_path)


def test_packing_refuses_links(tmp_path: Path) -> None:
    (tmp_path / "real.bin").write_bytes(b"1")
    (tmp_path / "link.bin").symlink_to(tmp_path / "real.bin")
    with pytest.raises(ValueError, match=r"link\.bin: only regular files"):
        folder_files(tmp_path)
