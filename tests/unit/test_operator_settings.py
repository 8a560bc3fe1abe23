"""Operator settings and Kopf configuration, and the honest placeholder status."""

from __future__ import annotations

import re

import kopf
import pytest

from loom.devstack.images import IMAGE_ENV, IMAGE_SETTINGS
from loom.devstack.servers import free_port
from loom.operator.core.kit import labels
from loom.operator.main import configure, endpoint
from loom.operator.settings import FINALIZER, OperatorSettings


def test_settings_from_env() -> None:
    s = OperatorSettings.from_env({**IMAGE_ENV, "LOOM_NAMESPACES": "a, b", "LOOM_METRICS_PORT": "9100"})
    assert s.namespaces == ["a", "b"]
    assert s.metrics_port == 9100
    assert OperatorSettings.from_env(IMAGE_ENV).namespaces == []


def test_every_controller_setting_comes_from_its_loom_variable() -> None:
    s = OperatorSettings.from_env(
        {
            **IMAGE_ENV,
            "LOOM_TRAINING_POLL_S": "1",
            "LOOM_NODE_LOST_GRACE_S": "10",
            "LOOM_RESYNC_INTERVAL_S": "2.5",
            "LOOM_RECONCILE_TIMEOUT_S": "30",
            "LOOM_HEALTH_HOST": "0.0.0.0",
            "LOOM_HEALTH_PORT": "9000",
            "LOOM_METRICS_HOST": "::",
            "LOOM_LOG_LEVEL": "DEBUG",
            "LOOM_SERVER_IMAGE": "registry.example/loom/server:1",
        }
    )
    assert (s.training_poll_s, s.node_lost_grace_s, s.resync_interval_s, s.reconcile_timeout_s) == (1, 10, 2.5, 30)
    assert (s.health_host, s.health_port, s.metrics_host, s.metrics_port) == ("0.0.0.0", 9000, "::", 8081)
    assert s.log_level == "DEBUG" and s.server_image == "registry.example/loom/server:1"


def test_endpoints_listen_on_loopback_by_default() -> None:
    """Run on a machine (`loom operator`), the operator takes no port on other addresses: on the local stack the
    model servers share the host network and listen on 8080 of their own 127.x address."""
    s = OperatorSettings.from_env(IMAGE_ENV)
    assert (s.health_host, s.metrics_host) == ("127.0.0.1", "127.0.0.1")
    assert endpoint(s.health_host, s.health_port, "/healthz") == "http://127.0.0.1:8080/healthz"
    assert endpoint("::", 8080, "/healthz") == "http://[::]:8080/healthz"


def test_a_bad_setting_names_its_variable() -> None:
    with pytest.raises(ValueError) as error:
        OperatorSettings.from_env({**IMAGE_ENV, "LOOM_TRAINING_POLL_S": "soon", "LOOM_HEALTH_PORT": "70000"})
    assert "LOOM_TRAINING_POLL_S='soon'" in str(error.value)
    assert "LOOM_HEALTH_PORT='70000'" in str(error.value)


def test_the_operator_refuses_to_start_without_qualified_workload_images() -> None:
    """No default image (Loom publishes none), and no name without a registry host: `loom/trainer` would resolve to
    the default public registry's `loom` namespace, which Loom does not own. The message says what to set."""
    with pytest.raises(ValueError) as error:
        OperatorSettings.from_env({})
    message = str(error.value)
    for name in ("TRAINER", "SERVER", "ROUTER", "FEATURES"):
        assert f"LOOM_{name}_IMAGE is not set" in message
    assert "registry host" in message and "make images push" in message
    for unqualified in ("loom/trainer:0.1.0", "trainer:1", "registry.example.com/loom/trainer", "https://r.io/t:1"):
        with pytest.raises(ValueError, match=f"LOOM_TRAINER_IMAGE='{re.escape(unqualified)}' is no qualified image"):
            OperatorSettings.from_env({**IMAGE_ENV, "LOOM_TRAINER_IMAGE": unqualified})
    digest = "sha256:" + "ab" * 32
    for qualified in (
        "registry.example.com/loom/trainer:0.1.0",
        f"127.0.0.1:5000/loom/trainer@{digest}",
        f"localhost/loom/trainer:0.1.0@{digest}",
        "registry:5000/trainer:1",
    ):
        assert OperatorSettings.from_env({**IMAGE_ENV, "LOOM_TRAINER_IMAGE": qualified}).trainer_image == qualified


