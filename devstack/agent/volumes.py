"""Pod volumes as host folders, and the bind mounts that put them at their mountPaths.

`volume_files` is pure (what files a configMap/secret/downwardAPI/projected volume holds);
`materialize` writes them under the pod's state folder (an image volume: the image's layers unpacked, pull_image);
`refresh_config_maps` rewrites a running pod's configMap
volumes when their ConfigMap changed, as the kubelet does (not subPath mounts of a single file, as there).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.devstack.agent.plan import ClusterData, ConfigError, config_map_data, field_value, secret_data
from loom.workloads.common.oci.reference import ReferenceError, parse_reference
from loom.workloads.common.oci.registry import Registry, RegistryError
from loom.workloads.common.oci.transfer import pull_folder

Obj = dict[str, Any]
FileSet = dict[str, tuple[bytes, int]]  # relative path -> (content, mode)


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = False


def _items(values: dict[str, bytes], items: list[Obj] | None, mode: int, kind: str, name: str) -> FileSet:
    if not items:
        return {key: (value, mode) for key, value in values.items()}
    files: FileSet = {}
    for item in items:
        if item["key"] not in values:
            raise ConfigError("CreateContainerConfigError", f"couldn't find key {item['key']} in {kind} {name}")
        files[item["path"]] = (values[item["key"]], item.get("mode", mode))
    return files


def _source_files(pod: Obj, source: Obj, data: ClusterData, token: str | None, mode: int) -> FileSet:
    if "configMap" in source:
        ref = source["configMap"]
        cm = data.config_maps.get(ref["name"])
        if cm is None:
            if ref.get("optional"):
                return {}
            raise ConfigError("CreateContainerConfigError", f'configmap "{ref["name"]}" not found')
        return _items(config_map_data(cm), ref.get("items"), ref.get("defaultMode", mode), "configmap", ref["name"])
    if "secret" in source:
        ref = source["secret"]
        name = ref.get("secretName") or ref.get("name", "")
        secret = data.secrets.get(name)
        if secret is None:
            if ref.get("optional"):
                return {}
            raise ConfigError("CreateContainerConfigError", f'secret "{name}" not found')
        return _items(secret_data(secret), ref.get("items"), ref.get("defaultMode", mode), "secret", name)
    if "downwardAPI" in source:
        ref = source["downwardAPI"]
        files: FileSet = {}
        for item in ref.get("items") or []:
            if "fieldRef" not in item:
                raise ConfigError("CreateContainerConfigError", "downwardAPI supports fieldRef items only here")
            value = field_value(pod, item["fieldRef"]["fieldPath"]).encode()
            files[item["path"]] = (value, item.get("mode", ref.get("defaultMode", mode)))
        return files
    if "serviceAccountToken" in source:
        if token is None:
            raise ConfigError("CreateContainerConfigError", "service account token not available")
        return {source["serviceAccountToken"]["path"]: (token.encode(), mode)}
    raise ConfigError("CreateContainerConfigError", f"unsupported volume source {sorted(source)}")


def volume_files(pod: Obj, volume: Obj, data: ClusterData, token: str | None) -> FileSet | None:
    """The files a content volume holds, or None for a plain folder (emptyDir, PVC, hostPath)."""
    if "projected" in volume:
        projected = volume["projected"]
        mode = projected.get("defaultMode", 0o644)
        files: FileSet = {}
        for source in projected.get("sources") or []:
            files.update(_source_files(pod, source, data, token, mode))
        return files
    for kind in ("configMap", "secret", "downwardAPI"):
        if kind in volume:
            return _source_files(pod, {kind: volume[kind]}, data, token, 0o644)
    return None


def volume_dir(volume: Obj, pod_dir: Path, state_dir: Path, namespace: str) -> Path:
    """Where a volume lives on the host."""
    name = str(volume["name"])
    if "persistentVolumeClaim" in volume:
        return state_dir / "claims" / namespace / str(volume["persistentVolumeClaim"]["claimName"])
    if "hostPath" in volume:
        return Path(str(volume["hostPath"]["path"]))
    supported = {"emptyDir", "configMap", "secret", "downwardAPI", "projected", "image"}
    if not supported & set(volume):
        kinds = sorted(set(volume) - {"name"})
        raise ConfigError("CreateContainerConfigError", f"volume {name!r}: unsupported type {kinds}")
    return pod_dir / "volumes" / name


def needs_token(pod: Obj) -> list[Obj]:
    """serviceAccountToken projections of the pod (the caller asks the API for each)."""
    return [
        source["serviceAccountToken"]
        for volume in pod["spec"].get("volumes") or []
        for source in (volume.get("projected") or {}).get("sources") or []
        if "serviceAccountToken" in source
    ]


def write_files(folder: Path, files: FileSet) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for relative, (content, mode) in files.items():
        path = folder / relative
        if not path.resolve().is_relative_to(folder.resolve()):
            raise ConfigError("CreateContainerConfigError", f"volume path {relative!r} escapes the volume")
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".loom-tmp")
        partial.write_bytes(content)
        os.chmod(partial, mode)
        partial.replace(path)


def materialize(pod: Obj, pod_dir: Path, state_dir: Path, data: ClusterData, token: str | None) -> dict[str, Path]:
    """Create every volume of the pod on the host; returns volume name -> host folder."""
    namespace = pod["metadata"]["namespace"]
    folders: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes") or []:
        folder = volume_dir(volume, pod_dir, state_dir, namespace)
        files = volume_files(pod, volume, data, token)
        if "hostPath" in volume and not folder.exists():
            if volume["hostPath"].get("type") in ("DirectoryOrCreate", None, ""):
                folder.mkdir(parents=True, exist_ok=True)
            else:
                raise ConfigError("CreateContainerConfigError", f"hostPath {folder} does not exist")
        if "image" in volume:
            pull_image(volume, folder)
        folder.mkdir(parents=True, exist_ok=True)
        if files is not None:
            write_files(folder, files)
        folders[volume["name"]] = folder
    return folders


def pull_image(volume: Obj, folder: Path) -> None:
    """An image volume (Kubernetes' `image` source). The agent runs no container runtime, so it unpacks the image's
    layers itself into the pod's volume folder with `loom model pull`'s code: model images only (plain tar layers),
    and every pod downloads the whole image (no per-node image store as a kubelet's runtime keeps; the real node
    has one). Pulled into a staging folder renamed into place, so a pod restarted mid-pull never sees half an
    image; a pod's folder that holds the image already is kept."""
    if folder.is_dir() and any(folder.iterdir()):
        return
    staging = folder.with_name(folder.name + ".pulling")
    shutil.rmtree(staging, ignore_errors=True)
    source = volume["image"]
    try:
        image = parse_reference(str(source.get("reference", "")))
        with Registry(image.registry) as registry:
            pull_folder(image, registry, staging)
    except (ReferenceError, RegistryError, ValueError, OSError) as error:
        shutil.rmtree(staging, ignore_errors=True)
        detail = error.message if isinstance(error, RegistryError) else str(error)
        message = f"image volume {volume['name']!r} ({source.get('reference')}): {detail}"
        raise ConfigError("ErrImagePull", message) from error
    if folder.exists():
        folder.rmdir()  # the empty folder of an earlier attempt
    staging.rename(folder)


def container_mounts(container: Obj, folders: dict[str, Path]) -> list[Mount]:
    """The container's volumeMounts as bind mounts, parents before children."""
    mounts = []
    for mount in container.get("volumeMounts") or []:
        if mount["name"] not in folders:
            raise ConfigError(
                "CreateContainerConfigError", f"volumeMount {mount['name']!r} refers to no volume of the pod"
            )
        source = folders[mount["name"]]
        if mount.get("subPath"):
            source = source / mount["subPath"]
            if not source.exists():
                source.mkdir(parents=True)
        mounts.append(Mount(str(source), mount["mountPath"], bool(mount.get("readOnly", False))))
    return sorted(mounts, key=lambda m: m.target.rstrip("/").count("/"))


def refresh_config_maps(pod: Obj, folders: dict[str, Path], config_maps: dict[str, Obj]) -> list[str]:
    """Bring the running pod's configMap volumes in line with `config_maps` (name -> ConfigMap, this namespace's,
    as the agent's watch last saw them): files whose content changed are replaced atomically (a reader sees the old
    or the new file, never a torn one), keys gone lose their files. Returns the volumes changed. A ConfigMap not
    seen (or gone) leaves its volume as it is, as the kubelet keeps the last content."""
    changed: list[str] = []
    for volume in pod["spec"].get("volumes") or []:
        ref = volume.get("configMap")
        folder = folders.get(volume["name"])
        if ref is None or folder is None or ref["name"] not in config_maps:
            continue
        try:
            files = _items(config_map_data(config_maps[ref["name"]]), ref.get("items"),
                           ref.get("defaultMode", 0o644), "configmap", ref["name"])
        except ConfigError:
            continue  # an item's key went missing: keep what the container has
        stale = {rel: item for rel, item in files.items() if _content(folder / rel) != item[0]}
        gone = [p for p in folder.iterdir() if p.is_file() and p.name not in files and not p.name.endswith(".loom-tmp")]
        if stale:
            write_files(folder, stale)
        for path in gone:
            path.unlink(missing_ok=True)
        if stale or gone:
            changed.append(volume["name"])
    return changed


def _content(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None
