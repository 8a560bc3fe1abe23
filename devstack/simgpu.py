"""A simulated GPU node and a dcgm-exporter stand-in, so the GPU autoscaling example scales on the local stack.

A GPU cluster has GPU nodes (nvidia.com/gpu capacity, the `nvidia.com/gpu` NoSchedule taint, the labels of
NVIDIA's GPU feature discovery) and dcgm-exporter reporting each GPU's utilisation with the pod that holds it.
`loom dev up` (backing.ensure) gives the local stack one of each:

  node loom-simulated-gpu-0   a kwok node (kwok pretends to run its pods) with SIM_GPUS x nvidia.com/gpu, the
                              usual taint and labels, and `loom.dev/simulated-gpu: "true"` so tests and people
                              that count nodes or GPUs can leave it out (`-l 'loom.dev/simulated-gpu!=true'`)
  dcgm-exporter.monitoring    a pod on the node agent serving DCGM_FI_DEV_GPU_UTIL for the node's GPUs the way
                              dcgm-exporter does (gpu, UUID, Hostname, and pod/namespace/container of the pod holding
                              the GPU), scraped by the stack's Prometheus through its prometheus.io/* annotations

No GPU runs there, so nothing measures utilisation: the value each InferenceService's pods report is set by hand
with `loom dev gpu-utilization -n NS SERVICE PERCENT` (kept in the ConfigMap SETTINGS, key `<namespace>.<service>`;
0 until set). The exporter reads the pods and the settings on every scrape, so a replica the autoscaler adds
reports the same value as soon as it lands on the node.

`python -m loom.devstack.simgpu --port 9400 --node N --kubeconfig K` is the exporter pod's command.
"""

from __future__ import annotations

import argparse
import http.server
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Manifest = dict[str, Any]
Progress = Callable[[str], None]

NODE_NAME = "loom-simulated-gpu-0"
SIMULATED_LABEL = "loom.dev/simulated-gpu"
GPU_RESOURCE = "nvidia.com/gpu"
# The example's maxReplicas at one GPU each; small so it changes no count of the stack's own kwok GPUs much.
SIM_GPUS = 4
NAMESPACE, EXPORTER, EXPORTER_PORT = "monitoring", "dcgm-exporter", 9400
SETTINGS = "simulated-gpu-utilization"
# The label every pod of an InferenceService carries (operator/core/kit.labels).
SERVICE_LABEL = "loom.dev/inferenceservice"
DEVSTACK_LABEL = {"app.kubernetes.io/part-of": "loom-devstack"}
READY_TIMEOUT_S = 120.0


def node_manifest(name: str = NODE_NAME, gpus: int = SIM_GPUS) -> Manifest:
    """A GPU node as GPU clusters have them; kwok manages it (label type=kwok), but it carries the GPU taint
    instead of kwok's, so exactly the pods that tolerate GPU nodes (as the GPU examples do) land on it."""
    capacity = {"cpu": "8", "memory": "64Gi", "pods": "110", GPU_RESOURCE: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                # NVIDIA's GPU feature discovery's labels, for node selectors and affinity.
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.product": "Simulated-GPU",
                SIMULATED_LABEL: "true",
                **DEVSTACK_LABEL,
            },
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": [{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}]},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def exporter_manifests(kubeconfig: Path, node: str = NODE_NAME) -> list[Manifest]:
    """The settings ConfigMap (no data here: server-side apply then never drops what the verb wrote) and the
    exporter Deployment on the node agent (no toleration: the kwok nodes and the GPU node are tainted)."""
    labels = {"app.kubernetes.io/name": EXPORTER, **DEVSTACK_LABEL}
    container = {
        "name": EXPORTER,
        "image": "loom.local/devstack",  # recorded, never pulled: the agent runs this checkout's virtualenv
        "command": ["python", "-m", "loom.devstack.simgpu"],
        "args": ["--port", str(EXPORTER_PORT), "--node", node, "--kubeconfig", str(kubeconfig)],
        "ports": [{"name": "metrics", "containerPort": EXPORTER_PORT}],
        "readinessProbe": {"httpGet": {"path": "/metrics", "port": EXPORTER_PORT}, "periodSeconds": 2},
        "resources": {"requests": {"memory": "64Mi"}},
    }
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(EXPORTER_PORT),
        "prometheus.io/path": "/metrics",
    }
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": SETTINGS, "namespace": NAMESPACE, "labels": DEVSTACK_LABEL},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": EXPORTER, "namespace": NAMESPACE, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app.kubernetes.io/name": EXPORTER}},
                "template": {
                    "metadata": {"labels": labels, "annotations": annotations},
                    "spec": {"containers": [container], "terminationGracePeriodSeconds": 2},
                },
            },
        },
    ]


