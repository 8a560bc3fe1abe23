"""Checkpoint manifests and the pure decisions around them (naming, newest complete, retention).

A checkpoint directory `step-000000120/` becomes visible only when its `manifest.json` exists; rank 0
writes it last, after every rank reported its uploaded files. Everything here is free of I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pydantic import BaseModel, Field

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{9})$")


class FileEntry(BaseModel):
    path: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class RankReport(BaseModel):
    """What one rank uploaded for one checkpoint (an intermediate object, merged into the manifest)."""

    rank: int
    session: str
    files: list[FileEntry]


class Manifest(BaseModel):
    format: int = FORMAT_VERSION
    step: int
    world_size: int
    engine: str
    created_at: float
    files: list[FileEntry]

    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def entry(self, path: str) -> FileEntry | None:
        return next((f for f in self.files if f.path == path), None)


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def step_of(dir_name: str) -> int | None:
    match = _STEP_DIR.match(dir_name)
    return int(match.group(1)) if match else None


def merge_reports(reports: Iterable[RankReport], world_size: int, step: int, engine: str, now: float) -> Manifest:
    """Combine every rank's report; refuses to produce a manifest that misses a rank or repeats a file."""
    by_rank = {report.rank: report for report in reports}
    missing = sorted(set(range(world_size)) - set(by_rank))
    if missing:
        raise ValueError(f"no upload report from ranks {missing}")
    files: dict[str, FileEntry] = {}
    for rank in range(world_size):
        for entry in by_rank[rank].files:
            if entry.path in files:
                raise ValueError(f"file {entry.path} uploaded by two ranks")
            files[entry.path] = entry
    return Manifest(step=step, world_size=world_size, engine=engine, created_at=now, files=sorted(
        files.values(), key=lambda e: e.path
    ))


def complete_steps(keys: Iterable[str], root_prefix: str) -> list[int]:
    """Steps whose manifest exists, ascending, from a listing of object keys under root_prefix."""
    prefix = root_prefix.strip("/") + "/" if root_prefix.strip("/") else ""
    steps = set()
    for key in keys:
        if not key.startswith(prefix):
            continue
        parts = key[len(prefix) :].split("/")
        if len(parts) == 2 and parts[1] == MANIFEST_NAME and (step := step_of(parts[0])) is not None:
            steps.add(step)
    return sorted(steps)


def steps_to_delete(complete: Iterable[int], keep_last: int | None) -> list[int]:
    """Complete checkpoints that retention removes: all but the newest keep_last. Torn ones are never
    selected here (they are not in `complete`), so a run can always fall back to a whole checkpoint."""
    ordered = sorted(set(complete))
    if keep_last is None or len(ordered) <= keep_last:
        return []
    return ordered[: len(ordered) - keep_last]
