"""A rolled-away replica finishes its in-flight requests (issue 11, scale-down drains).

An InferenceService with 2 replicas on the node agent holds slow requests (unary and streaming) through its
Service when it is scaled down to 1. The replica removed turns unready and leaves the Service's proxy at once,
runs its preStop sleep, gets SIGTERM, drains (not ready, Connection: close) and stops accepting; only then does
the test let the held requests finish. Every one completes with 200 and its full content, and fresh requests
(a new connection each, and keep-alive clients) keep succeeding throughout: zero failures.

The handler is a small module written for the test and put on the pod's PYTHONPATH (pods on the node agent see
the host's file system): answers name the pod that served them, and held requests wait for a `release` file
beside the module, so nothing depends on how long a step takes.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.servers import S3Endpoint
from loom.e2e.pytest_operator import OperatorProcess
from loom.e2e.pytest_services import apply_s3_secret
from loom.e2e.tests.test_inferenceservice import (
    agent_starts_between,
    manifest,
    service_url,
    upload_placeholder_model,
    wait_rolled_out,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

NAME = "drain"
HANDLER_MODULE = "loom_e2e_drain_handler"
HANDLER = '''
import socket
import time
from pathlib import Path

from loom.workloads.server.handlers import NoopModel
from loom.workloads.server.model import InferResponse

RELEASE = Path(__file__).with_name("release")


def held():
    """Wait for the test's release file (bounded, so a test that died leaves no pod hanging)."""
    deadline = time.monotonic() + 120
    while not RELEASE.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
        yield " tick"


class SlowModel(NoopModel):
    """Answers name their pod; `hold` requests wait for the release file (streams tick meanwhile)."""

    def predict(self, batch):
        if any(r.parameters.get("hold") for r in batch):
            for _ in held():
                pass
        host = socket.gethostname()
        return [InferResponse(list(r.inputs.values()), {"host": host, "released": RELEASE.exists()}) for r in batch]

    def generate(self, prompt, parameters):
        yield socket.gethostname()
        if parameters.get("hold"):
            yield from held()
            yield from ([f" done {i}" for i in range(5)] if RELEASE.exists() else [" timed out"])
