"""P1, side by side: Loom's TrainingJob against Kubeflow's training-operator (PyTorchJob) on one control plane.

Each round applies N jobs of 2 pods each (Loom: 2 workers; Kubeflow: a Master and a Worker) in one
`kubectl apply --server-side` to a fresh namespace, with only that round's operator running, and measures:

- the total: seconds from the apply until all 2N pods exist;
- per job: from the moment the job object appeared (a watch of the jobs) to the moment its second pod appeared
  (a watch of the pods); p50 and p99 over the N jobs;
- the operator's CPU seconds over the round (its process' user + system time), per job;
- the control plane's (API server, etcd, scheduler, controller manager, kwok), per job: what the operator's
  requests and watches, and the pods it creates, cost the machine the two share.

Rounds alternate (Loom, Kubeflow, Loom tuned, Kubeflow tuned, and again), so a drift of the machine's load hits
both. Kubeflow at its defaults is held to 20 requests/s (burst 30) and one reconcile thread; tuned, QPS 1000,
burst 2000 and 6 threads. Loom has no request limit and no thread pool to tune (its client is async on one
event loop; Kopf runs up to 20 handlers at once): its tuned rounds are its defaults again, a second sample.

Kubeflow's training-operator is built from its Go module (github.com/kubeflow/training-operator v1.9.3,
devstack/cluster/go/kubeflow), its PyTorchJob CRD taken from that module's manifests. It manages webhook
certificates even with no webhook registered: it needs the Secret kubeflow/training-operator-webhook-cert (created
here empty; it fills it) and waits for the same files in /tmp/k8s-webhook-server/serving-certs (copied here from
the Secret, as a kubelet would mount it).

    python bench/bench_kubeflow_p1.py [--jobs 200] [--repeats 2] [--only Loom] [--requests] [--py-spy PATH]

`--requests` prints what each round asked of the API server, by verb and resource (apiserver_request_total).

Needs the stack (`loom dev up`, or it is started here). Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, watch

from loom.devstack.cluster import StackConfig, current, procs, up
from loom.devstack.cluster.build import build_bench_binary
from loom.devstack.cluster.gomod import module_dir
from loom.devstack.cluster.handle import Cluster
from loom.devstack.cluster.nodes import kwok_placement
from loom.devstack.servers import free_port
from loom.e2e.pytest_operator import apply_crds, operator_process
from loom.e2e.scale_specs import training_job
from loom.operator.settings import OperatorSettings

KUBEFLOW_MODULE, KUBEFLOW_VERSION = "github.com/kubeflow/training-operator", "v1.9.3"
CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")


def pytorch_job(name: str) -> dict[str, Any]:
    def replica() -> dict[str, Any]:
        container = {"name": "pytorch", "image": "loom/trainer:0.1.0", "command": ["torchrun"]}
        return {
            "replicas": 1,
            "restartPolicy": "OnFailure",
            "template": {"spec": {"containers": [container], **kwok_placement()}},
        }

    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {"pytorchReplicaSpecs": {"Master": replica(), "Worker": replica()}},
    }


@dataclass(frozen=True)
class Contender:
    name: str
    plural: str  # the job kind's resource, for the watch
    group: str
    version: str
    job_label: str  # the pod label naming the pod's job
    make: Callable[[str], dict[str, Any]]
    tuned: bool


@dataclass
class Seen:
    """Local arrival times of watch events: when each job appeared, when each job's pods appeared."""

    jobs: dict[str, float] = field(default_factory=dict)
    pods: dict[str, list[float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def pod_count(self) -> int:
        with self.lock:
            return sum(len(times) for times in self.pods.values())


def watch_round(
    cluster: Cluster, namespace: str, who: Contender, seen: Seen, stop: threading.Event
) -> list[threading.Thread]:
    def jobs() -> None:
        with cluster.api_client() as api:
            stream = watch.Watch()
            for event in stream.stream(client.CustomObjectsApi(api).list_namespaced_custom_object, who.group,
                                       who.version, namespace, who.plural, timeout_seconds=1800):  # fmt: skip
                if event["type"] == "ADDED":
                    with seen.lock:
                        seen.jobs.setdefault(event["object"]["metadata"]["name"], time.monotonic())
                if stop.is_set():
                    stream.stop()

    def pods() -> None:
        with cluster.api_client() as api:
            pods_api = client.CoreV1Api(api)

            def list_pods(*args: Any, **kwargs: Any) -> Any:
                # Undocumented on purpose: the watch finds no return type in the docstring and hands each event's
                # pod over as its JSON, where it would build a V1Pod model (a millisecond or more per event: the
                # observer fell behind in a round's busiest seconds and added it to both contenders' latencies).
                return pods_api.list_namespaced_pod(*args, **kwargs)

            stream = watch.Watch()
            names: set[str] = set()
            for event in stream.stream(list_pods, namespace, timeout_seconds=1800):
                meta = event["object"]["metadata"]
                job = (meta.get("labels") or {}).get(who.job_label)
                if event["type"] == "ADDED" and job and meta["name"] not in names:
                    names.add(meta["name"])
                    with seen.lock:
                        seen.pods.setdefault(job, []).append(time.monotonic())
                if stop.is_set():
                    stream.stop()

    threads = [threading.Thread(target=jobs, daemon=True), threading.Thread(target=pods, daemon=True)]
    for thread in threads:
        thread.start()
    return threads


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


# The stack's processes that do a round's work besides the operator (their records: devstack/cluster/procs.py).
CONTROL_PLANE = ("kube-apiserver", "etcd", "kube-scheduler", "kube-controller-manager", "kwok")


def control_plane_cpu() -> float:
    """CPU seconds used so far by the control plane (what the operator's requests and the pods cost it)."""
    records = [procs.read_record(name) for name in CONTROL_PLANE]
    return sum(cpu_seconds(record.pid) for record in records if record is not None)


def wait_ready(url: str, timeout: float, tick: Callable[[], None] = lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tick()
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout}s")


@dataclass(frozen=True)
class Running:
    """A started operator, shaped like `operator_process`'s handle: what a round reads is its process."""

    process: subprocess.Popen[bytes]


@contextmanager
def kubeflow_operator(cluster: Cluster, binary: Path, tuned: bool, log: Path) -> Iterator[Running]:
    """training-operator v1.9.3 for PyTorchJobs, at its defaults or tuned; yields it once it is ready."""
    probe = free_port()
    args = [str(binary), "--enable-scheme=pytorchjob", f"--metrics-bind-address=127.0.0.1:{free_port()}",
            f"--health-probe-bind-address=127.0.0.1:{probe}", f"--webhook-server-port={free_port()}"]  # fmt: skip
    if tuned:
        args += ["--kube-api-qps=1000", "--kube-api-burst=2000", "--controller-threads=6"]
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}

    def mount_certificates() -> None:  # what a kubelet does with the Secret the operator fills
        found = cluster.kubectl("get", "secret", "training-operator-webhook-cert", "-n", "kubeflow",
                                "-o", "jsonpath={.data}", check=False).stdout  # fmt: skip
        data = yaml.safe_load(found) if found else None
        if data and "tls.crt" in data:
            CERT_DIR.mkdir(parents=True, exist_ok=True)
            for key, value in data.items():
                (CERT_DIR / key).write_bytes(base64.b64decode(value))

    with open(log, "ab") as out:
        process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"http://127.0.0.1:{probe}/readyz", 120, mount_certificates)
            yield Running(process)
        finally:
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()