def test_kopf_uses_loom_prefix_and_finalizer() -> None:
    settings = kopf.OperatorSettings()
    configure(settings, OperatorSettings(**IMAGE_SETTINGS, watch_server_timeout_s=120))
    assert settings.persistence.finalizer == FINALIZER == "loom.dev/finalizer"
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert settings.persistence.progress_storage.prefix == "loom.dev"
    assert settings.watching.server_timeout == 120


def test_the_api_server_sends_only_loom_labelled_children_and_every_loom_object_and_node() -> None:
    from kopf._cogs.structs.references import Resource

    settings = kopf.OperatorSettings()
    configure(settings, OperatorSettings(**IMAGE_SETTINGS))

    def selectors(group: str, plural: str, kind: str) -> list[str]:
        resource = Resource(group, "v1", plural, kind=kind, singular=kind.lower(), namespaced=True)
        return settings.watching.label_selectors.collect(resource)

    children = [("", "pods", "Pod"), ("", "services", "Service"), ("", "configmaps", "ConfigMap"),
                ("apps", "deployments", "Deployment"), ("batch", "jobs", "Job")]  # fmt: skip
    for group, plural, kind in children:
        assert selectors(group, plural, kind) == ["app.kubernetes.io/managed-by=loom-operator"], plural
    # The labels every child is rendered with carry it.
    owner = {"kind": "TrainingJob", "metadata": {"name": "t", "namespace": "ml", "uid": "u"}}
    assert labels(owner, "worker")["app.kubernetes.io/managed-by"] == "loom-operator"
    # Loom's own kinds, nodes and Kueue's Workloads: everything, as before.
    for group, plural, kind in [("loom.dev", "trainingjobs", "TrainingJob"), ("", "nodes", "Node"),
                                ("kueue.x-k8s.io", "workloads", "Workload")]:  # fmt: skip
        assert selectors(group, plural, kind) == [], plural


def test_kopf_keeps_no_record_of_the_last_handled_spec() -> None:
    """Loom registers no create/update handler (test_operator_runner holds that), so Kopf's per-event record of the
    last handled spec (a deep copy of each body) is never built, and nothing is written to objects."""
    from loom.operator.main import NoDiffBase

    settings = kopf.OperatorSettings()
    configure(settings, OperatorSettings(**IMAGE_SETTINGS))
    storage = settings.persistence.diffbase_storage
    assert isinstance(storage, NoDiffBase)
    pod = kopf.Body({"metadata": {"name": "p", "annotations": {"a": "b"}}, "spec": {"containers": []}, "status": {}})
    assert storage.build(body=pod) == {}
    assert storage.fetch(body=pod) is None
    patch = kopf.Patch()
    storage.store(body=pod, patch=patch, essence=storage.build(body=pod))
    assert patch == {}


def test_a_taken_port_stops_the_start_with_a_sentence_that_names_it() -> None:
    """A second `loom operator` on one machine said only "Address already in use", from inside Kopf's startup."""
    import socket

    from click.testing import CliRunner

    from loom.operator.cli import main as cli
    from loom.operator.main import PortInUse, check_ports_free, listening_ports

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = OperatorSettings.from_env({**IMAGE_ENV, "LOOM_METRICS_PORT": str(port), "LOOM_HEALTH_PORT": "1"})
        ports = listening_ports(settings)
        assert [what for what, _, _ in ports] == ["liveness (LOOM_HEALTH_PORT)", "metrics (LOOM_METRICS_PORT)"]
        with pytest.raises(PortInUse, match=f"cannot listen on 127.0.0.1:{port} for metrics \\(LOOM_METRICS_PORT\\)"):
            check_ports_free(ports[1:])
        env = {**IMAGE_ENV, "LOOM_METRICS_PORT": str(port), "LOOM_HEALTH_PORT": str(free_port())}
        result = CliRunner().invoke(cli, ["operator"], env=env)
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert f"cannot listen on 127.0.0.1:{port} for metrics" in result.output
    check_ports_free(ports[1:])  # free again: no complaint
