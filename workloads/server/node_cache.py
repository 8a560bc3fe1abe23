"""The node cache of fetched models, decided (pure: no I/O; node_cache_io.py does the reading and writing).

Every replica's fetch step downloads into its own emptyDir. With the node cache (the operator's
LOOM_MODEL_NODE_CACHE_DIR, a hostPath folder mounted into the fetch step) a second replica on a node that already
holds the same model version links it from there instead of downloading it again.

An entry is keyed by content, never by a name alone: an S3 prefix by every object's (relative key, size, ETag), an
MLflow model version by its run, its source and its artifacts' (path, size). A retrained model uploaded to the same
prefix has new ETags, so it is a new key (a miss), while the name stays the same. Layout of the cache folder::

    <cache>/<key>/...                  one entry: the model's files, read-only
    <cache>/<key>/.loom-entry.json     written last, before the entry is renamed into place: its key and files
    <cache>/.incoming-<key>-<random>/  a download in progress (or a killed one: removed by the next fetch of the key)
    <cache>/.locks/<key>.lock          fcntl lock: one download per key per node; eviction skips a held entry
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

ENTRY_FILE = ".loom-entry.json"
INCOMING_PREFIX = ".incoming-"
LOCKS_DIR = ".locks"
_KEY = re.compile(r"^[0-9a-f]{64}$")


class NotContentAddressable(ValueError):
    """The source does not say what its content is (an S3 object without an ETag): it is fetched without the cache."""


@dataclass(frozen=True)
class CachedFile:
    """One file of a model version as its source lists it (path relative to the model folder)."""

    path: str
    size: int
    etag: str = ""


@dataclass(frozen=True)
class EntryRecord:
    """What .loom-entry.json holds: the key it was filed under and the files (with sizes) it must contain."""

    key: str
    source: str
    files: tuple[CachedFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        return json.dumps({"key": self.key, "source": self.source, "files": [asdict(f) for f in self.files]})

    @classmethod
    def from_json(cls, text: str) -> EntryRecord:
        data = json.loads(text)
        files = tuple(CachedFile(str(f["path"]), int(f["size"]), str(f.get("etag", ""))) for f in data["files"])
        return cls(key=str(data["key"]), source=str(data["source"]), files=files)


@dataclass(frozen=True)
class CachedEntry:
    """A complete entry seen in the cache folder: its key, bytes, and when it was last used (the marker's mtime)."""

    key: str
    size: int
    last_used: float


def is_key(name: str) -> bool:
    return bool(_KEY.match(name))


def s3_files(prefix: str, objects: Iterable[Mapping[str, object]]) -> list[CachedFile]:
    """The files under an S3 prefix (list_objects_v2's Contents) relative to it; folder placeholders are left out,
    as the fetch step leaves them out. An object without an ETag makes the listing useless as a content key."""
    skip = len(prefix) + 1 if prefix else 0
    files = []
    for obj in objects:
        key = str(obj["Key"])
        relative = key[skip:]
        if not relative or relative.endswith("/"):
            continue
        if relative.startswith("/") or ".." in relative.split("/"):
            raise ValueError(f"refusing object key that escapes the model folder: {key!r}")
        etag = str(obj.get("ETag") or "").strip('"')
        if not etag:
            raise NotContentAddressable(f"S3 object {key!r} has no ETag")
        size = obj.get("Size", 0)
        files.append(CachedFile(relative, int(size) if isinstance(size, int | str) else 0, etag))
    return sorted(files, key=lambda f: f.path)


def content_key(kind: str, files: Sequence[CachedFile], identity: Mapping[str, str] | None = None) -> str:
    """The entry's key: a SHA-256 over the source kind, what identifies the content beyond the listing (an MLflow
    version's run and source), and each file's (path, size, ETag). Names of models and buckets are not in it."""
    if not files:
        raise NotContentAddressable("an empty listing names no content")
    digest = hashlib.sha256()
    digest.update(f"kind\0{kind}\n".encode())
    for name in sorted(identity or {}):
        digest.update(f"id\0{name}\0{(identity or {})[name]}\n".encode())
    for f in sorted(files, key=lambda f: f.path):
        digest.update(f"file\0{f.path}\0{f.size}\0{f.etag}\n".encode())
    return digest.hexdigest()


def size_problems(record: EntryRecord, found: Mapping[str, int]) -> list[str]:
    """What makes an entry unfit to serve: a file missing or of another size than its record says ({path: size} as
    found on disk). An empty list: the entry is whole."""
    problems = []
    for f in record.files:
        if f.path not in found:
            problems.append(f"{f.path} is missing")
        elif found[f.path] != f.size:
            problems.append(f"{f.path} has {found[f.path]} bytes, not {f.size}")
    return problems


def choose_evictions(entries: Sequence[CachedEntry], limit_bytes: int, incoming_bytes: int, keep: str) -> list[str]:
    """The keys to remove, least recently used first, until the entries plus the incoming download fit in the limit.
    `keep` (the entry being fetched or used) is never chosen. The caller skips an entry another fetch holds locked,
    so the result may leave the cache over its limit for a while; it never removes more than needed."""
    total = sum(e.size for e in entries) + incoming_bytes
    chosen = []
    for entry in sorted(entries, key=lambda e: (e.last_used, e.key)):
        if total <= limit_bytes:
            break
        if entry.key == keep:
            continue
        chosen.append(entry.key)
        total -= entry.size
    return chosen


def fits(limit_bytes: int, incoming_bytes: int) -> bool:
    """Whether a model can be cached at all: one larger than the whole cache is fetched into the pod only."""
    return limit_bytes > 0 and incoming_bytes <= limit_bytes
