"""What the node agent gives a pod so in-cluster clients find and trust the API server: the kubelet's
`KUBERNETES_*` variables and the service-account volume the ServiceAccount admission plugin injects."""

from __future__ import annotations

from pathlib import Path

from kubernetes.client import Configuration
from kubernetes.config.incluster_config import InClusterConfigLoader

from loom.devstack.agent import plan
from loom.devstack.agent.plan import ClusterData
from loom.devstack.agent.volumes import needs_token, volume_files, write_files

# As the API server's ServiceAccount admission plugin adds it to every pod (kube-api-access-<random>).
KUBE_API_ACCESS = {
    "name": "kube-api-access-x1y2z",
    "projected": {
        "defaultMode": 420,
        "sources": [
            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {
                "downwardAPI": {
                    "items": [
                        {"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}
                    ]
                }
            },
        ],
    },
}
POD = {
    "metadata": {"name": "op-1", "namespace": "loom-system", "uid": "u-1"},
    "spec": {"nodeName": "loom-local", "serviceAccountName": "loom-operator", "volumes": [KUBE_API_ACCESS]},
    "status": {"podIP": "127.10.0.9"},
}
CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def test_api_server_variables_are_the_kubelets_for_the_real_address() -> None:
    assert plan.api_server_environment("127.0.0.1", 36229) == {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": "36229",
        "KUBERNETES_SERVICE_PORT_HTTPS": "36229",
        "KUBERNETES_PORT": "tcp://127.0.0.1:36229",
        "KUBERNETES_PORT_36229_TCP": "tcp://127.0.0.1:36229",
        "KUBERNETES_PORT_36229_TCP_PROTO": "tcp",
        "KUBERNETES_PORT_36229_TCP_PORT": "36229",
        "KUBERNETES_PORT_36229_TCP_ADDR": "127.0.0.1",
    }
    # An IPv6 address is bracketed in URLs, bare where a host is expected.
    v6 = plan.api_server_environment("::1", 6443)
    assert v6["KUBERNETES_SERVICE_HOST"] == "::1" and v6["KUBERNETES_PORT"] == "tcp://[::1]:6443"


def test_service_account_volume_is_what_the_in_cluster_config_reads(tmp_path: Path) -> None:
    # The agent asks the TokenRequest API for a token bound to the pod, because the volume projects one.
    assert needs_token(POD) == [{"expirationSeconds": 3607, "path": "token"}]
    data = ClusterData(config_maps={"kube-root-ca.crt": {"data": {"ca.crt": CA}}}, secrets={})
    files = volume_files(POD, KUBE_API_ACCESS, data, "jwt-of-the-pod")
    assert files is not None
    mount = tmp_path / "var/run/secrets/kubernetes.io/serviceaccount"  # the container's mountPath
    write_files(mount, files)
    assert (mount / "namespace").read_text() == "loom-system"

    # The Python client's (and so Kopf's) in-cluster login, fed the pod's env and files.
    config = Configuration()
    InClusterConfigLoader(
        token_filename=str(mount / "token"),
        cert_filename=str(mount / "ca.crt"),
        environ=plan.api_server_environment("127.0.0.1", 36229),
    ).load_and_set(config)
    assert config.host == "https://127.0.0.1:36229"
    assert config.api_key["BearerToken"] == "bearer jwt-of-the-pod"
    assert Path(config.ssl_ca_cert).read_text() == CA