def settings_key(namespace: str, service: str) -> str:
    """A ConfigMap key per service: namespaces have no dots, so the first dot separates the two."""
    return f"{namespace}.{service}"


@dataclass(frozen=True)
class GpuPod:
    namespace: str
    name: str
    container: str
    gpus: int
    service: str  # its InferenceService, "" for any other pod


def gpu_pods(pods: Iterable[Mapping[str, Any]]) -> list[GpuPod]:
    """The pods that hold GPUs of the node (running, not being deleted), oldest first: GPU indices follow."""
    found = []
    live = [
        p for p in pods if not p["metadata"].get("deletionTimestamp") and p.get("status", {}).get("phase") == "Running"
    ]
    for pod in sorted(live, key=lambda p: (str(p["metadata"].get("creationTimestamp", "")), p["metadata"]["name"])):
        for container in pod["spec"]["containers"]:
            limits = (container.get("resources") or {}).get("limits") or {}
            if gpus := int(limits.get(GPU_RESOURCE, 0)):
                labels = pod["metadata"].get("labels") or {}
                found.append(
                    GpuPod(
                        pod["metadata"]["namespace"],
                        pod["metadata"]["name"],
                        container["name"],
                        gpus,
                        labels.get(SERVICE_LABEL, ""),
                    )
                )
    return found


def dcgm_text(node: str, total_gpus: int, pods: list[GpuPod], settings: Mapping[str, str]) -> str:
    """DCGM_FI_DEV_GPU_UTIL for every GPU of the node, labelled as dcgm-exporter labels it: with the holding
    pod's namespace/pod/container where one holds it, its service's set utilisation (0 unless set)."""
    lines = ["# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).", "# TYPE DCGM_FI_DEV_GPU_UTIL gauge"]
    index = 0
    for pod in pods:
        value = float(settings.get(settings_key(pod.namespace, pod.service), 0)) if pod.service else 0.0
        for _ in range(pod.gpus):
            if index >= total_gpus:
                break
            owner = f',container="{pod.container}",namespace="{pod.namespace}",pod="{pod.name}"'
            lines.append(f"DCGM_FI_DEV_GPU_UTIL{{{_gpu_labels(node, index)}{owner}}} {value:g}")
            index += 1
    for free in range(index, total_gpus):
        lines.append(f"DCGM_FI_DEV_GPU_UTIL{{{_gpu_labels(node, free)}}} 0")
    return "\n".join(lines) + "\n"


def _gpu_labels(node: str, index: int) -> str:
    return f'gpu="{index}",UUID="GPU-simulated-{node}-{index}",device="nvidia{index}",Hostname="{node}"'


# --- edges: the cluster -------------------------------------------------------------------------------------------


