"""Push a model folder as an image, pull one back into a folder (the SDK's `loom model push`, the tests' round trip,
the fallback for a node without image volumes).

A push writes each layer to a scratch folder (image.plan_layers decides which files share one), asks the registry
for each blob by digest and uploads only the ones it lacks, then the configs, the per-platform manifests, and the
index under the tag (or by digest alone). What it did is returned: the digest, and how many layer bytes went over
the wire against how many the registry already held.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .image import (
    DEFAULT_LARGE_FILE_BYTES,
    DOCKER_LIST_MEDIA_TYPE,
    INDEX_MEDIA_TYPE,
    MODEL_LABEL,
    is_model_manifest,
    model_image,
    plan_layers,
    platform_manifest,
)
from .layers import extract_layer, folder_files, write_layer
from .reference import ImageReference
from .registry import Registry, RegistryError


@dataclass(frozen=True)
class PushResult:
    image: ImageReference  # by digest
    layers: int
    uploaded_bytes: int  # layer bytes sent
    skipped_bytes: int  # layer bytes the registry already held


@dataclass(frozen=True)
class PullResult:
    image: ImageReference
    files: tuple[str, ...]
    fetched_bytes: int


def push_folder(
    folder: Path, target: ImageReference, registry: Registry, *, name: str | None = None, version: str | None = None,
    large_file_bytes: int = DEFAULT_LARGE_FILE_BYTES, scratch: Path | None = None,
) -> PushResult:  # fmt: skip
    """Pack `folder` and push it to `target` (its tag, if any, is set to the pushed index)."""
    plan = plan_layers(folder_files(folder), large_file_bytes)
    repository = target.repository
    uploaded = skipped = 0
    with tempfile.TemporaryDirectory(dir=scratch, prefix="loom-model-push-") as work:
        layers = []
        for i, files in enumerate(plan):
            path = Path(work) / f"layer-{i}.tar"
            layer = write_layer(folder, files, path)
            layers.append(layer)
            if registry.has_blob(repository, layer.digest):
                skipped += layer.size
            else:
                registry.upload_blob(repository, layer.digest, path)
                uploaded += layer.size
            path.unlink()
        image = model_image(layers, name or target.repository.rsplit("/", 1)[-1], version)
        for blob in image.blobs:
            if not registry.has_blob(repository, blob.digest):
                registry.upload_blob(repository, blob.digest, blob.data)
        for manifest in image.manifests:
            registry.put_manifest(repository, manifest.digest, manifest.media_type, manifest.data)
        digest = registry.put_manifest(repository, target.tag or image.digest, image.index.media_type, image.index.data)
    if digest != image.digest:
        raise RegistryError("Invalid", f"registry {registry.registry} stored the index as {digest}, not {image.digest}")
    return PushResult(target.pinned(image.digest), len(layers), uploaded, skipped)


def resolve(image: ImageReference, registry: Registry) -> tuple[ImageReference, dict[str, Any]]:
    """The image by digest (a tag looked up) and its top manifest or index, refused when it is not a model image."""
    top = registry.manifest(image.repository, image.reference)
    document = top.json()
    if not is_model_manifest(document):
        raise RegistryError(
            "NotAModel",
            f"{image} is not a model image (no ModelPack artifactType or {MODEL_LABEL} annotation with plain tar "
            "layers): push the model folder with `loom model push`",
        )
    return image.pinned(top.digest), document


def pull_folder(image: ImageReference, registry: Registry, dest: Path) -> PullResult:
    """Unpack a model image's layers into `dest` (which must be empty or absent)."""
    if dest.exists() and any(dest.iterdir()):
        raise ValueError(f"{dest} is not empty")
    dest.mkdir(parents=True, exist_ok=True)
    pinned, document = resolve(image, registry)
    if document.get("mediaType") in (INDEX_MEDIA_TYPE, DOCKER_LIST_MEDIA_TYPE) or "manifests" in document:
        entry = platform_manifest(document)
        document = registry.manifest(image.repository, str(entry["digest"])).json()
    before = registry.bytes_received
    files: list[str] = []
    with tempfile.TemporaryDirectory(prefix="loom-model-pull-") as work:
        for layer in document.get("layers") or []:
            blob = Path(work) / "layer.tar"
            with open(blob, "wb") as out:
                registry.blob(image.repository, str(layer["digest"]), out)
            with open(blob, "rb") as stream:
                files += extract_layer(stream, dest)
    return PullResult(pinned, tuple(files), registry.bytes_received - before)
