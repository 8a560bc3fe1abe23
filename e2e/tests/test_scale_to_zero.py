"""Scale to zero and back without Knative, on the local stack: examples/inferenceservice-queue-depth-scale-to-zero.yaml
(a tiny chargpt, queue-depth metric, minReplicas 0) with the real Prometheus scraping the server, the operator as
a subprocess (1 s autoscaler rounds, a 3 s idle period, a 60 s activator bound) and the activator as a real pod
with its own ServiceAccount.

- The service starts with one replica, idles to zero (ScaledToZero), and its Service turns to the activator.
- At zero, a streamed request and a plain one arrive together: both are held, the activator wakes the service
  through its scale subresource (one wake), and both succeed, the stream event by event.
- The Service turns back to the model servers once a replica is Ready.
- A service that cannot come up (its model is missing) answers a held request with 503 + Retry-After after the
  bound (run alongside, so the test costs about the bound, not the sum).
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.servers import S3Endpoint
from loom.e2e.exporter import local_prometheus
from loom.e2e.pytest_operator import OperatorProcess, apply_crds, operator_namespace_for, operator_process
from loom.e2e.pytest_services import apply_s3_secret

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inferenceservice-queue-depth-scale-to-zero.yaml"
BOUND_S = 60
TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def zero_operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    apply_crds(cluster)
    log = tmp_path_factory.mktemp("loom-operator") / "loom_operator.log"
    with local_prometheus(cluster, tmp_path_factory.mktemp("prometheus")) as prometheus:
        env = {
            "LOOM_PROMETHEUS_URL": prometheus.url,
            "LOOM_AUTOSCALE_INTERVAL_S": "1",
            "LOOM_ACTIVATOR_TIMEOUT_S": str(BOUND_S),
        }
        with operator_process(cluster, log, env) as handle:
            yield handle
    print(f"[loom operator] log: {log}", file=sys.__stderr__)


def service(namespace: str, name: str, s3: S3Endpoint, uri: str) -> dict[str, Any]:
    """The example as written, on this stack's S3 and node agent, idling after 3 s."""
    (obj,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    obj["metadata"]["name"] = name
    spec = obj["spec"]
    assert "replicas" not in spec and spec["autoscaling"]["minReplicas"] == 0
    spec["model"] = {"uri": uri, "endpoint": s3.url, "secretRef": {"name": "s3-credentials"}}
    spec["nodeSelector"] = {"kubernetes.io/hostname": AGENT_NODE_NAME}
    spec["env"] = [{"name": "AWS_DEFAULT_REGION", "value": s3.region}]
    spec.pop("resources", None)
    spec["autoscaling"]["idleSeconds"] = 3
    spec["autoscaling"]["scaleDown"] = {"stabilizationWindowSeconds": 0}
    return dict(obj)


def upload_tiny_chargpt(s3: S3Endpoint, bucket: str, tmp_path: Path) -> str:
    import torch

    from loom.workloads.server.chargpt_handler import save_for_serving
    from loom.workloads.trainer.examples import chargpt

    torch.manual_seed(0)
    folder = save_for_serving(chargpt.GPT(chargpt.GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)), tmp_path)
    for path in folder.iterdir():
        s3.client().put_object(Bucket=bucket, Key=f"tiny/{path.name}", Body=path.read_bytes())
    return f"s3://{bucket}/tiny"


class Stack:
    def __init__(self, cluster: Cluster, namespace: str, op: OperatorProcess) -> None:
        self.cluster, self.ns, self.op = cluster, namespace, op

    def get(self, kind: str, name: str) -> dict[str, Any]:
        return dict(json.loads(self.cluster.kubectl("get", kind, name, "-n", self.ns, "-o", "json").stdout))

    def pods(self, name: str, component: str) -> list[dict[str, Any]]:
        selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component={component}"
        out = self.cluster.kubectl("get", "pods", "-n", self.ns, "-l", selector, "-o", "json").stdout
        return list(json.loads(out)["items"])

    def ready_ip(self, name: str, component: str) -> str | None:
        for pod in self.pods(name, component):
            conditions = pod.get("status", {}).get("conditions", [])
            if not pod["metadata"].get("deletionTimestamp") and any(
                c["type"] == "Ready" and c["status"] == "True" for c in conditions
            ):
                return str(pod["status"]["podIP"])
        return None

    def routed_to(self, name: str) -> str:
        return str(self.get("service", name)["spec"]["selector"]["app.kubernetes.io/component"])

    def until(self, check: Any, what: str, timeout: float = TIMEOUT_S) -> Any:
        try:
            return wait_until(check, timeout=timeout, what=what, interval=0.25)
        except TimeoutError as error:
            raise AssertionError(f"{error}\n{self.context()}") from None

    def context(self) -> str:
        """What a failure needs: objects, replicas, the activators' and the operator's logs."""
        kubectl = self.cluster.kubectl
        objects = kubectl("get", "inferenceservices,pods,svc,deploy", "-n", self.ns, "-o", "wide", check=False).stdout
        replicas = kubectl(
            "get", "inferenceservices", "-n", self.ns, "-o",
            "custom-columns=NAME:.metadata.name,SPEC:.spec.replicas,READY:.status.readyReplicas", check=False,
        ).stdout  # fmt: skip
        logs = kubectl(
            "logs", "-n", self.ns, "-l", "app.kubernetes.io/component=activator", "--tail=40", "--prefix", check=False
        )
        return f"{objects}\n{replicas}\nactivators:\n{logs.stdout}{logs.stderr}\n{self.op.log_tail(60)}"

    def url(self, name: str, endpoint: str) -> str:
        return f"http://{service_address(name, self.ns, AGENT_STATE_DIR)}:80/v2/models/{name}/{endpoint}"


