"""A model folder as an OCI image (pure): which files share a layer, the image config, the manifests and the index.

What a container runtime mounts: Kubernetes' image volumes (and containerd's CRI behind them) unpack an image's
layers into a read-only filesystem, which only works for regular layer media types
(`application/vnd.oci.image.layer.v1.tar`) under a regular image config. So the layers are plain tars of the folder's
files at their relative paths (the volume *is* the model folder), and the CNCF ModelPack spec is followed where the
runtime does not care: the manifest's `artifactType` is ModelPack's, every layer that holds one file names it with
ModelPack's `org.cncf.model.filepath`, and the config carries the model's name and version as labels. ModelPack's own
layer and config media types (`application/vnd.cncf.model.weight.v1.tar`, ...) are what a runtime refuses to
unpack, so they are not used.

Layers: every file of at least `large_file_bytes` is a layer of its own, the rest share one. A layer's bytes depend
only on its files' paths and contents (tar entries without times or owners: layers.py), so an unchanged file is the
same blob in the next version: a new adapter pushes the adapter, never the base weights again. The image is an index
of one manifest per platform (linux/amd64, linux/arm64), all naming the same layers: a runtime picks the manifest of
its node's platform, and a model has none of its own.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_TYPES = (INDEX_MEDIA_TYPE, MANIFEST_MEDIA_TYPE, DOCKER_LIST_MEDIA_TYPE, DOCKER_MANIFEST_MEDIA_TYPE)
# CNCF ModelPack (model-spec): the manifest's artifactType and a layer's file path.
MODELPACK_ARTIFACT_TYPE = "application/vnd.cncf.model.manifest.v1+json"
FILEPATH_ANNOTATION = "org.cncf.model.filepath"
TITLE_ANNOTATION = "org.opencontainers.image.title"
VERSION_ANNOTATION = "org.opencontainers.image.version"
# Loom's own mark, in the config's labels and the manifest's annotations: what `model.uri: oci://` accepts.
MODEL_LABEL = "dev.loom.model"
MODEL_VERSION_LABEL = "dev.loom.model.version"
DEFAULT_LARGE_FILE_BYTES = 1 << 20
PLATFORMS = (("linux", "amd64"), ("linux", "arm64"))


@dataclass(frozen=True)
class Blob:
    """Content addressed by its SHA-256, with its media type (for a manifest's descriptor)."""

    media_type: str
    data: bytes

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.data).hexdigest()

    def descriptor(self, **extra: Any) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data), **extra}


@dataclass(frozen=True)
class Layer:
    """A written layer: its files (relative paths), digest (also its diff id: it is not compressed) and size."""

    files: tuple[str, ...]
    digest: str
    size: int

    def descriptor(self) -> dict[str, Any]:
        annotations = {FILEPATH_ANNOTATION: self.files[0]} if len(self.files) == 1 else {}
        descriptor: dict[str, Any] = {"mediaType": LAYER_MEDIA_TYPE, "digest": self.digest, "size": self.size}
        return {**descriptor, "annotations": annotations} if annotations else descriptor


@dataclass(frozen=True)
class ModelImage:
    """What a push uploads: the layers (written by layers.py), then the configs and manifests, the index last."""

    layers: tuple[Layer, ...]
    blobs: tuple[Blob, ...]  # the configs
    manifests: tuple[Blob, ...]
    index: Blob

    @property
    def digest(self) -> str:
        return self.index.digest


def plan_layers(files: dict[str, int], large_file_bytes: int = DEFAULT_LARGE_FILE_BYTES) -> list[tuple[str, ...]]:
    """Which files go together: {relative path: size} -> layers, each large file alone, the small ones together
    (first, in path order), so the plan of a folder is always the same."""
    if not files:
        raise ValueError("the model folder has no files")
    small = tuple(sorted(path for path, size in files.items() if size < large_file_bytes))
    large = [(path,) for path in sorted(path for path, size in files.items() if size >= large_file_bytes)]
    return ([small] if small else []) + large


def _canonical(document: dict[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def model_image(layers: list[Layer], name: str, version: str | None = None) -> ModelImage:
    """The configs, manifests and index over written layers. Nothing here depends on the time or the machine: the
    same folder pushed twice is the same digest."""
    labels = {MODEL_LABEL: name, **({MODEL_VERSION_LABEL: version} if version else {})}
    annotations = {MODEL_LABEL: name, TITLE_ANNOTATION: name, **({VERSION_ANNOTATION: version} if version else {})}
    configs, manifests, entries = [], [], []
    for os_name, architecture in PLATFORMS:
        config = Blob(CONFIG_MEDIA_TYPE, _canonical({
            "architecture": architecture,
            "os": os_name,
            "config": {"Labels": labels},
            "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in layers]},
        }))  # fmt: skip
        manifest = Blob(MANIFEST_MEDIA_TYPE, _canonical({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "artifactType": MODELPACK_ARTIFACT_TYPE,
            "config": config.descriptor(),
            "layers": [layer.descriptor() for layer in layers],
            "annotations": annotations,
        }))  # fmt: skip
        configs.append(config)
        manifests.append(manifest)
        entries.append(manifest.descriptor(platform={"os": os_name, "architecture": architecture}))
    index = Blob(INDEX_MEDIA_TYPE, _canonical({
        "schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": entries, "annotations": annotations,
    }))  # fmt: skip
    return ModelImage(tuple(layers), tuple(configs), tuple(manifests), index)


def is_model_manifest(manifest: dict[str, Any]) -> bool:
    """A manifest (or index) Loom pushed, or any ModelPack image with regular layers: what a pod can mount as its
    model folder. An application image is not one: mounted as a model it would fail only when the server loads it."""
    if manifest.get("artifactType") == MODELPACK_ARTIFACT_TYPE or MODEL_LABEL in (manifest.get("annotations") or {}):
        return all(layer.get("mediaType") == LAYER_MEDIA_TYPE for layer in manifest.get("layers") or [])
    return False


def model_name_of(manifest: dict[str, Any]) -> str | None:
    annotations = manifest.get("annotations") or {}
    return annotations.get(MODEL_LABEL) or annotations.get(TITLE_ANNOTATION)


def platform_manifest(index: dict[str, Any], os_name: str = "linux", architecture: str = "amd64") -> dict[str, Any]:
    """The descriptor of the index's manifest for a platform, else its first (a model's layers are the same in all)."""
    entries = index.get("manifests") or []
    if not entries:
        raise ValueError("the image index lists no manifest")
    for entry in entries:
        platform = entry.get("platform") or {}
        if (platform.get("os"), platform.get("architecture")) == (os_name, architecture):
            return dict(entry)
    return dict(entries[0])
