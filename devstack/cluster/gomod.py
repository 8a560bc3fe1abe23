"""A Go module's source tree from Go's module cache, for the files the stack takes from the modules it builds
(KEDA's and kwok's CRDs, Kueue's chart): `go mod download` fetches it once, checked against the checksum database
like every other module of the stack, and the cache is read-only, so callers copy what they keep."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any


def go_binary() -> str:
    go = shutil.which("go") or shutil.which("go", path="/usr/local/go/bin")
    if go is None:
        raise RuntimeError("the Go toolchain is needed to fetch files from Go modules; `go` is not on PATH")
    return go


def module_dir(module: str, version: str) -> Path:
    """The folder of `module@version` in Go's module cache (downloaded if needed)."""
    found = subprocess.run(
        [go_binary(), "mod", "download", "-json", f"{module}@{version}"],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),  # outside any module: the download must not touch a go.mod
        check=False,
    )
    try:
        info: dict[str, Any] = json.loads(found.stdout)
    except ValueError:
        info = {}
    if found.returncode != 0 or "Dir" not in info:
        raise RuntimeError(f"go mod download {module}@{version} failed: {info.get('Error') or found.stderr}")
    return Path(info["Dir"])


def copy_out(source: Path, names: tuple[str, ...], final: Path) -> Path:
    """Copy the files `names` of a module folder into `final` (replaced whole, never left half-written: staged beside
    it, then renamed). The module cache is read-only; the copies are not."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.parent.name}-", dir=final.parent))
    staging.chmod(0o755)
    for name in names:
        shutil.copyfile(source / name, staging / name)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return final


def copy_tree_out(source: Path, final: Path) -> Path:
    """Copy a module's folder `source` (a Helm chart) to `final`, replaced whole and never left half-written (staged
    beside it, then renamed), with the write bits the read-only module cache does not give."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.parent.name}-", dir=final.parent))
    shutil.copytree(source, staging / "tree")
    for path in [staging, *staging.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    shutil.rmtree(final, ignore_errors=True)
    (staging / "tree").rename(final)
    shutil.rmtree(staging, ignore_errors=True)
    return final
