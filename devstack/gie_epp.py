"""GIE's reference endpoint picker (`cmd/epp` of sigs.k8s.io/gateway-api-inference-extension v1.1.0, built from its
module: devstack/cluster/build.py BENCH_MODULES) in front of model servers that run as host processes: for
benchmarks beside Loom's picker, never in an image.

The EPP finds its endpoints only through the Kubernetes API: an InferencePool and the Ready pods it selects, each
endpoint being `status.podIP:targetPort`, whose `/metrics` it scrapes. So on the local stack (kwok; nothing runs in
its pods) each replica gets a pod whose status names where the replica really listens: replica i listens on its own
loopback address (127.0.0.10+i; the loopback holds all of 127.0.0.0/8) and the same port as the others, its pod is
made Running and Ready by kwok (pod-ready stage), then its `status.podIP` is set to that address through the status
subresource (kwok's stages touch only Pending pods after that, so the address stays).

The EPP runs as GIE's Helm chart runs it (config/charts/inferencepool: the default plugins file, `--pool-name`,
`--pool-namespace`), with these differences, each for a reason of this machine:
- `--secure-serving=false`: the chart's gateways reach it over TLS with a self-signed certificate; the Envoy here
  (devstack/envoy.py) talks h2c to every picker, Loom's included.
- `--kv-cache-usage-percentage-metric=vllm:kv_cache_usage_perc`: v1.1's default, `vllm:gpu_cache_usage_perc`, is
  the old engine's name; vLLM 0.32 (V1) exports only the new one.
- `--lora-info-metric=` (none): vLLM exports `vllm:lora_requests_info` only with LoRA on (the chart does the same
  for servers without it); scraping it would log an error per scrape.
- `--metrics-endpoint-auth=false`, `--tracing=false`: the chart's values when Prometheus monitoring and tracing are
  off (its defaults).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.devstack.cluster.gie import install_epp_crds
from loom.devstack.cluster.handle import Cluster, wait_until
from loom.devstack.cluster.nodes import kwok_placement
from loom.devstack.servers import free_port
from loom.workloads.picker.testing import samples, total
from loom.workloads.server.testing import running

# GIE v1.1.0's chart, templates/epp-config.yaml: default-plugins.yaml, as it is.
DEFAULT_PLUGINS = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: prefix-cache-scorer
"""
# Where vLLM 0.32 differs from v1.1's defaults (module docstring).
VLLM_V1_METRIC_FLAGS = ("--kv-cache-usage-percentage-metric=vllm:kv_cache_usage_perc", "--lora-info-metric=")
# The EPP's own metrics used by benchmarks: its scheduling time per request, and the endpoints it holds.
SCHEDULER_SECONDS = "inference_extension_scheduler_e2e_duration_seconds"
READY_PODS = "inference_pool_ready_pods"
FIRST_ADDRESS = 10  # replica i listens on 127.0.0.(FIRST_ADDRESS + i)


@dataclass(frozen=True)
class EppPorts:
    grpc: int  # ext_proc, for the gateway's Envoy
    health: int  # grpc.health.v1
    metrics: int  # Prometheus text, plain HTTP


def replica_address(index: int) -> str:
    """The loopback address replica `index` listens on (its pod's podIP)."""
    if not 0 <= index < 256 - FIRST_ADDRESS:
        raise ValueError(f"replica index {index} out of range")
    return f"127.0.0.{FIRST_ADDRESS + index}"


def target_port(endpoints: Sequence[str]) -> int:
    """The one port every replica listens on ("host:port" each): an InferencePool's targetPort is per pool, so
    the replicas differ by address only."""
    ports = {int(e.rsplit(":", 1)[1]) for e in endpoints}
    if len(ports) != 1:
        raise ValueError(f"the replicas must share one port (an InferencePool's targetPort), got {sorted(ports)}")
    return ports.pop()