'''
UNARY, STREAMS = 2, 4
DONE = [f" done {i}" for i in range(5)]


@dataclass
class Outcomes:
    """What a group of requests got: the pod of each success, and every failure."""

    hosts: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, call: Callable[[], str]) -> None:
        try:
            host, error = call(), None
        except Exception as exc:  # any failure counts; the test reports them all
            host, error = None, f"{type(exc).__name__}: {exc}"
        with self.lock:
            if error is not None:
                self.failures.append(error)
            else:
                assert host is not None
                self.hosts.append(host)

    def count(self) -> int:
        with self.lock:
            return len(self.hosts)


def _fresh() -> httpx.Client:
    # No keep-alive: each request a new connection, which the Service proxy places on a ready replica.
    return httpx.Client(trust_env=False, timeout=120, limits=httpx.Limits(max_keepalive_connections=0))


def _held_unary(url: str) -> str:
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}], "parameters": {"hold": True}}
    with _fresh() as client:
        response = client.post(f"{url}/v2/models/{NAME}/infer", json=body)
    if response.status_code != 200:
        raise AssertionError(f"HTTP {response.status_code}: {response.text[:200]}")
    doc = response.json()
    if doc["outputs"][0]["data"] != [1.0] or not doc["parameters"]["released"]:
        raise AssertionError(f"wrong answer {doc}")
    return str(doc["parameters"]["host"])


def _stream(url: str, hold: bool, client: httpx.Client | None = None, started: threading.Event | None = None) -> str:
    """One generate_stream call; its pieces checked whole. Returns the pod that served it."""
    pieces: list[str] = []
    body = {"text_input": "x", "parameters": {"hold": hold}}
    with contextlib.ExitStack() as stack:
        http = client or stack.enter_context(_fresh())
        stream = stack.enter_context(http.stream("POST", f"{url}/v2/models/{NAME}/generate_stream", json=body))
        if stream.status_code != 200:
            raise AssertionError(f"HTTP {stream.status_code}: {stream.read()[:200]!r}")
        for line in stream.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    raise AssertionError(f"stream error after {len(pieces)} pieces: {event['error']}")
                pieces.append(event["text_output"])
                if started is not None:
                    started.set()
    whole = pieces[-5:] == DONE and not set(pieces[1:-5]) - {" tick"} if hold else len(pieces) == 1
    if not whole:
        raise AssertionError(f"stream cut short or wrong: {pieces[:3]}...{pieces[-6:]}")
    return pieces[0]


@dataclass
class Load:
    """Quick requests until stopped: `fresh` workers open a connection per request, `kept` workers each reuse one
    keep-alive client (connections the drain must move off the leaving replica without an error)."""

    url: str
    fresh: int = 2
    kept: int = 3
    outcomes: Outcomes = field(default_factory=Outcomes)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def _run(self, keep_alive: bool) -> None:
        client = httpx.Client(trust_env=False, timeout=60) if keep_alive else None
        try:
            while not self.stop.is_set():
                if client is None:
                    with _fresh() as own:
                        self.outcomes.record(partial(_stream, self.url, False, own))
                else:
                    self.outcomes.record(partial(_stream, self.url, False, client))
                time.sleep(0.02)
        finally:
            if client is not None:
                client.close()

    def __enter__(self) -> Load:
        kinds = [False] * self.fresh + [True] * self.kept
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in kinds]
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def _pods(cluster: Cluster, ns: str) -> dict[str, dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={NAME}", "-o", "json").stdout
    return {p["metadata"]["name"]: p for p in json.loads(out)["items"]}


def _condition(cluster: Cluster, ns: str, pod: str, kind: str) -> dict[str, Any]:
    conditions = (_pods(cluster, ns).get(pod) or {}).get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def _refuses(ip: str, port: int) -> bool:
    try:
        socket.create_connection((ip, port), timeout=2).close()
    except OSError:
        return True
    return False


@pytest.fixture
def handler_dir(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / f"{HANDLER_MODULE}.py").write_text(HANDLER)
    yield tmp_path
    (tmp_path / "release").touch()  # whatever happened, no pod waits any longer


def test_a_rolled_away_replica_finishes_its_in_flight_requests(
    cluster: Cluster,
    loom_operator: OperatorProcess,
    operator_namespace: str,
    s3: S3Endpoint,
    bucket: str,
    handler_dir: Path,
) -> None:
    ns = operator_namespace
    apply_s3_secret(cluster, ns, s3)
    body = manifest(NAME, upload_placeholder_model(s3, bucket, "drain/v1"), s3, handler="noop", replicas=2)
    body["spec"]["handler"] = f"{HANDLER_MODULE}:SlowModel"
    body["spec"]["env"].append({"name": "PYTHONPATH", "value": str(handler_dir)})
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(body))
    wait_rolled_out(cluster, loom_operator, ns, NAME)
    replicas = {name: pod["status"]["podIP"] for name, pod in _pods(cluster, ns).items()}
    assert len(replicas) == 2
    url = service_url(ns, NAME)

    began = time.time()
    # Held requests first, alone on the Service: unary ones, then streams one after another (each once its first
    # piece came), so their connections alternate over the two replicas and each replica holds some.
    held = Outcomes()
    workers = [threading.Thread(target=held.record, args=(partial(_held_unary, url),)) for _ in range(UNARY)]
    for worker in workers:
        worker.start()
    for _ in range(STREAMS):
        started = threading.Event()
        workers.append(threading.Thread(target=held.record, args=(partial(_stream, url, True, None, started),)))
        workers[-1].start()
        wait_until(started.is_set, timeout=30, what="a held stream's first piece")

    with Load(url) as load:
        wait_until(lambda: load.outcomes.count() >= 20, timeout=30, what="quick requests flowing")
        steps: dict[str, float] = {"scaled": time.monotonic()}
        cluster.kubectl("scale", "inferenceservice", NAME, "-n", ns, "--replicas=1")
        leaving = wait_until(
            lambda: next((n for n, p in _pods(cluster, ns).items() if p["metadata"].get("deletionTimestamp")), None),
            timeout=30,
            what="a replica terminating",
        )
        steps["deleted"] = time.monotonic()
        # As the kubelet: unready at once (its preStop sleep still to run), the container signalled after it...
        wait_until(
            lambda: _condition(cluster, ns, leaving, "Ready").get("reason") == "PodTerminating",
            timeout=15,
            what="unready",
        )
        steps["unready"] = time.monotonic()
        quick_before = load.outcomes.count()
        wait_until(
            lambda: _condition(cluster, ns, leaving, "ContainersReady").get("status") == "False",
            timeout=30,
            what="SIGTERM after the preStop hook",
        )
        steps["sigterm"] = time.monotonic()
        # ...and the server, past its drain window, accepts nothing more; the held requests are still in flight.
        wait_until(lambda: _refuses(replicas[leaving], 8080), timeout=30, what="the leaving server closed its port")
        steps["closed"] = time.monotonic()
        assert all(worker.is_alive() for worker in workers)
        (handler_dir / "release").touch()
        for worker in workers:
            worker.join(timeout=60)
        wait_until(lambda: leaving not in _pods(cluster, ns), timeout=60, what=f"{leaving} gone")
        steps["gone"] = time.monotonic()
        quick_during = load.outcomes.count() - quick_before
        target = load.outcomes.count() + 10
        wait_until(lambda: load.outcomes.count() >= target, timeout=30, what="requests after it left")

    staying = (set(replicas) - {leaving}).pop()
    on_leaving = [h for h in held.hosts if h == leaving]
    timeline = ", ".join(f"{k} +{v - steps['scaled']:.1f}s" for k, v in steps.items())
    print(
        f"\n[drain] {timeline}; {len(on_leaving)} of {len(held.hosts)} held requests finished on {leaving};"
        f" quick requests: {load.outcomes.count()} ok ({quick_during} while it drained),"
        f" {len(load.outcomes.failures)} failed"
    )
    assert held.failures == [], held.failures
    assert len(held.hosts) == UNARY + STREAMS
    assert on_leaving, f"no held request reached the removed replica {leaving}: {held.hosts}"
    assert load.outcomes.failures == [], (
        f"{len(load.outcomes.failures)} failed quick requests, e.g. {load.outcomes.failures[:5]}; node agent"
        f" (re)started meanwhile: {agent_starts_between(began, time.time()) or 'no'}"
    )
    assert quick_during > 0
    assert set(load.outcomes.hosts[-10:]) == {staying}
    assert set(_pods(cluster, ns)) == {staying}
