"""The local stack's image registry as `up` configures it: loopback only, under the stack's state, and a port of
its own also for a stack recorded before the registry existed (stack.json without one)."""

from __future__ import annotations

from pathlib import Path

from loom.devstack.cluster.components import Ports, registry, registry_config
from loom.devstack.cluster.lifecycle import _with_registry_port


def test_the_registry_listens_on_loopback_and_keeps_blobs_under_the_stacks_state(tmp_path: Path) -> None:
    config = registry_config(5123, tmp_path / "blobs")
    assert config["http"]["addr"] == "127.0.0.1:5123"
    assert config["storage"]["filesystem"] == {"rootdirectory": str(tmp_path / "blobs")}
    assert "tls" not in config["http"] and "auth" not in config  # plain HTTP, loopback only
    component = registry(tmp_path / "bin", tmp_path / "registry.yaml")
    assert component.argv == [str(tmp_path / "bin" / "registry"), "serve", str(tmp_path / "registry.yaml")]
    assert component.env is not None and component.env["OTEL_TRACES_EXPORTER"] == "none"


def test_a_stack_recorded_without_a_registry_port_gets_one_and_keeps_the_others() -> None:
    recorded = {name: 40000 + i for i, name in enumerate(Ports.names()) if name != "registry"}
    old = Ports(**recorded)  # a stack.json written before the registry existed
    assert old.registry == 0
    new = _with_registry_port(old)
    assert new.registry > 0 and all(getattr(new, name) == port for name, port in recorded.items())
    assert _with_registry_port(new) == new
