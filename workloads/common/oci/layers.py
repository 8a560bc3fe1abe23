"""A layer's tar, written so its bytes depend only on its files' paths and contents, and unpacked safely.

Entries carry no time, owner or host permission bits: files 0644, their parent folders 0755, owner root (the
runtime's read-only mount is then readable by any pod user), in path order, PAX headers only for long names. A
layer is written to a file beside the others (a model's weights do not fit in memory) while its SHA-256 is taken.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import IO, Any

from .image import Layer

CHUNK = 4 << 20


class _Hashing:
    """A writable file that hashes what goes through it."""

    def __init__(self, target: IO[bytes]) -> None:
        self.target, self.sha, self.size = target, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.target.write(data)

    def tell(self) -> int:
        return self.size


def folder_files(folder: Path) -> dict[str, int]:
    """{relative POSIX path: size} of every regular file below `folder` (links and special files refused: a model
    image holds bytes, not references to the packing machine)."""
    files: dict[str, int] = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder).as_posix()
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise ValueError(f"{relative}: only regular files and folders can be packed (a link or special file)")
        if path.is_file():
            files[relative] = path.stat().st_size
    return files


def _parents(path: str) -> list[str]:
    parts = PurePosixPath(path).parts[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _info(name: str, kind: bytes, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mtime = kind, size, 0
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def write_layer(folder: Path, files: Iterable[str], target: Path) -> Layer:
    """The tar of `files` (relative to `folder`) at `target`: its digest and size."""
    names = tuple(sorted(files))
    with open(target, "wb") as raw:
        out = _Hashing(raw)
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            written: set[str] = set()
            for name in names:
                for parent in _parents(name):
                    if parent not in written:
                        written.add(parent)
                        tar.addfile(_info(parent, tarfile.DIRTYPE))
                source = folder / name
                with open(source, "rb") as content:
                    tar.addfile(_info(name, tarfile.REGTYPE, os.fstat(content.fileno()).st_size), content)
        return Layer(names, "sha256:" + out.sha.hexdigest(), out.size)


def _member_target(dest: Path, member: tarfile.TarInfo) -> Path:
    name = PurePosixPath(member.name)
    if name.is_absolute() or ".." in name.parts:
        raise ValueError(f"layer entry {member.name!r} points outside the model folder")
    if not (member.isfile() or member.isdir()):
        raise ValueError(f"layer entry {member.name!r} is not a regular file or folder")
    return dest.joinpath(*name.parts)


def extract_layer(stream: IO[bytes] | Any, dest: Path) -> list[str]:
    """Unpack a layer's tar (a file object read once, in order) into `dest`; the regular files it held. Entries
    that would land outside `dest`, links and devices are refused: a model image holds files only."""
    files = []
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            target = _member_target(dest, member)
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None  # a regular file
            with open(target, "wb") as out:
                while chunk := source.read(CHUNK):
                    out.write(chunk)
            files.append(PurePosixPath(member.name).as_posix())
    return files
