"""The node cache's reading and writing (what to do is decided in node_cache.py): locks, the atomic rename of a
verified download, the check of an entry before it is served, linking an entry into a pod's model folder, and
eviction. A fetch step killed at any instant leaves either a complete entry or an `.incoming-` folder that the next
fetch of the same key removes; an entry whose files do not match its record is removed and fetched again."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .node_cache import (
    ENTRY_FILE,
    INCOMING_PREFIX,
    LOCKS_DIR,
    CachedEntry,
    CachedFile,
    EntryRecord,
    choose_evictions,
    fits,
    is_key,
    size_problems,
)

log = logging.getLogger("loom.workloads.server.node_cache")

# Set on the fetch step by the operator (settings model_node_cache_dir / model_node_cache_limit_bytes).
DIR_ENV = "LOOM_MODEL_NODE_CACHE"
LIMIT_ENV = "LOOM_MODEL_NODE_CACHE_LIMIT_BYTES"

Outcome = Literal["hit", "miss", "uncached"]


@contextlib.contextmanager
def _flock(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """An exclusive fcntl lock on `path` (yields False, holding nothing, when `wait` is off and another holds it)."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sizes(folder: Path) -> dict[str, int]:
    return {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in folder.rglob("*")
        if p.is_file() and p.name != ENTRY_FILE
    }


def link_tree(entry: Path, files: Sequence[CachedFile], dest: Path) -> None:
    """Put the entry's files into a pod's folder: hard links (no bytes copied; the cache's files are read-only, and
    evicting the entry leaves the pod's links whole), or copies where the two folders are on different filesystems."""
    for f in files:
        target = dest / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(entry / f.path, target)
        except OSError as error:
            if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            shutil.copyfile(entry / f.path, target)


@dataclass(frozen=True)
class NodeCache:
    root: Path
    limit_bytes: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NodeCache | None:
        folder = env.get(DIR_ENV)
        if not folder:
            return None
        return cls(Path(folder), int(env.get(LIMIT_ENV) or 0))

    def usable(self) -> bool:
        """Whether this pod may write the node's folder (it must exist writable for the pods' user; see serve.md)."""
        try:
            (self.root / LOCKS_DIR).mkdir(parents=True, exist_ok=True)
            with _flock(self.root / LOCKS_DIR / ".probe.lock"):
                return True
        except OSError as error:
            log.warning("node cache %s is not usable (%s): fetching without it", self.root, error)
            return False

    def _lock_path(self, key: str) -> Path:
        return self.root / LOCKS_DIR / f"{key}.lock"

    def _whole(self, key: str) -> EntryRecord | None:
        """The entry's record when it is complete and matches it; a corrupt entry is removed (None)."""
        entry = self.root / key
        if not entry.is_dir():
            return None
        try:
            record = EntryRecord.from_json((entry / ENTRY_FILE).read_text())
            problems = [] if record.key == key else [f"its record names key {record.key}"]
            problems += size_problems(record, _sizes(entry))
        except (OSError, ValueError, KeyError, TypeError) as error:
            problems = [f"no readable record ({type(error).__name__})"]
            record = None
        if problems:
            log.warning("node cache entry %s is not whole (%s): removing it", key[:16], "; ".join(problems[:3]))
            shutil.rmtree(entry, ignore_errors=True)
            return None
        return record

    def _clean_incoming(self, key: str) -> None:
        """Remove what a killed download of this key left (the caller holds the key's lock)."""
        for stale in self.root.glob(f"{INCOMING_PREFIX}{key}-*"):
            log.info("node cache: removing the partial download %s", stale.name)
            shutil.rmtree(stale, ignore_errors=True)

    def entries(self) -> list[CachedEntry]:
        found = []
        for entry in self.root.iterdir():
            if not is_key(entry.name):
                continue
            try:
                record = EntryRecord.from_json((entry / ENTRY_FILE).read_text())
                found.append(CachedEntry(entry.name, record.size, (entry / ENTRY_FILE).stat().st_mtime))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # half removed, or corrupt: the next fetch of that key removes it
        return found

    def evict_for(self, key: str, incoming_bytes: int) -> list[str]:
        """Remove least recently used entries until the incoming one fits; an entry another fetch holds is kept."""
        removed = []
        with _flock(self.root / LOCKS_DIR / ".evict.lock"):
            for victim in choose_evictions(self.entries(), self.limit_bytes, incoming_bytes, keep=key):
                with _flock(self._lock_path(victim), wait=False) as held:
                    if not held:
                        continue
                    shutil.rmtree(self.root / victim, ignore_errors=True)
                    removed.append(victim)
        if removed:
            log.info("node cache: evicted %d entries to fit %d bytes", len(removed), incoming_bytes)
        return removed

    def provide(
        self, key: str, files: Sequence[CachedFile], source: str, download: Callable[[Path], None], dest: Path
    ) -> Outcome:
        """Fill `dest` (the pod's staging folder) with the content `key`: linked from the node's entry when it is
        there and whole (hit), else downloaded into the cache once, verified, renamed into place, then linked (miss).
        A model larger than the whole cache is downloaded into `dest` only (uncached)."""
        record = EntryRecord(key=key, source=source, files=tuple(files))
        (self.root / LOCKS_DIR).mkdir(parents=True, exist_ok=True)
        with _flock(self._lock_path(key)):  # one download per key per node; the others wait, then hit
            self._clean_incoming(key)
            if self._whole(key) is not None:
                os.utime(self.root / key / ENTRY_FILE)  # recently used: the last to be evicted
                link_tree(self.root / key, record.files, dest)
                log.info("node cache hit: %s (key %s): nothing downloaded", source, key[:16])
                return "hit"
            if not fits(self.limit_bytes, record.size):
                log.info("node cache: %s has %d bytes, over the cache's %d: not cached", source, record.size,
                         self.limit_bytes)
                download(dest)
                return "uncached"
            self.evict_for(key, record.size)
            incoming = Path(tempfile.mkdtemp(prefix=f"{INCOMING_PREFIX}{key}-", dir=self.root))
            try:
                download(incoming)
                problems = size_problems(record, _sizes(incoming))
                if problems:
                    raise ValueError(f"the download does not match the listing: {'; '.join(problems[:3])}")
                for path in incoming.rglob("*"):
                    if path.is_file():
                        path.chmod(0o444)  # shared by hard links: no pod may change the cached bytes
                (incoming / ENTRY_FILE).write_text(record.to_json())  # last: the entry is whole from here on
                os.rename(incoming, self.root / key)
            finally:
                shutil.rmtree(incoming, ignore_errors=True)
            link_tree(self.root / key, record.files, dest)
            log.info("node cache miss: %s (key %s) downloaded once into the node's cache", source, key[:16])
            return "miss"
