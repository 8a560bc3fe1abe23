"""The node cache of fetched models: the content key, the eviction choice (values), and the cache folder's
behaviour on a real filesystem (one download per key, a corrupt or partial entry never served, LRU eviction)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from loom.workloads.server.node_cache import (
    ENTRY_FILE,
    CachedEntry,
    CachedFile,
    EntryRecord,
    NotContentAddressable,
    choose_evictions,
    content_key,
    fits,
    s3_files,
    size_problems,
)
from loom.workloads.server.node_cache_io import NodeCache

OBJECTS = [
    {"Key": "models/chat/config.json", "Size": 12, "ETag": '"aa"'},
    {"Key": "models/chat/weights.bin", "Size": 100, "ETag": '"bb"'},
    {"Key": "models/chat/sub/", "Size": 0, "ETag": '"cc"'},
]


def test_s3_files_are_relative_sorted_and_carry_their_etags() -> None:
    assert s3_files("models/chat", reversed(OBJECTS)) == [
        CachedFile("config.json", 12, "aa"),
        CachedFile("weights.bin", 100, "bb"),
    ]


def test_an_object_without_etag_or_escaping_the_folder_is_refused() -> None:
    with pytest.raises(NotContentAddressable):
        s3_files("m", [{"Key": "m/a", "Size": 1}])
    with pytest.raises(ValueError, match="escapes"):
        s3_files("m", [{"Key": "m/../x", "Size": 1, "ETag": "e"}])


def test_the_key_is_the_content_not_the_name() -> None:
    files = s3_files("models/chat", OBJECTS)
    moved = [{**o, "Key": str(o["Key"]).replace("models/chat", "other/v7")} for o in OBJECTS]
    same_elsewhere = s3_files("other/v7", moved)
    assert content_key("s3", files) == content_key("s3", same_elsewhere)
    retrained = [CachedFile("config.json", 12, "aa"), CachedFile("weights.bin", 100, "b2")]  # same sizes, new ETag
    assert content_key("s3", retrained) != content_key("s3", files)
    resized = [CachedFile("config.json", 12, "aa"), CachedFile("weights.bin", 101, "bb")]
    assert content_key("s3", resized) != content_key("s3", files)
    assert content_key("s3", files) != content_key("mlflow", files)
    run_a = content_key("mlflow", files, {"runId": "a", "source": "models:/m-1"})
    assert run_a != content_key("mlflow", files, {"runId": "b", "source": "models:/m-1"})
    assert content_key("s3", list(reversed(files))) == content_key("s3", files)
    assert len(content_key("s3", files)) == 64
    with pytest.raises(NotContentAddressable):
        content_key("s3", [])


def test_size_problems_name_missing_and_resized_files() -> None:
    record = EntryRecord("k", "s3://b/p", (CachedFile("a", 1), CachedFile("b/c", 5)))
    assert record.size == 6
    assert size_problems(record, {"a": 1, "b/c": 5, "extra": 9}) == []
    assert size_problems(record, {"a": 1}) == ["b/c is missing"]
    assert size_problems(record, {"a": 2, "b/c": 5}) == ["a has 2 bytes, not 1"]
    assert EntryRecord.from_json(record.to_json()) == record


def test_eviction_removes_least_recently_used_until_the_incoming_fits() -> None:
    entries = [CachedEntry("old", 40, 1.0), CachedEntry("mid", 30, 2.0), CachedEntry("new", 20, 3.0)]
    assert choose_evictions(entries, limit_bytes=100, incoming_bytes=10, keep="x") == []
    assert choose_evictions(entries, limit_bytes=100, incoming_bytes=11, keep="x") == ["old"]
    assert choose_evictions(entries, limit_bytes=100, incoming_bytes=60, keep="x") == ["old", "mid"]
    assert choose_evictions(entries, limit_bytes=100, incoming_bytes=60, keep="old") == ["mid", "new"]
    assert choose_evictions(entries, limit_bytes=50, incoming_bytes=50, keep="x") == ["old", "mid", "new"]
    assert fits(100, 100) and not fits(100, 101) and not fits(0, 1)


# ------------------------------------------------------------------------------ the cache folder (real files)

FILES = [CachedFile("config.json", 2), CachedFile("w/weights.bin", 6)]
KEY = content_key("s3", [CachedFile(f.path, f.size, "e") for f in FILES])


class Source:
    """A download that writes the files (and counts how often it ran)."""

    def __init__(self, sizes: dict[str, int] | None = None) -> None:
        self.calls = 0
        self.sizes = sizes or {f.path: f.size for f in FILES}

    def __call__(self, dest: Path) -> None:
        self.calls += 1
        for path, size in self.sizes.items():
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            (dest / path).write_bytes(b"x" * size)


def provide(cache: NodeCache, dest: Path, source: Source, key: str = KEY, files: list[CachedFile] = FILES) -> str:
    dest.mkdir(parents=True)
    return cache.provide(key, files, "s3://b/p", source, dest)


def test_a_second_fetch_on_the_node_links_the_entry(tmp_path: Path) -> None:
    cache, source = NodeCache(tmp_path / "cache", 1000), Source()
    assert cache.usable()
    assert provide(cache, tmp_path / "pod1", source) == "miss"
    assert provide(cache, tmp_path / "pod2", source) == "hit"
    assert source.calls == 1
    for pod in ("pod1", "pod2"):
        assert (tmp_path / pod / "w/weights.bin").read_bytes() == b"x" * 6
    entry = tmp_path / "cache" / KEY
    assert os.stat(entry / "w/weights.bin").st_nlink == 3  # the entry and both pods: no bytes copied
    assert os.stat(entry / "w/weights.bin").st_mode & 0o777 == 0o444
    assert json.loads((entry / ENTRY_FILE).read_text())["key"] == KEY


def test_a_corrupt_entry_is_never_served_but_fetched_again(tmp_path: Path) -> None:
    cache, source = NodeCache(tmp_path / "cache", 1000), Source()
    provide(cache, tmp_path / "pod1", source)
    weights = tmp_path / "cache" / KEY / "w/weights.bin"
    weights.unlink()
    weights.write_bytes(b"x")  # truncated
    assert provide(cache, tmp_path / "pod2", source) == "miss"
    assert source.calls == 2
    assert (tmp_path / "pod2" / "w/weights.bin").read_bytes() == b"x" * 6
    (tmp_path / "cache" / KEY / ENTRY_FILE).unlink()  # no record: not an entry
    assert provide(cache, tmp_path / "pod3", source) == "miss"
    assert source.calls == 3


def test_a_killed_download_leaves_nothing_that_is_served(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path / "cache", 1000)
    partial = tmp_path / "cache" / f".incoming-{KEY}-killed"
    partial.mkdir(parents=True)
    (partial / "config.json").write_bytes(b"xx")
    short = Source({"config.json": 2, "w/weights.bin": 3})  # the source changed under the listing
    with pytest.raises(ValueError, match="does not match the listing"):
        provide(cache, tmp_path / "pod1", short)
    assert not partial.exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".locks"]
    source = Source()
    assert provide(cache, tmp_path / "pod2", source) == "miss"


def test_least_recently_used_entries_are_evicted_and_a_model_over_the_limit_is_not_cached(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path / "cache", 20)  # room for two 8-byte models
    keys = [content_key("s3", [CachedFile("config.json", 2, str(i)), CachedFile("w/weights.bin", 6, str(i))])
            for i in range(3)]
    for i, key in enumerate(keys[:2]):
        provide(cache, tmp_path / f"a{i}", Source(), key)
    os.utime(tmp_path / "cache" / keys[0] / ENTRY_FILE, (1, 1))  # keys[0] used long ago
    provide(cache, tmp_path / "a2", Source(), keys[2])
    assert sorted(e.key for e in cache.entries()) == sorted(keys[1:])
    assert (tmp_path / "a0" / "w/weights.bin").read_bytes() == b"x" * 6  # a pod's links outlive the entry
    big = [CachedFile("w/weights.bin", 30)]
    source = Source({"w/weights.bin": 30})
    big_key = content_key("s3", [CachedFile("w/weights.bin", 30, "z")])
    assert provide(cache, tmp_path / "big", source, big_key, big) == "uncached"
    assert (tmp_path / "big" / "w/weights.bin").stat().st_size == 30
    assert sorted(e.key for e in cache.entries()) == sorted(keys[1:])


def test_a_folder_the_pod_cannot_write_is_not_used(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert not NodeCache(blocked / "cache", 1000).usable()
    assert NodeCache.from_env({}) is None
    env = {"LOOM_MODEL_NODE_CACHE": "/c", "LOOM_MODEL_NODE_CACHE_LIMIT_BYTES": "5"}
    assert NodeCache.from_env(env) == NodeCache(Path("/c"), 5)
