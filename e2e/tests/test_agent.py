"""The node agent really runs pods: a served Deployment behind a Service, restarts, logs, a failing
Job, headless DNS and volumes, and nothing left behind after deletion."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client

from loom.devstack.agent import service_address
from loom.devstack.cluster import Cluster, procs
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.devstack.cluster.pki import AGENT_NODE_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
ON_AGENT = {"kubernetes.io/hostname": AGENT_NODE_NAME}

# Answers every GET with its own pod name; binds the wildcard address, as most servers do, so two
# replicas on the same port only work because each pod owns its 127.x address.
ECHO_SERVER = """
import http.server, os
name = os.environ["POD_NAME"]
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/ready" and os.path.exists("unready"):  # a file in the pod's work dir
            self.send_response(503); self.end_headers(); return
        self.send_response(200); self.end_headers(); self.wfile.write(name.encode())
    def log_message(self, *args):
        pass
print(f"serving {name}", flush=True)
http.server.ThreadingHTTPServer(("", 8080), Echo).serve_forever()
"""

CLIENT = """
import json, time, urllib.request
answers = set()
for attempt in range(40):  # endpoints may still be propagating: stop once both replicas answered
    host = ["echo", "echo.NS", "echo.NS.svc", "echo.NS.svc.cluster.local"][attempt % 4]
    answers.add(urllib.request.urlopen(f"http://{host}/", timeout=5).read().decode())
    if len(answers) == 2:
        break
    time.sleep(0.2)
