"""Pod spec -> what the node agent runs: env resolution, volumes, allocation, hosts, status."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from loom.devstack.agent import plan
from loom.devstack.agent.hosts import ServiceView, render_hosts, write_in_place
from loom.devstack.agent.plan import ClusterData, ConfigError
from loom.devstack.agent.volumes import container_mounts, materialize, volume_files

POD = {
    "metadata": {
        "name": "web-1",
        "namespace": "team",
        "uid": "u-1",
        "labels": {"app": "web", "tier": "a"},
        "annotations": {"note": "x"},
    },
    "spec": {"nodeName": "loom-local", "serviceAccountName": "sa"},
    "status": {"podIP": "127.10.0.4", "hostIP": "127.0.0.1"},
}
DATA = ClusterData(
    config_maps={
        "settings": {"data": {"MODE": "fast", "LEVEL": "3"}, "binaryData": {"blob": base64.b64encode(b"\x00").decode()}}
    },
    secrets={"creds": {"data": {"KEY": base64.b64encode(b"s3cr3t").decode()}}},
)


def test_env_resolves_every_source_in_kubernetes_order() -> None:
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}, {"secretRef": {"name": "creds"}}],
        "env": [
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "MODE"}}},
            {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "KEY"}}},
            {"name": "URL", "value": "http://$(IP):80/$(POD)/$$(POD)/$(UNKNOWN)"},
        ],
    }
    env = plan.resolve_env(POD, container, DATA)
    assert env["CFG_MODE"] == "fast" and env["CFG_LEVEL"] == "3" and env["KEY"] == "s3cr3t"
    assert (env["POD"], env["NS"], env["IP"], env["NODE"], env["APP"]) == (
        "web-1",
        "team",
        "127.10.0.4",
        "loom-local",
        "web",
    )
    assert env["MODE"] == "fast" and env["SECRET"] == "s3cr3t"
    assert env["URL"] == "http://127.10.0.4:80/web-1/$(POD)/$(UNKNOWN)"


def test_missing_references_give_kubelet_reasons_unless_optional() -> None:
    missing_cm = {"name": "c", "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k"}}}]}
    with pytest.raises(ConfigError) as err:
        plan.resolve_env(POD, missing_cm, DATA)
    assert err.value.reason == "CreateContainerConfigError" and 'configmap "nope" not found' in err.value.message
    missing_key = {"name": "c", "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "no"}}}]}
    with pytest.raises(ConfigError, match="couldn't find key no in secret creds"):
        plan.resolve_env(POD, missing_key, DATA)
    optional = {
        "name": "c",
        "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k", "optional": True}}}],
    }
    assert "X" not in plan.resolve_env(POD, optional, DATA)


def test_command_is_required_because_images_are_not_run() -> None:
    with pytest.raises(ConfigError) as err:
        plan.command_line({"name": "c", "image": "busybox"}, {})
    assert err.value.reason == "CreateContainerError" and "busybox" in err.value.message
    argv = plan.command_line({"name": "c", "command": ["echo"], "args": ["$(A)", "b"]}, {"A": "1"})
    assert argv == ["echo", "1", "b"]


def test_gpus_are_counted_and_allocated_without_overlap() -> None:
    spec = {
        "containers": [
            {"resources": {"limits": {"nvidia.com/gpu": "2"}}},
            {"resources": {}},
            {"resources": {"requests": {"nvidia.com/gpu": 1}}},
        ]
    }
    assert plan.gpu_request(spec) == 3
    assert plan.allocate_gpus(2, 4, {0, 2}) == [1, 3]
    assert plan.allocate_gpus(3, 4, {0, 2}) is None
    assert plan.allocate_gpus(0, 0, set()) == []


def test_addresses_are_stable_per_key_and_never_reused() -> None:
    first = plan.allocate_address("127.10.0.0/16", set(), "uid-a")
    assert first == plan.allocate_address("127.10.0.0/16", set(), "uid-a")
    assert first.startswith("127.10.")
    other = plan.allocate_address("127.10.0.0/16", {first}, "uid-a")
    assert other != first
    tiny = "127.30.0.0/30"
    taken = {plan.allocate_address(tiny, set(), "k")}
    taken.add(plan.allocate_address(tiny, taken, "k"))
    with pytest.raises(RuntimeError):
        plan.allocate_address(tiny, taken, "k")


def test_base_environment_puts_the_project_programs_first() -> None:
    env = plan.base_environment("/venv/bin", "127.10.0.4", "/state/shim.so")
    assert env["PATH"].split(":")[0] == "/venv/bin"
    assert env["PYTHONSAFEPATH"] == "1" and env["LOOM_POD_IP"] == "127.10.0.4"
    assert env["LD_PRELOAD"] == "/state/shim.so"


@pytest.mark.parametrize(
    ("image", "name"),
    [
        ("localhost/loom/vllm:0.1.0", "vllm"),
        ("registry.example.com:5000/ml/vllm@sha256:" + "a" * 64, "vllm"),
        ("registry.example.com/ml/vllm:1@sha256:" + "a" * 64, "vllm"),
        ("vllm", "vllm"),
        ("localhost/loom/server:0.1.0", "server"),
        ("localhost:5000/vllm-tools:1", "vllm-tools"),
    ],
)
def test_image_repository_name(image: str, name: str) -> None:
    assert plan.image_repository_name(image) == name


def test_a_mapped_image_runs_from_its_own_environment(tmp_path: Path) -> None:
    vllm_bin = tmp_path / ".venv-vllm" / "bin"
    vllm_bin.mkdir(parents=True)
    mapping = {"vllm": str(vllm_bin)}
    assert plan.environment_for("localhost/loom/vllm:0.1.0", mapping, "/venv/bin") == str(vllm_bin)
    assert plan.environment_for("localhost/loom/server:0.1.0", mapping, "/venv/bin") == "/venv/bin"
    assert plan.environment_for("", mapping, "/venv/bin") == "/venv/bin"
    # A mapped environment that is not there: the container cannot be created, and the message says what to build.
    with pytest.raises(ConfigError) as missing:
        plan.environment_for("localhost/loom/vllm:0.1.0", {"vllm": str(tmp_path / "nothing")}, "/venv/bin")
    assert missing.value.reason == "CreateContainerError" and "make venv-vllm" in missing.value.message


def test_the_agent_reads_image_environments_from_its_flags() -> None:
    from loom.devstack.agent.__main__ import image_environments, parse_args

    args = parse_args(["--kubeconfig", "k", "--state-dir", "s", "--image-env", "vllm=/x/.venv-vllm/bin"])
    assert image_environments(args.image_env) == (("vllm", "/x/.venv-vllm/bin"),)
    with pytest.raises(SystemExit):
        image_environments(["vllm"])


def test_the_stack_maps_the_vllm_image_to_the_checkouts_vllm_environment() -> None:
    from loom.devstack.cluster.components import node_agent
    from loom.devstack.cluster.paths import REPO_ROOT

    class _Pki:
        def cert(self, name: str) -> str:
            return f"{name}.crt"

        def key(self, name: str) -> str:
            return f"{name}.key"

    class _Ports:
        kubelet = 10250

    agent = node_agent(_Pki(), _Ports(), 0)  # type: ignore[arg-type]
    assert agent is not None
    assert f"--image-env=vllm={REPO_ROOT / '.venv-vllm' / 'bin'}" in agent.argv


def test_volumes_hold_the_right_files_with_modes(tmp_path: Path) -> None:
    pod = {
        **POD,
        "spec": {
            **POD["spec"],
            "volumes": [
                {"name": "cfg", "configMap": {"name": "settings", "items": [{"key": "MODE", "path": "sub/mode"}]}},
                {"name": "sec", "secret": {"secretName": "creds", "defaultMode": 0o400}},
                {
                    "name": "info",
                    "downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]},
                },
                {
                    "name": "proj",
                    "projected": {
                        "sources": [
                            {"serviceAccountToken": {"path": "token"}},
                            {"configMap": {"name": "settings"}},
                            {
                                "downwardAPI": {
                                    "items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]
                                }
                            },
                        ]
                    },
                },
                {"name": "scratch", "emptyDir": {}},
                {"name": "data", "persistentVolumeClaim": {"claimName": "ckpt"}},
            ],
        },
    }
    folders = materialize(pod, tmp_path / "pod", tmp_path / "state", DATA, "tok")
    assert (folders["cfg"] / "sub" / "mode").read_text() == "fast"
    assert (folders["sec"] / "KEY").read_bytes() == b"s3cr3t"
    assert (folders["sec"] / "KEY").stat().st_mode & 0o777 == 0o400
    assert (folders["info"] / "name").read_text() == "web-1"
    assert (folders["proj"] / "token").read_text() == "tok"
    assert (folders["proj"] / "namespace").read_text() == "team"
    assert (folders["proj"] / "blob").read_bytes() == b"\x00"
    assert folders["data"] == tmp_path / "state" / "claims" / "team" / "ckpt"
    assert folders["scratch"].is_dir()
    mounts = container_mounts(
        {
            "volumeMounts": [
                {"name": "cfg", "mountPath": "/etc/a/b"},
                {"name": "data", "mountPath": "/etc", "readOnly": True},
            ]
        },
        folders,
    )
    assert [(m.target, m.read_only) for m in mounts] == [("/etc", True), ("/etc/a/b", False)]


def test_bad_volumes_become_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match='secret "gone" not found'):
        volume_files(POD, {"name": "v", "secret": {"secretName": "gone"}}, DATA, None)
    with pytest.raises(ConfigError, match="unsupported type"):
        materialize({**POD, "spec": {"volumes": [{"name": "v", "iscsi": {}}]}}, tmp_path, tmp_path, DATA, None)
    with pytest.raises(ConfigError, match="refers to no volume"):
        container_mounts({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, {})


def test_hosts_resolve_service_and_headless_names_per_namespace() -> None:
    views = [
        ServiceView("api", "team", "127.20.0.5"),
        ServiceView("db", "other", "127.20.0.6"),
        ServiceView("workers", "team", None, (("127.10.0.7", "worker-0"), ("127.10.0.8", None))),
    ]
    text = render_hosts("127.10.0.4", "web-1", "team", "worker-1", "workers", views)
    lines = [line.split("\t") for line in text.splitlines() if not line.startswith("#")]
    by_name = {name: parts[0] for parts in lines for name in " ".join(parts[1:]).split()}
    assert by_name["api"] == by_name["api.team"] == by_name["api.team.svc.cluster.local"] == "127.20.0.5"
    assert "db" not in by_name and by_name["db.other.svc"] == "127.20.0.6"
    assert by_name["worker-0.workers.team.svc.cluster.local"] == by_name["worker-0.workers.team.svc"] == "127.10.0.7"
    assert by_name["worker-1.workers.team.svc.cluster.local"] == by_name["worker-1"] == "127.10.0.4"
    assert {parts[0] for parts in lines if "workers.team.svc" in parts[1].split()} == {"127.10.0.7", "127.10.0.8"}


def test_hosts_file_is_rewritten_in_place(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    assert write_in_place(path, "a long first version\n")
    inode = path.stat().st_ino
    assert write_in_place(path, "short\n") and not write_in_place(path, "short\n")
    assert path.read_text() == "short\n" and path.stat().st_ino == inode


def test_referenced_objects_cover_env_envfrom_and_volumes() -> None:
    spec = {
        "initContainers": [{"name": "i", "envFrom": [{"secretRef": {"name": "init-secret"}}]}],
        "containers": [
            {
                "name": "c",
                "envFrom": [{"configMapRef": {"name": "env-cm"}}],
                "env": [
                    {"name": "A", "valueFrom": {"secretKeyRef": {"name": "key-secret", "key": "k"}}},
                    {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "key-cm", "key": "k"}}},
                ],
            }
        ],
        "volumes": [
            {"name": "v1", "configMap": {"name": "vol-cm"}},
            {"name": "v2", "secret": {"secretName": "vol-s"}},
            {
                "name": "v3",
                "projected": {"sources": [{"configMap": {"name": "kube-root-ca.crt"}}, {"secret": {"name": "proj-s"}}]},
            },
        ],
    }
    assert plan.referenced_objects(spec) == (
        {"env-cm", "key-cm", "vol-cm", "kube-root-ca.crt"},
        {"init-secret", "key-secret", "vol-s", "proj-s"},
    )