def generate(stack: Stack, name: str) -> tuple[httpx.Response, float]:
    """The answer to one generate call and how long it took."""
    body = {"text_input": "To be", "parameters": {"max_tokens": 8, "temperature": 0}}
    sent = time.monotonic()
    response = httpx.post(stack.url(name, "generate"), json=body, timeout=BOUND_S + 30, trust_env=False)
    return response, time.monotonic() - sent


def stream(stack: Stack, name: str) -> tuple[int, str, list[dict[str, Any]]]:
    """(status, content type, events) of one generate_stream call. Whether events are relayed one by one, not
    buffered, is tested against a server that holds its second event back (tests/unit/test_activator_app.py):
    here a tiny model's events may leave the server in one segment."""
    body = {"text_input": "To be", "parameters": {"max_tokens": 16, "temperature": 0}}
    buffer = b""
    with httpx.stream("POST", stack.url(name, "generate_stream"), json=body, timeout=BOUND_S + 30,
                      trust_env=False) as response:  # fmt: skip
        for chunk in response.iter_raw():
            buffer += chunk
        status, kind = response.status_code, response.headers.get("content-type", "")
    events = [json.loads(line[5:]) for line in buffer.decode().splitlines() if line.startswith("data:")]
    return status, kind, events


def test_scales_to_zero_holds_and_wakes_streams_through_and_bounds_the_wait(
    cluster: Cluster, zero_operator: OperatorProcess, s3: S3Endpoint, bucket: str, tmp_path: Path
) -> None:
    started = time.monotonic()
    with operator_namespace_for(cluster, zero_operator) as namespace:
        stack = Stack(cluster, namespace, zero_operator)
        apply_s3_secret(cluster, namespace, s3)
        good, broken = "chat", "broken"
        docs = [
            service(namespace, good, s3, upload_tiny_chargpt(s3, bucket, tmp_path)),
            service(namespace, broken, s3, f"s3://{bucket}/no-such-model"),  # its fetch fails: never Ready
        ]
        cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump_all(docs))

        with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
            # A service that cannot come up: the Service points at its activator, which holds, then gives up.
            stack.until(lambda: stack.ready_ip(broken, "activator"), "the broken service's activator ready")
            stack.until(lambda: stack.routed_to(broken) == "activator", "the broken service routed to its activator")
            refused = pool.submit(generate, stack, broken)

            # One replica first, then idle: zero, and the Service points at the activator.
            stack.until(lambda: stack.get("inferenceservice", good)["status"].get("readyReplicas") == 1, "1 ready")
            def at_zero() -> bool:
                obj = stack.get("inferenceservice", good)
                scaled = (obj.get("status") or {}).get("autoscaling") or {}
                return obj["spec"].get("replicas") == 0 and scaled.get("lastScaleReason") == "ScaledToZero"

            stack.until(at_zero, "scaled to zero after the idle period (and reported)")
            # Once woken it should stay up while this test looks at it: a longer idle period from now on.
            patch = {"spec": {"autoscaling": {"idleSeconds": 60}}}
            cluster.kubectl("patch", "inferenceservice", good, "-n", namespace, "--type=merge", "-p", json.dumps(patch))
            stack.until(lambda: not stack.pods(good, "server"), "no model server left")
            stack.until(lambda: stack.routed_to(good) == "activator", "the Service routed to the activator")
            activator_ip = stack.until(lambda: stack.ready_ip(good, "activator"), "the activator ready")

            # At zero: a stream and a plain request together. Both held, one wake, both answered.
            woken = time.monotonic()
            streamed = pool.submit(stream, stack, good)
            plain = pool.submit(generate, stack, good)
            status, kind, events = streamed.result()
            answer, _ = plain.result()
            print(f"[scale-to-zero] request at zero -> answered: {time.monotonic() - woken:.2f}s", file=sys.__stderr__)
            assert status == 200, f"{events}\n{stack.context()}"
            assert kind.startswith("text/event-stream") and len(events) == 16, (kind, events)  # one per token
            assert all("error" not in e and e["model_name"] == good for e in events), events
            assert answer.status_code == 200, answer.text
            assert answer.json()["text_output"]

            awake = stack.get("inferenceservice", good)
            assert awake["spec"]["replicas"] == 1  # written through the scale subresource by the activator
            metrics = httpx.get(f"http://{activator_ip}:9090/metrics", timeout=10, trust_env=False).text
            service_label = f'service="{namespace}/{good}"'
            assert f"loom_activator_wakes_total{{{service_label}}} 1.0" in metrics, metrics
            held = f'loom_activator_requests_total{{outcome="held_forwarded",{service_label}}} 2.0'
            assert held in metrics, metrics
            wake_s = next(
                float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("loom_activator_wake_duration_seconds_sum")
            )  # fmt: skip
            print(f"[scale-to-zero] wake (scale 0 -> 1 to a Ready replica): {wake_s:.2f}s", file=sys.__stderr__)
            # Serving again: the Service goes straight to the model servers.
            stack.until(lambda: stack.routed_to(good) == "server", "the Service routed back to the model servers")

            # Past the bound: 503 with Retry-After, from the activator.
            late, held_s = refused.result()
            assert late.status_code == 503, late.text
            assert late.json()["code"] == "activator_timeout"
            assert int(late.headers["retry-after"]) > 0
            print(f"[scale-to-zero] held until the bound ({BOUND_S}s): {held_s:.1f}s", file=sys.__stderr__)
    print(f"[scale-to-zero] test wall time: {time.monotonic() - started:.1f}s", file=sys.__stderr__)