print(json.dumps(sorted(answers)))
"""


def _apply(cluster: Cluster, namespace: str, *manifests: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump_all(manifests))


def _pod(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return dict(json.loads(cluster.kubectl("get", "pod", "-n", namespace, name, "-o", "json").stdout))


def _pods(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    items = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout)["items"]
    return [p for p in items if "deletionTimestamp" not in p["metadata"]]


def _pids(uid: str) -> list[int]:
    """Launcher and command pids the agent recorded for a pod."""
    pids = []
    for container in (AGENT_STATE_DIR / "pods" / uid / "c").glob("*"):
        with_run = container / "run.json"
        if with_run.exists():
            pids.append(int(json.loads(with_run.read_text())["launcher_pid"]))
        if (container / "pid").exists():
            pids.append(int((container / "pid").read_text()))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _echo(namespace: str) -> list[dict[str, Any]]:
    labels = {"app": "echo"}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "echo"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": ON_AGENT,
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "server",
                            "image": "python:3.11-slim",
                            "command": ["python", "-c", ECHO_SERVER],
                            "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                            "ports": [{"name": "http", "containerPort": 8080}],
                            "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
                            "livenessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 2},
                        }
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "echo"},
        "spec": {"selector": labels, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }
    return [deployment, service]


def test_deployment_serves_through_its_service_restarts_and_cleans_up(cluster: Cluster, namespace: str) -> None:
    _apply(cluster, namespace, *_echo(namespace))
    cluster.kubectl("wait", "-n", namespace, "deployment/echo", "--for=condition=Available", "--timeout=120s")
    pods = _pods(cluster, namespace, "app=echo")
    names = sorted(p["metadata"]["name"] for p in pods)
    ips = {p["status"]["podIP"] for p in pods}
    assert len(pods) == 2 and len(ips) == 2 and all(ip.startswith("127.") for ip in ips)
    assert all(p["spec"]["nodeName"] == AGENT_NODE_NAME for p in pods)

    # A third pod reaches both replicas through the Service's DNS names.
    client_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "client"},
        "spec": {
            "nodeSelector": ON_AGENT,
            "restartPolicy": "Never",
            "containers": [
                {"name": "client", "image": "python", "command": ["python", "-c", CLIENT.replace("NS", namespace)]}
            ],
        },
    }
    _apply(cluster, namespace, client_pod)
    wait_until(
        lambda: _pod(cluster, namespace, "client")["status"].get("phase") in ("Succeeded", "Failed"),
        timeout=60,
        what="the client pod to finish",
    )
    logs = cluster.kubectl("logs", "-n", namespace, "client").stdout
    assert _pod(cluster, namespace, "client")["status"]["phase"] == "Succeeded", logs
    assert json.loads(logs) == names

    # The host reaches the Service too, through the address the agent publishes.
    address = wait_until(lambda: _try_address("echo", namespace), timeout=30, what="the echo service address")
    assert _answers(address) == set(names)

    # A replica that turns unready gets no more connections through the Service.
    unready = AGENT_STATE_DIR / "pods" / pods[1]["metadata"]["uid"] / "work" / "unready"
    unready.touch()
    wait_until(
        lambda: not _is_ready(_pod(cluster, namespace, names_of(pods)[1])),
        timeout=30,
        what="the replica to turn unready",
    )
    wait_until(lambda: _answers(address) == {names_of(pods)[0]}, timeout=30, what="the service to skip it")
    unready.unlink()
    wait_until(lambda: _answers(address) == set(names), timeout=30, what="the replica to serve again")

    # Killing the server process makes the agent restart it.
    victim = pods[0]
    child = int((AGENT_STATE_DIR / "pods" / victim["metadata"]["uid"] / "c" / "server" / "pid").read_text())
    os.kill(child, 9)

    def restarted() -> bool:
        status = _pod(cluster, namespace, victim["metadata"]["name"])["status"]
        server = status["containerStatuses"][0]
        return server["restartCount"] == 1 and server["ready"]

    wait_until(restarted, timeout=60, what="the killed server to be restarted")
    server_status = _pod(cluster, namespace, victim["metadata"]["name"])["status"]["containerStatuses"][0]
    assert server_status["lastState"]["terminated"]["exitCode"] == 137
    logs = cluster.kubectl("logs", "-n", namespace, victim["metadata"]["name"]).stdout
    previous = cluster.kubectl("logs", "-n", namespace, victim["metadata"]["name"], "--previous").stdout
    assert logs == previous == f"serving {victim['metadata']['name']}\n"

    # Deleting the Deployment leaves no process behind.
    recorded = [pid for p in _pods(cluster, namespace, "app=echo") for pid in _pids(p["metadata"]["uid"])]
    assert len(recorded) == 4 and all(_alive(pid) for pid in recorded)
    cluster.kubectl("delete", "-n", namespace, "deployment/echo", "--wait=true")
    wait_until(lambda: not _pods_any(cluster, namespace, "app=echo"), timeout=60, what="echo pods to be gone")
    assert [pid for pid in recorded if _alive(pid)] == []


def names_of(pods: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


def _is_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def _answers(address: str) -> set[str]:
    return {httpx.get(f"http://{address}:80/", timeout=5, trust_env=False).text for _ in range(6)}


def _try_address(name: str, namespace: str) -> str | None:
    try:
        return service_address(name, namespace, AGENT_STATE_DIR)
    except (OSError, KeyError, ValueError):
        return None


def _pods_any(cluster: Cluster, namespace: str, selector: str | None = None) -> list[Any]:
    """Pods, terminating ones included."""
    selection = ["-l", selector] if selector else []
    out = json.loads(cluster.kubectl("get", "pods", "-n", namespace, *selection, "-o", "json").stdout)
    return list(out["items"])


SAY_AND_FAIL = "echo about to fail; printf 'disk on fire' > /dev/termination-log; exit 1"


def test_failing_job_ends_failed_with_exit_code(cluster: Cluster, namespace: str) -> None:
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "fails"},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "nodeSelector": ON_AGENT,
                    "restartPolicy": "Never",
                    "containers": [
                        {"name": "main", "image": "busybox", "command": ["sh", "-c", SAY_AND_FAIL]}
                    ],
                }
            },
        },
    }
    _apply(cluster, namespace, job)

    def failed() -> bool:
        conditions = json.loads(cluster.kubectl("get", "job", "-n", namespace, "fails", "-o", "json").stdout)
        return any(
            c["type"] == "Failed" and c["status"] == "True" for c in conditions.get("status", {}).get("conditions", [])
        )

    wait_until(failed, timeout=90, what="the job to fail")
    pod = _pods_any(cluster, namespace, "job-name=fails")[0]
    assert pod["status"]["phase"] == "Failed"
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 1 and terminated["reason"] == "Error"
    assert terminated["message"] == "disk on fire"  # terminationMessagePath, as the kubelet reports it
    logs = cluster.kubectl("logs", "-n", namespace, pod["metadata"]["name"]).stdout
    assert logs == "about to fail\n"
    events = json.loads(
        cluster.kubectl(
            "get",
            "events",
            "-n",
            namespace,
            "--field-selector",
            f"involvedObject.name={pod['metadata']['name']}",
            "-o",
            "json",
        ).stdout
    )
    assert "Started" in {e["reason"] for e in events["items"]}


def test_headless_names_volumes_and_bad_pods(cluster: Cluster, namespace: str, kube_api: client.ApiClient) -> None:
    core = client.CoreV1Api(kube_api)
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "settings"}, "data": {"mode": "fast"}})
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "workers"},
        "spec": {
            "clusterIP": "None",
            "selector": {"role": "worker"},
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rdzv", "port": 29500}],
        },
    }
    worker = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "worker-0", "labels": {"role": "worker"}},
        "spec": {
            "nodeSelector": ON_AGENT,
            "hostname": "worker-0",
            "subdomain": "workers",
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "python", "command": ["sleep", "600"]}],
        },
    }
    probe = (
        "import socket; print(socket.gethostbyname('worker-0.workers.NS.svc.cluster.local'), "
        "socket.gethostbyname('worker-0.workers.NS.svc'), open('/etc/settings/mode').read(), "
        "open('/data/note').read() if __import__('os').path.exists('/data/note') else 'none', socket.gethostname())"
    ).replace("NS", namespace)
    reader = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "reader"},
        "spec": {
            "nodeSelector": ON_AGENT,
            "restartPolicy": "Never",
            "hostname": "reader",
            "initContainers": [
                {
                    "name": "write",
                    "image": "sh",
                    "command": ["sh", "-c", "echo -n kept > /data/note"],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }
            ],
            "containers": [
                {
                    "name": "main",
                    "image": "python",
                    "command": ["python", "-c", probe],
                    "volumeMounts": [
                        {"name": "settings", "mountPath": "/etc/settings"},
                        {"name": "data", "mountPath": "/data"},
                    ],
                }
            ],
            "volumes": [{"name": "settings", "configMap": {"name": "settings"}}, {"name": "data", "emptyDir": {}}],
        },
    }
    broken = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "broken"},
        "spec": {
            "nodeSelector": ON_AGENT,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": "python",
                    "command": ["python"],
                    "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}],
                }
            ],
        },
    }
    _apply(cluster, namespace, headless, worker, broken)
    wait_until(lambda: _pod(cluster, namespace, "worker-0")["status"].get("podIP"), timeout=60, what="worker ip")
    _apply(cluster, namespace, reader)
    wait_until(
        lambda: _pod(cluster, namespace, "reader")["status"].get("phase") in ("Succeeded", "Failed"),
        timeout=60,
        what="the reader pod to finish",
    )
    worker_ip = _pod(cluster, namespace, "worker-0")["status"]["podIP"]
    logs = cluster.kubectl("logs", "-n", namespace, "reader").stdout
    assert logs.split() == [worker_ip, worker_ip, "fast", "kept", "reader"]

    def waiting_reason() -> str | None:
        statuses = _pod(cluster, namespace, "broken")["status"].get("containerStatuses") or []
        return statuses[0]["state"].get("waiting", {}).get("message") if statuses else None

    message = wait_until(waiting_reason, timeout=60, what="the broken pod to report why")
    assert 'secret "absent" not found' in message
    assert _pod(cluster, namespace, "worker-0")["status"]["phase"] == "Running"  # the other pods are unaffected


# Serial: it stops the node agent every test session shares (a fresh-clone run saw it wait past 30 s for the agent to
# exit while another session's pods were stopping on it).
@pytest.mark.serial
def test_agent_restart_re_adopts_pods_and_reaps_deleted_ones(cluster: Cluster, namespace: str) -> None:
    def sleeper(name: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": ON_AGENT,
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "600"]}],
            },
        }

    _apply(cluster, namespace, sleeper("keeper"), sleeper("doomed"), sleeper("graceful"))
    for name in ("keeper", "doomed", "graceful"):
        wait_until(
            lambda name=name: _pod(cluster, namespace, name)["status"].get("phase") == "Running",
            timeout=60,
            what=f"{name} to run",
        )
    keeper, doomed = _pod(cluster, namespace, "keeper"), _pod(cluster, namespace, "doomed")
    keeper_pids, doomed_pids = _pids(keeper["metadata"]["uid"]), _pids(doomed["metadata"]["uid"])
    graceful_pids = _pids(_pod(cluster, namespace, "graceful")["metadata"]["uid"])
    assert len(keeper_pids) == len(doomed_pids) == len(graceful_pids) == 2

    # SIGHUP: the agent exits and leaves its pods running.
    record = procs.running("node-agent")
    assert record is not None, "the stack's node agent is not running"
    os.kill(record.pid, signal.SIGHUP)
    wait_until(lambda: procs.running("node-agent") is None, timeout=60, what="the agent to exit")
    assert all(_alive(pid) for pid in keeper_pids + doomed_pids + graceful_pids)
    # While it is away, one pod is force-deleted (gone from the API) and one deleted gracefully (waits for us).
    cluster.kubectl("delete", "pod", "-n", namespace, "doomed", "--grace-period=0", "--force")
    cluster.kubectl("delete", "pod", "-n", namespace, "graceful", "--wait=false")
    procs.start("node-agent", record.argv, env={**os.environ, "PYTHONSAFEPATH": "1"})

    wait_until(
        lambda: not any(_alive(pid) for pid in doomed_pids + graceful_pids),
        timeout=60,
        what="the deleted pods' processes to die",
    )
    wait_until(
        lambda: names_of(_pods_any(cluster, namespace)) == ["keeper"],
        timeout=60,
        what="the gracefully deleted pod to be removed",
    )
    assert all(_alive(pid) for pid in keeper_pids), "the running pod was not re-adopted"
    child = int((AGENT_STATE_DIR / "pods" / keeper["metadata"]["uid"] / "c" / "main" / "pid").read_text())
    os.kill(child, signal.SIGKILL)  # the adopted process ends: the new agent notices and restarts it

    def restarted() -> bool:
        status = _pod(cluster, namespace, "keeper")["status"]["containerStatuses"][0]
        return status["restartCount"] == 1 and "running" in status["state"]

    wait_until(restarted, timeout=60, what="the adopted container to be restarted")