def ensure(cluster: Any, progress: Progress = print, timeout: float = READY_TIMEOUT_S) -> None:
    """Create the node (or fix its labels, taint and capacity) and the exporter, and wait until both are ready."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    started = time.monotonic()
    manifest = node_manifest()
    with cluster.api_client() as api:
        core = client.CoreV1Api(api)
        try:
            core.create_node(manifest)  # a Node's status may be set on create; kwok keeps what it finds
        except ApiException as err:
            if err.status != 409:
                raise
            core.patch_node(
                NODE_NAME, {"metadata": {"labels": manifest["metadata"]["labels"]}, "spec": manifest["spec"]}
            )
            core.patch_node_status(NODE_NAME, {"status": manifest["status"]})
    cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--field-manager=loom-devstack", "-f", "-",
        stdin=yaml.safe_dump_all(exporter_manifests(cluster.kubeconfig)),
    )  # fmt: skip
    cluster.kubectl("wait", "--for=condition=Ready", f"node/{NODE_NAME}", f"--timeout={int(timeout)}s")
    cluster.kubectl(
        "rollout",
        "status",
        f"deployment/{EXPORTER}",
        "-n",
        NAMESPACE,
        f"--timeout={int(timeout)}s",
        timeout=timeout + 30,
    )
    progress(
        f"simulated GPU node {NODE_NAME} ({SIM_GPUS} x {GPU_RESOURCE}, taint {GPU_RESOURCE}:NoSchedule) and"
        f" {EXPORTER}.{NAMESPACE} ready ({time.monotonic() - started:.1f}s); set what it reports with"
        " `loom dev gpu-utilization -n NS SERVICE PERCENT`"
    )


def set_utilization(api: Any, namespace: str, service: str, percent: float) -> list[str]:
    """Record `percent` for the InferenceService's pods; returns its pods now on the simulated node. LookupError
    when the service or the stack's exporter settings do not exist."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    try:
        client.CustomObjectsApi(api).get_namespaced_custom_object(
            "loom.dev", "v1alpha1", namespace, "inferenceservices", service
        )
    except ApiException as err:
        if err.status == 404:
            raise LookupError(f"no InferenceService {service} in namespace {namespace}") from None
        raise
    core = client.CoreV1Api(api)
    try:
        core.patch_namespaced_config_map(
            SETTINGS, NAMESPACE, {"data": {settings_key(namespace, service): f"{percent:g}"}},
            field_manager="loom-dev-gpu-utilization",
        )  # fmt: skip
    except ApiException as err:
        if err.status == 404:
            raise LookupError(
                f"the stack has no {EXPORTER} settings ({NAMESPACE}/{SETTINGS}): run `loom dev up`"
            ) from None
        raise
    pods = core.list_namespaced_pod(
        namespace, label_selector=f"{SERVICE_LABEL}={service}", field_selector=f"spec.nodeName={NODE_NAME}"
    ).items
    return sorted(p.metadata.name for p in pods)


# --- the exporter process -----------------------------------------------------------------------------------------


def _scrape_text(node: str, api: Any) -> str:
    from kubernetes import client

    core = client.CoreV1Api(api)
    # As JSON: the client's model objects cost more CPU than the requests themselves, twice a second.
    node_obj = json.loads(core.read_node(node, _preload_content=False).data)
    total = int(((node_obj.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, 0))
    pods = json.loads(
        core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}", _preload_content=False).data
    )
    settings = json.loads(core.read_namespaced_config_map(SETTINGS, NAMESPACE, _preload_content=False).data)
    return dcgm_text(node, total, gpu_pods(pods["items"]), settings.get("data") or {})


def serve(port: int, node: str, kubeconfig: str) -> None:
    from kubernetes import config

    # One client for the process: a new one per scrape parsed the kubeconfig and built a TLS context every second
    # (Prometheus' scrape and the readiness probe), most of this process's CPU.
    api = config.new_client_from_config(config_file=kubeconfig)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            try:
                body, status = _scrape_text(node, api).encode(), 200
            except Exception as error:  # a failed scrape is a 500 Prometheus records, not a crash
                body, status = f"reading the cluster failed: {error}\n".encode(), 500
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler).serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loom.devstack.simgpu", description="dcgm-exporter stand-in")
    parser.add_argument("--port", type=int, default=EXPORTER_PORT)
    parser.add_argument("--node", default=NODE_NAME)
    parser.add_argument("--kubeconfig", required=True)
    args = parser.parse_args(argv)
    serve(args.port, args.node, args.kubeconfig)


if __name__ == "__main__":
    main()
