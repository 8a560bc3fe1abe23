"""The node agent updates a running pod's configMap volumes in place when the ConfigMap changes, as the kubelet
does (the vllm runtime's adapter list reaches a running replica this way, with no restart)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loom.devstack.agent.plan import ClusterData
from loom.devstack.agent.volumes import materialize, refresh_config_maps

POD: dict[str, Any] = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
    "spec": {
        "containers": [{"name": "c", "command": ["true"]}],
        "volumes": [
            {"name": "config", "configMap": {"name": "cfg"}},
            {"name": "picked", "configMap": {"name": "cfg", "items": [{"key": "a.json", "path": "only.json"}]}},
            {"name": "scratch", "emptyDir": {}},
        ],
    },
}


def cm(data: dict[str, str], version: str = "1") -> dict[str, Any]:
    return {"metadata": {"name": "cfg", "namespace": "ns", "resourceVersion": version}, "data": data}


def test_a_changed_configmap_rewrites_its_volumes_files_and_drops_removed_keys(tmp_path: Path) -> None:
    folders = materialize(POD, tmp_path / "pod", tmp_path, ClusterData({"cfg": cm({"a.json": "1", "b.json": "x"})}, {}),
                          None)
    config = folders["config"]
    assert refresh_config_maps(POD, folders, {"cfg": cm({"a.json": "1", "b.json": "x"})}) == []  # nothing to do
    changed = refresh_config_maps(POD, folders, {"cfg": cm({"a.json": "2"}, "2")})
    assert changed == ["config", "picked"]
    assert (config / "a.json").read_text() == "2" and not (config / "b.json").exists()
    assert (folders["picked"] / "only.json").read_text() == "2"
    # A file left as it was is not touched (a reader comparing contents sees no change).
    refresh_config_maps(POD, folders, {"cfg": cm({"a.json": "2", "b.json": "y"}, "3")})
    inode = (config / "b.json").stat().st_ino
    refresh_config_maps(POD, folders, {"cfg": cm({"a.json": "3", "b.json": "y"}, "4")})
    assert (config / "a.json").read_text() == "3"
    assert (config / "b.json").read_text() == "y" and (config / "b.json").stat().st_ino == inode


def test_a_configmap_not_seen_or_missing_an_item_leaves_the_volume_as_it_is(tmp_path: Path) -> None:
    folders = materialize(POD, tmp_path / "pod", tmp_path, ClusterData({"cfg": cm({"a.json": "1"})}, {}), None)
    assert refresh_config_maps(POD, folders, {}) == []
    assert refresh_config_maps(POD, folders, {"cfg": cm({"other": "z"}, "2")}) == ["config"]
    assert (folders["picked"] / "only.json").read_text() == "1"  # its key is gone: the kubelet keeps the last