def install_kubeflow(cluster: Cluster) -> Path:
    source = module_dir(KUBEFLOW_MODULE, KUBEFLOW_VERSION)
    cluster.kubectl("apply", "--server-side", "-f", str(source / "manifests/base/crds/kubeflow.org_pytorchjobs.yaml"))
    cluster.kubectl("create", "namespace", "kubeflow", check=False)
    cluster.kubectl("create", "secret", "generic", "training-operator-webhook-cert", "-n", "kubeflow", check=False)
    return build_bench_binary("training-operator.v1")


@contextmanager
def profiled(pid: int, py_spy: str | None, out: Path) -> Iterator[None]:
    """Sample the operator with py-spy (`--py-spy`) for the block, into a collapsed-stack file (flame graph input)."""
    if py_spy is None:
        yield
        return
    sampler = subprocess.Popen([py_spy, "record", "-p", str(pid), "-o", str(out), "--format", "raw", "--rate", "50",
                                "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        yield
    finally:
        sampler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        sampler.wait(60)
        print(f"{out}: py-spy samples of the operator during the round")


def one_round(
    cluster: Cluster, who: Contender, jobs: int, binary: Path, workdir: Path, py_spy: str | None = None
) -> dict[str, float]:
    log = workdir / f"{who.name}.log"
    prefix = f"p1{uuid.uuid4().hex[:6]}"
    namespace = f"{prefix}-{who.name.lower()}"
    if who.name == "Loom":
        # Kopf's default worker limit and Loom's settings: nothing to tune (see the module docstring). The test
        # harness polls a running job every second (LOOM_TRAINING_POLL_S=1, for quick tests): the defaults here,
        # as for Kubeflow.
        defaults = OperatorSettings.model_fields
        settings = {
            "LOOM_LOG_LEVEL": "WARNING",
            "LOOM_TRAINING_POLL_S": str(defaults["training_poll_s"].default),
            "LOOM_NODE_LOST_GRACE_S": str(defaults["node_lost_grace_s"].default),
        }
        operator = operator_process(cluster, log, settings, prefix)
    else:
        operator = kubeflow_operator(cluster, binary, who.tuned, log)
    with operator as handle:
        pid = handle.process.pid
        cluster.kubectl("create", "namespace", namespace)
        while cluster.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode != 0:
            time.sleep(0.25)
        seen, stop = Seen(), threading.Event()
        threads = watch_round(cluster, namespace, who, seen, stop)
        time.sleep(2)  # both watches open before the apply
        cpu_before, control_before = cpu_seconds(pid), control_plane_cpu()
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle_file:
            yaml.safe_dump_all([who.make(f"j-{i}") for i in range(jobs)], handle_file)
        with profiled(pid, py_spy if who.name == "Loom" else None, workdir / f"{namespace}.pyspy.txt"):
            applied = time.monotonic()
            cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", handle_file.name, timeout=900)
            os.unlink(handle_file.name)
            deadline = applied + 900
            while seen.pod_count() < 2 * jobs:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{who.name}: {seen.pod_count()} of {2 * jobs} pods after 900s")
                time.sleep(0.1)
            done = time.monotonic()
        cpu, control = cpu_seconds(pid) - cpu_before, control_plane_cpu() - control_before
        stop.set()
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
    with seen.lock:
        per_job = sorted(
            max(seen.pods[name]) - seen.jobs[name] for name in seen.jobs if len(seen.pods.get(name, [])) >= 2
        )
    for thread in threads:
        thread.join(timeout=1)
    # The next round starts once this round's namespace is gone, every object in it: its pods (the kwok nodes' room)
    # and the rest. Waiting for the pods alone left the namespace controller deleting the rest (Kubeflow's two
    # Services a job and their endpoints, Loom's Service and ConfigMap, both's Events) during the next round, a cost
    # of the round before charged to the other contender's round (its control plane's CPU and its API server's
    # latency), and larger after Kubeflow's rounds, which leave more objects.
    deadline = time.monotonic() + 600
    while cluster.kubectl("get", "namespace", namespace, "-o", "name", check=False).returncode == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"namespace {namespace} still there 600 s after its deletion")
        time.sleep(1)
    return {
        "total": done - applied,
        "p50": statistics.median(per_job),
        "p99": per_job[max(0, round(0.99 * len(per_job)) - 1)],
        "cpu_per_job": cpu / jobs,
        "control_plane_cpu_per_job": control / jobs,
    }


KEYS = ("total", "p50", "p99", "cpu_per_job", "control_plane_cpu_per_job")


def api_requests(cluster: Cluster) -> Counter[tuple[str, str, str]]:
    """The API server's requests so far by (verb, resource, subresource), from its apiserver_request_total."""
    counts: Counter[tuple[str, str, str]] = Counter()
    for line in cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout.splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            key = (labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", ""))
            counts[key] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def print_requests(by_round: dict[str, Counter[tuple[str, str, str]]], top: int = 30) -> None:
    """One column per round: what each asked of the API server (the previous round's namespace clean-up included)."""
    names = list(by_round)
    keys = sorted({k for c in by_round.values() for k in c}, key=lambda k: -sum(c[k] for c in by_round.values()))
    print("\nAPI requests per round (verb resource subresource): " + " | ".join(names))
    for key in keys[:top]:
        print(f"  {' '.join(part for part in key if part):40} " + " ".join(f"{by_round[n][key]:8}" for n in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--py-spy", metavar="PATH", help="py-spy binary: sample Loom's operator in its rounds")
    parser.add_argument("--only", choices=["Loom", "Kubeflow"], help="run one contender's rounds (a before/after)")
    parser.add_argument("--requests", action="store_true", help="count each round's API requests by verb and resource")
    args = parser.parse_args()
    cluster = current() or up(StackConfig())
    apply_crds(cluster)
    binary = install_kubeflow(cluster)
    loom = ("trainingjobs", "loom.dev", "v1alpha1", "loom.dev/trainingjob", training_job)
    kubeflow = ("pytorchjobs", "kubeflow.org", "v1", "training.kubeflow.org/job-name", pytorch_job)
    contenders = [
        Contender("Loom", *loom, tuned=False),
        Contender("Kubeflow", *kubeflow, tuned=False),
        Contender("Loom", *loom, tuned=True),
        Contender("Kubeflow", *kubeflow, tuned=True),
    ]
    contenders = [who for who in contenders if args.only in (None, who.name)]
    workdir = Path(tempfile.mkdtemp(prefix="bench-p1-"))
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    requests: dict[str, Counter[tuple[str, str, str]]] = {}
    for repeat in range(args.repeats):
        for who in contenders:
            before = api_requests(cluster) if args.requests else Counter()
            result = one_round(cluster, who, args.jobs, binary, workdir, args.py_spy)
            if args.requests:
                requests[f"{repeat + 1} {who.name}{' tuned' if who.tuned else ''}"] = api_requests(cluster) - before
            results.setdefault((who.name, who.tuned), []).append(result)
            print(f"round {repeat + 1} {who.name}{' tuned' if who.tuned else ''}: " + ", ".join(
                f"{key} {value:.3f}" for key, value in result.items()), flush=True)  # fmt: skip

    def best(name: str, tuned: bool, key: str) -> float:
        return min(r[key] for r in results[(name, tuned)])

    if requests:
        print_requests(requests)
    print(f"\n{args.jobs} jobs x 2 pods; best of {args.repeats} rounds each; logs in {workdir}")
    for tuned in (False, True):
        label = "tuned" if tuned else "defaults"
        if args.only:
            for key in KEYS:
                print(f"{label:8} {key:25} {args.only} {best(args.only, tuned, key):8.3f}")
            continue
        for key in KEYS:
            loom_value, kubeflow_value = best("Loom", tuned, key), best("Kubeflow", tuned, key)
            print(f"{label:8} {key:25} Loom {loom_value:8.3f}  Kubeflow {kubeflow_value:8.3f}  "
                  f"Kubeflow/Loom {kubeflow_value / loom_value:5.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
