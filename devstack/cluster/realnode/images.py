"""Images for the real node without a registry: written here as `docker save` archives and imported into containerd
with `ctr -n k8s.io images import` (the namespace the kubelet's CRI uses).

- the pod sandbox image (SANDBOX_IMAGE): the stack's `pause` program (go/pause) alone;
- the development image (DEV_IMAGE): Debian's minbase with python3 (the base `make images` builds from, made the same
  way by mmdebstrap), into which a pod mounts the checkout read-only (hostPath at the same path), so it runs Loom's
  code from the checkout's own environment (the host's python3 is Debian's too) without an image build per change;
- any archive `make images` wrote (`import_archive`): the real images where the point is the image.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loom.devstack.cluster.paths import cache_root
from loom.devstack.cluster.realnode.config import SANDBOX_IMAGE

Progress = Callable[[str], None]
DEBIAN_SUITE = "bookworm"
DEV_IMAGE = f"localhost/loom/dev:{DEBIAN_SUITE}"
NAMESPACE = "k8s.io"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def image_config(
    diff_ids: list[str], entrypoint: list[str] | None, cmd: list[str] | None, env: list[str]
) -> dict[str, Any]:
    """The image configuration (OCI/Docker): what a container of it runs, and the layers' uncompressed digests."""
    container: dict[str, Any] = {"Env": env}
    if entrypoint:
        container["Entrypoint"] = entrypoint
    if cmd:
        container["Cmd"] = cmd
    return {
        "architecture": "amd64",
        "os": "linux",
        "config": container,
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in diff_ids]},
    }


def write_archive(
    target: Path, tag: str, layers: list[Path], entrypoint: list[str] | None = None, cmd: list[str] | None = None
) -> Path:
    """A `docker save` archive of one image: its layers (uncompressed tars) as given, its config, its manifest."""
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"]
    diff_ids = [_sha256_file(layer) for layer in layers]
    config = json.dumps(image_config(diff_ids, entrypoint, cmd, env), sort_keys=True).encode()
    config_name = f"{hashlib.sha256(config).hexdigest()}.json"
    manifest = [{"Config": config_name, "RepoTags": [tag], "Layers": [f"{d}/layer.tar" for d in diff_ids]}]
    staging = target.with_name(f".{target.name}.part")
    with tarfile.open(staging, "w") as archive:
        for digest, layer in zip(diff_ids, layers, strict=True):
            archive.add(layer, arcname=f"{digest}/layer.tar")
        for name, data in ((config_name, config), ("manifest.json", json.dumps(manifest).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    staging.rename(target)
    return target


def _single_file_layer(target: Path, source: Path, name: str) -> Path:
    with tarfile.open(target, "w") as layer:
        # The stack's bin directory holds links: the layer must carry the file itself.
        source = source.resolve()
        info = layer.gettarinfo(str(source), arcname=name)
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mode = 0o755
        with open(source, "rb") as f:
            layer.addfile(info, f)
    return target


def sandbox_archive(pause_binary: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    layer = _single_file_layer(folder / "pause-layer.tar", pause_binary, "pause")
    return write_archive(folder / "pause.tar", SANDBOX_IMAGE, [layer], entrypoint=["/pause"])


def _traversable_root_layer(target: Path) -> Path:
    """A layer that makes /root traversable (0755): the checkout's .venv may link to a Python installed below /root
    (pyenv), which the workloads, running as uid 1000, must reach through the image's own /root."""
    with tarfile.open(target, "w") as layer:
        info = tarfile.TarInfo("root")
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        layer.addfile(info)
    return target


def _apt_sources() -> str:
    for candidate in ("/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list"):
        if Path(candidate).is_file() and Path(candidate).stat().st_size:
            return candidate
    raise RuntimeError("no apt sources on this host (/etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list)")


def dev_archive(progress: Progress) -> Path:
    """The development image's archive, made once per machine (cached beside the stack's binaries)."""
    # "-2": the second layer (a traversable /root) came later; an archive cached without it is not reused.
    folder = cache_root() / f"dev-image-{DEBIAN_SUITE}-2"
    archive = folder / "dev.tar"
    if archive.exists():
        return archive
    if shutil.which("mmdebstrap") is None:
        raise RuntimeError("the real node's development image needs mmdebstrap (apt-get install mmdebstrap)")
    folder.mkdir(parents=True, exist_ok=True)
    progress(f"real node: making {DEV_IMAGE} with mmdebstrap (once per machine)")
    with tempfile.TemporaryDirectory(dir=folder) as work:
        rootfs = Path(work) / "rootfs.tar"
        made = subprocess.run(
            [
                "mmdebstrap",
                "--quiet",
                "--variant=minbase",
                "--include=python3,python3-venv,ca-certificates",
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*",
                '--aptopt=Acquire::Languages "none"',
                DEBIAN_SUITE,
                str(rootfs),
                _apt_sources(),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if made.returncode != 0:
            raise RuntimeError(f"mmdebstrap failed (exit {made.returncode}): {made.stderr[-2000:]}")
        layers = [rootfs, _traversable_root_layer(Path(work) / "root.tar")]
        write_archive(archive, DEV_IMAGE, layers, cmd=["python3"])
    return archive


def import_archive(ctr: Path, socket: Path, archive: Path) -> None:
    """Import (and unpack for the overlayfs snapshotter) an image archive into the kubelet's namespace."""
    result = subprocess.run(
        [
            str(ctr),
            "--address",
            str(socket),
            "-n",
            NAMESPACE,
            "images",
            "import",
            "--snapshotter",
            "overlayfs",
            str(archive),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"ctr images import {archive} failed: {result.stderr.strip()}")


def checkout_environment(repo_root: Path) -> list[Path]:
    """The host folders a pod on the real node mounts read-only (at the same paths) to run Loom from the checkout in
    the development image: the checkout (its .venv included) and, when the .venv's interpreter is not the image's own
    Debian python3 (/usr/bin), the Python installation it was made from (pyvenv.cfg `home`, e.g. a pyenv build: it
    links against the same Debian libc as the image)."""
    folders = [repo_root]
    try:
        lines = (repo_root / ".venv" / "pyvenv.cfg").read_text().splitlines()
    except OSError:
        return folders
    home = next((line.split("=", 1)[1].strip() for line in lines if line.split("=", 1)[0].strip() == "home"), "")
    if home and not home.startswith("/usr/"):
        prefix = Path(home).parent  # <prefix>/bin -> <prefix>
        if repo_root not in prefix.parents and prefix != repo_root:
            folders.append(prefix)
    return folders


def image_present(ctr: Path, socket: Path, name: str) -> bool:
    result = subprocess.run(
        [str(ctr), "--address", str(socket), "-n", NAMESPACE, "images", "list", "--quiet", f"name=={name}"],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.returncode == 0 and name in result.stdout.split()