def pool_manifest(name: str, namespace: str, labels: dict[str, str], port: int) -> dict[str, Any]:
    """The InferencePool (inference.networking.k8s.io/v1) the EPP serves; its endpointPickerRef names the EPP's
    Service as a gateway would read it (no gateway reads it here: Envoy is pointed at the EPP directly)."""
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": dict(labels)},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}, "failureMode": "FailClose"},
        },
    }


def pod_manifest(name: str, namespace: str, labels: dict[str, str], port: int) -> dict[str, Any]:
    """A pod standing for one host-process replica: on a kwok node (nothing runs), its address set afterwards."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            **kwok_placement(),
            "containers": [{"name": "vllm", "image": "vllm-cpu:host-process", "ports": [{"containerPort": port}]}],
        },
    }


def epp_argv(binary: Path, pool: str, namespace: str, ports: EppPorts, config_file: Path) -> list[str]:
    """The EPP's command line (pure): the chart's flags plus this machine's differences (module docstring)."""
    return [
        str(binary),
        f"--pool-name={pool}",
        f"--pool-namespace={namespace}",
        f"--config-file={config_file}",
        f"--grpc-port={ports.grpc}",
        f"--grpc-health-port={ports.health}",
        f"--metrics-port={ports.metrics}",
        "--secure-serving=false",
        "--metrics-endpoint-auth=false",
        "--tracing=false",
        *VLLM_V1_METRIC_FLAGS,
    ]


def _pod_ready(cluster: Cluster, namespace: str, names: Sequence[str]) -> bool | None:
    pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
    ready = {p["metadata"]["name"] for p in pods if p.get("status", {}).get("phase") == "Running"
             and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))}
    return set(names) <= ready or None


@contextlib.contextmanager
def running_epp(cluster: Cluster, binary: Path, folder: Path, endpoints: Sequence[str],
                namespace: str = "bench-gie-epp", pool: str = "llm") -> Iterator[EppPorts]:
    """The EPP over `endpoints` ("127.0.0.(10+i):port", replica_address order), its pool and pods in `namespace`
    (made afresh, deleted afterwards); yields its ports once it holds every endpoint."""
    port = target_port(endpoints)
    labels = {"app": pool, "loom.dev/bench": "gie-epp"}
    install_epp_crds(cluster)
    cluster.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=true", timeout=180)
    cluster.kubectl("create", "namespace", namespace)
    try:
        wait_until(lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False)
                   .returncode == 0 or None, timeout=30, what=f"ServiceAccount default in {namespace}")
        names = [f"{pool}-{i}" for i in range(len(endpoints))]
        manifests = [pool_manifest(pool, namespace, labels, port),
                     *(pod_manifest(n, namespace, labels, port) for n in names)]
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests}))
        wait_until(lambda: _pod_ready(cluster, namespace, names), timeout=60, what="the replicas' pods Ready")
        for name, endpoint in zip(names, endpoints, strict=True):
            address = endpoint.rsplit(":", 1)[0]
            status = {"status": {"podIP": address, "podIPs": [{"ip": address}]}}
            cluster.kubectl("patch", "pod", name, "-n", namespace, "--subresource=status", "--type=merge",
                            "-p", json.dumps(status))
        config_file = folder / "epp-plugins.yaml"
        config_file.write_text(DEFAULT_PLUGINS)
        ports = EppPorts(grpc=free_port(), health=free_port(), metrics=free_port())
        argv = epp_argv(binary, pool, namespace, ports, config_file)
        metrics_url = f"http://127.0.0.1:{ports.metrics}"
        with running(argv, metrics_url, folder / "epp.log", env=cluster.env, timeout_s=120,
                     ready_url=f"{metrics_url}/metrics"):
            wait_until(lambda: _holds(metrics_url, len(endpoints)), timeout=60,
                       what=f"the EPP holding {len(endpoints)} ready endpoints")
            yield ports
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false", check=False)


def _holds(metrics_url: str, count: int) -> bool | None:
    return total(samples(metrics_url), READY_PODS) >= count or None
