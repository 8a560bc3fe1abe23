"""The node agent's pod worker with real processes (no API server): the pod's data comes from a fake
fetcher. Needs root, like the agent itself (mount namespaces)."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from loom.devstack.agent.config import AgentConfig
from loom.devstack.agent.hosts import render_hosts, write_in_place
from loom.devstack.agent.plan import ClusterData
from loom.devstack.agent.podworker import PodWorker
from loom.devstack.agent.runtime import group_members
from loom.devstack.agent.shim import build_shim
from loom.devstack.agent.status import pod_status

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the node agent needs root for mount namespaces"),
    # Above the longest wait (_until's 90 s): `make test` runs this tier at nice 10 beside the e2e tier, and a
    # liveness restart once took over 60 s there (4-5 s alone), so the test's own wait, not pytest-timeout, must be
    # what runs out, with the message that says which state was never reached.
    pytest.mark.timeout(240),
]

SERVER = (
    "import http.server, os, socket\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = (socket.gethostname() + '|' + open('/etc/app/mode').read() + '|' + open('/shared/init').read()"
    " + '|' + os.environ['MY_IP']).encode()\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
    "print('serving', flush=True)\n"
    "http.server.HTTPServer(('', 8080), H).serve_forever()\n"
)


def _pod(uid: str, containers: list[dict[str, Any]], restart: str = "Always", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": f"pod-{uid}", "namespace": "ns", "uid": uid, "labels": {}},
        "spec": {"restartPolicy": restart, "containers": containers, "terminationGracePeriodSeconds": 2, **spec},
    }


async def _fetch(pod: dict[str, Any], want_token: bool) -> tuple[ClusterData, str | None]:
    return ClusterData({"app": {"data": {"mode": "fast"}}}, {}), None


@pytest.fixture
def make_worker(tmp_path: Path) -> Callable[..., PodWorker]:
    state = tmp_path / "state"
    state.mkdir()
    tools = tmp_path / "tools"  # a host folder under /tmp that containers run programs from
    tools.mkdir()
    cfg = AgentConfig(
        "unused",
        "node",
        state,
        0,
        None,
        None,
        shim_path=str(build_shim(state)),
        backoff_initial=0.2,
        backoff_max=1,
        host_paths=(sys.prefix, str(tools)),
    )

    def make(pod: dict[str, Any], ip: str) -> PodWorker:
        worker = PodWorker(cfg, pod, ip, [], _fetch, lambda: None, {})
        worker.hosts_file.parent.mkdir(parents=True, exist_ok=True)
        write_in_place(worker.hosts_file, render_hosts(ip, pod["metadata"]["name"], "ns", None, None, []))
        return worker

    make.tmp = tmp_path  # type: ignore[attr-defined]
    return make


# Generous: `make test` runs this tier at nice 10 beside the e2e tier, which can starve it for seconds at a time
# (a warm run once took over 20 s for a liveness restart that takes about 4 s alone). Passing runs never wait long.
async def _until(check: Callable[[], bool], seconds: float = 90) -> None:
    for _ in range(int(seconds / 0.1)):
        if check():
            return
        await asyncio.sleep(0.1)
    source = inspect.getsource(check).strip() if check.__name__ == "<lambda>" else check.__name__
    raise AssertionError(f"not reached within {seconds:g}s: {source}")


async def test_server_pod_runs_restarts_and_stops_cleanly(make_worker: Callable[..., PodWorker]) -> None:
    pod = _pod(
        "w1",
        [
            {
                "name": "web",
                "image": "python",
                "command": ["python", "-c", SERVER],
                "env": [{"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                "volumeMounts": [
                    {"name": "cfg", "mountPath": "/etc/app", "readOnly": True},
                    {"name": "shared", "mountPath": "/shared"},
                ],
                "readinessProbe": {"httpGet": {"port": 8080, "path": "/"}, "periodSeconds": 1},
                "livenessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
            }
        ],
        initContainers=[
            {
                "name": "setup",
                "image": "sh",
                "command": ["sh", "-c", "echo -n ok > /shared/init"],
                "volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
            }
        ],
        volumes=[{"name": "cfg", "configMap": {"name": "app"}}, {"name": "shared", "emptyDir": {}}],
    )
    pod["status"] = {"podIP": "127.10.200.1"}
    worker = make_worker(pod, "127.10.200.1")
    worker.start()
    web = worker.state.main[0]
    await _until(lambda: web.ready)
    async with httpx.AsyncClient(trust_env=False) as client:
        answer = (await client.get("http://127.10.200.1:8080/")).text
    assert answer == "pod-w1|fast|ok|127.10.200.1"
    assert worker.state.init[0].exit_code == 0 and worker.state.initialized

    child = worker.procs["web"].child_pid()
    assert child is not None
    os.kill(child, signal.SIGKILL)
    await _until(lambda: web.restart_count == 1 and web.ready)
    assert web.last_terminated is not None and web.last_terminated["exitCode"] == 137
    assert worker.log_path("web", 0).read_text().startswith("serving")

    group = worker.procs["web"].record.launcher_pid  # type: ignore[union-attr]
    await worker.terminate(2)
    assert group_members(group) == []
    assert web.state == "terminated" and web.exit_code == 128 + signal.SIGTERM


async def test_failing_job_ends_failed_with_its_exit_code(make_worker: Callable[..., PodWorker]) -> None:
    worker = make_worker(
        _pod("j1", [{"name": "job", "image": "x", "command": ["sh", "-c", "echo bye; exit 1"]}], restart="Never"),
        "127.10.200.2",
    )
    worker.start()
    await _until(lambda: worker.state.final_phase is not None)
    job = worker.state.main[0]
    assert worker.state.final_phase == "Failed" and job.exit_code == 1 and job.restart_count == 0
    assert job.to_status()["state"]["terminated"]["reason"] == "Error"


def worker_tmp(make: Callable[..., PodWorker]) -> Path:
    return Path(make.tmp)  # type: ignore[attr-defined]


async def test_volume_over_tmp_hides_no_source_and_termination_message_is_kept(
    make_worker: Callable[..., PodWorker],
) -> None:
    """The agent's state lives under /tmp here (pytest's tmp_path), as in a clone under /tmp: a pod volume at
    /tmp must not hide the sources of later mounts, the hosts file, or the launcher's pid and exit files."""
    tool = Path(str(worker_tmp(make_worker))) / "tools" / "job.sh"
    script = "cat /etc/app/mode > /dev/termination-log; touch /tmp/scratch-ok; grep -q pod-t1 /etc/hosts; exit 3"
    tool.write_text(f"#!/bin/sh\n{script}\n")
    tool.chmod(0o755)
    container = {
        "name": "job",
        "image": "x",
        "command": [str(tool)],  # under /tmp on the host, so only visible if host paths survive the volume
        "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}, {"name": "cfg", "mountPath": "/etc/app"}],
    }
    volumes = [{"name": "scratch", "emptyDir": {}}, {"name": "cfg", "configMap": {"name": "app"}}]
    worker = make_worker(_pod("t1", [container], restart="Never", volumes=volumes), "127.10.200.9")
    worker.start()
    await _until(lambda: worker.state.final_phase is not None)
    job = worker.state.main[0]
    assert (worker.state.final_phase, job.exit_code) == ("Failed", 3)
    assert job.to_status()["state"]["terminated"]["message"] == "fast"
    assert not Path("/tmp/scratch-ok").exists()  # the emptyDir took the write, not the host's /tmp


async def test_unrunnable_containers_wait_with_a_reason(make_worker: Callable[..., PodWorker]) -> None:
    worker = make_worker(
        _pod(
            "b1",
            [
                {"name": "nocmd", "image": "x", "command": ["no-such-program-here"]},
                {
                    "name": "nocm",
                    "image": "x",
                    "command": ["true"],
                    "env": [{"name": "A", "valueFrom": {"configMapKeyRef": {"name": "missing", "key": "k"}}}],
                },
            ],
        ),
        "127.10.200.3",
    )
    worker.start()
    nocmd, nocm = worker.state.main
    await _until(lambda: nocmd.reason == "RunContainerError" and nocm.reason == "CreateContainerConfigError")
    assert "executable file not found" in (nocmd.message or "")
    assert 'configmap "missing" not found' in (nocm.message or "")
    await worker.terminate(0)


async def test_a_new_agent_re_adopts_running_containers(make_worker: Callable[..., PodWorker]) -> None:
    pod = _pod("r1", [{"name": "sleeper", "image": "x", "command": ["sleep", "300"]}])
    first = make_worker(pod, "127.10.200.4")
    first.start()
    await _until(lambda: first.procs["sleeper"].child_pid() is not None)
    child = first.procs["sleeper"].child_pid()
    assert first.task is not None
    first.task.cancel()  # the agent goes away; its processes stay
    await asyncio.gather(first.task, return_exceptions=True)

    second = make_worker(pod, "127.10.200.4")
    second.start()
    await asyncio.sleep(0.5)
    sleeper = second.state.main[0]
    assert sleeper.state == "running" and sleeper.restart_count == 0
    assert second.procs["sleeper"].child_pid() == child
    assert child is not None
    os.kill(child, signal.SIGKILL)  # the adopted process ends: the new agent notices and restarts it
    await _until(lambda: sleeper.restart_count == 1 and sleeper.state == "running")
    await second.terminate(1)
    assert second.procs["sleeper"].child_pid() != child


async def test_failing_liveness_probe_restarts_the_container(make_worker: Callable[..., PodWorker]) -> None:
    # The exec probe runs inside the container's mount namespace (nsenter) with its env and work dir.
    pod = _pod(
        "l1",
        [
            {
                "name": "app",
                "image": "x",
                "command": ["sleep", "300"],
                "livenessProbe": {
                    "exec": {"command": ["sh", "-c", "test ! -e stop"]},
                    "periodSeconds": 1,
                    "failureThreshold": 2,
                    "timeoutSeconds": 10,  # a starved machine must not fail the probe by its 1 s default
                },
            }
        ],
        terminationGracePeriodSeconds=1,
    )
    worker = make_worker(pod, "127.10.200.5")
    worker.start()
    app = worker.state.main[0]
    await _until(lambda: app.state == "running")
    await asyncio.sleep(2.5)  # several passing probes: nothing happens
    assert app.restart_count == 0 and app.state == "running"
    stop = worker.dir / "work" / "stop"
    stop.touch()
    await _until(lambda: app.restart_count == 1)
    stop.unlink()
    await _until(lambda: app.state == "running")
    assert app.last_terminated is not None and app.last_terminated["exitCode"] == 128 + signal.SIGTERM
    await worker.terminate(0)


def test_gpu_containers_see_only_their_devices(make_worker: Callable[..., PodWorker]) -> None:
    pod = _pod(
        "g1",
        [
            {"name": "a", "image": "x", "command": ["true"], "resources": {"limits": {"nvidia.com/gpu": "2"}}},
            {"name": "b", "image": "x", "command": ["true"]},
            {"name": "c", "image": "x", "command": ["true"], "resources": {"limits": {"nvidia.com/gpu": "1"}}},
        ],
    )
    worker = make_worker(pod, "127.10.200.6")
    worker.gpus = [1, 4, 6]
    data = ClusterData()
    envs = [worker.container_env(c, data, i) for i, c in enumerate(pod["spec"]["containers"])]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["1,4", "", "6"]
    assert all(e["PYTHONSAFEPATH"] == "1" and e["LOOM_POD_IP"] == "127.10.200.6" for e in envs)


async def test_sidecar_runs_beside_the_main_container_and_ends_with_it(
    make_worker: Callable[..., PodWorker],
) -> None:
    pod = _pod(
        "s1",
        [
            {
                "name": "main",
                "image": "x",
                "command": ["sh", "-c", "sleep 1; test -e /shared/sidecar-up"],
                "volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
            }
        ],
        restart="Never",
        terminationGracePeriodSeconds=1,
        initContainers=[
            {
                "name": "sidecar",
                "image": "x",
                "restartPolicy": "Always",
                "command": ["sh", "-c", "touch /shared/sidecar-up; exec sleep 300"],
                "volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
            }
        ],
        volumes=[{"name": "shared", "emptyDir": {}}],
    )
    worker = make_worker(pod, "127.10.200.7")
    worker.start()
    await _until(lambda: worker.state.final_phase is not None)
    assert worker.state.final_phase == "Succeeded"
    sidecar = worker.state.init[0]
    assert sidecar.state == "terminated" and sidecar.restart_count == 0
    assert group_members(worker.procs["sidecar"].record.launcher_pid) == []  # type: ignore[union-attr]


async def test_termination_escalates_to_sigkill_after_the_grace_period(
    make_worker: Callable[..., PodWorker],
) -> None:
    worker = make_worker(
        _pod("t1", [{"name": "stubborn", "image": "x", "command": ["sh", "-c", "trap '' TERM; echo up; sleep 300"]}]),
        "127.10.200.8",
    )
    worker.start()
    stubborn = worker.state.main[0]
    await _until(lambda: worker.log_path("stubborn", 0).exists() and "up" in worker.log_path("stubborn", 0).read_text())
    group = worker.procs["stubborn"].record.launcher_pid  # type: ignore[union-attr]
    await worker.terminate(1)
    assert stubborn.exit_code == 128 + signal.SIGKILL
    assert group_members(group) == []


async def test_terminating_a_pod_still_preparing_after_a_restart_kills_its_processes(
    make_worker: Callable[..., PodWorker],
) -> None:
    pod = _pod("p1", [{"name": "sleeper", "image": "x", "command": ["sleep", "300"]}])
    first = make_worker(pod, "127.10.200.9")
    first.start()
    await _until(lambda: first.procs["sleeper"].child_pid() is not None)
    group = first.procs["sleeper"].record.launcher_pid  # type: ignore[union-attr]
    assert first.task is not None
    first.task.cancel()  # the agent goes away
    await asyncio.gather(first.task, return_exceptions=True)

    second = make_worker(pod, "127.10.200.9")

    async def never_ready(pod: dict[str, Any], want_token: bool) -> tuple[ClusterData, str | None]:
        raise RuntimeError("namespace is being terminated")  # e.g. a token request refused

    second.fetch = never_ready
    second.start()
    await asyncio.sleep(0.5)
    await second.terminate(1)
    assert group_members(group) == []


def _recording(worker: PodWorker) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []
    worker.event = lambda reason, message, warning: events.append((reason, message))
    return events


async def test_pre_stop_hook_runs_in_the_container_before_sigterm(make_worker: Callable[..., PodWorker]) -> None:
    """As the kubelet: a deleted pod turns unready, its preStop hook runs inside the container (its mounts,
    hostname), and only then does the container get SIGTERM."""
    app = "trap 'echo term >> /shared/order; exit 0' TERM; echo up; while :; do sleep 0.1; done"
    hook = {"exec": {"command": ["sh", "-c", 'echo "prestop $(hostname)" >> /shared/order']}}
    pod = _pod(
        "h1",
        [
            {
                "name": "app",
                "image": "x",
                "command": ["sh", "-c", app],
                "volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
                "lifecycle": {"preStop": hook},
            }
        ],
        volumes=[{"name": "shared", "emptyDir": {}}],
        terminationGracePeriodSeconds=20,
    )
    worker = make_worker(pod, "127.10.200.10")
    events = _recording(worker)
    worker.start()
    container = worker.state.main[0]
    await _until(lambda: container.ready and "up" in worker.log_path("app", 0).read_text())
    await worker.terminate()
    assert (worker.folders["shared"] / "order").read_text() == "prestop pod-h1\nterm\n"
    assert container.state == "terminated" and container.exit_code == 0 and not container.ready
    assert worker.state.terminating
    ready = next(c for c in pod_status(worker.state)["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "PodTerminating")
    assert [reason for reason, _ in events] == ["Started", "Killing"]


async def test_http_pre_stop_hook_reaches_the_server_before_it_stops(make_worker: Callable[..., PodWorker]) -> None:
    hook = {"httpGet": {"port": "http", "path": "/?from=prestop"}}
    pod = _pod(
        "h2",
        [
            {
                "name": "web",
                "image": "x",
                "command": ["python", "-m", "http.server", "8080"],
                "ports": [{"name": "http", "containerPort": 8080}],
                "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                "lifecycle": {"preStop": hook},
            }
        ],
        terminationGracePeriodSeconds=20,
    )
    worker = make_worker(pod, "127.10.200.11")
    events = _recording(worker)
    worker.start()
    web = worker.state.main[0]
    await _until(lambda: web.ready)
    await worker.terminate()
    assert '"GET /?from=prestop HTTP/1.1" 200' in worker.log_path("web", 0).read_text()
    assert web.exit_code == 128 + signal.SIGTERM
    assert "FailedPreStopHook" not in [reason for reason, _ in events]


async def test_failing_or_overlong_pre_stop_hooks_are_reported_and_the_container_still_stops(
    make_worker: Callable[..., PodWorker],
) -> None:
    pod = _pod(
        "h3",
        [
            {
                "name": "fails",
                "image": "x",
                "command": ["sleep", "300"],
                "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", "echo nope; exit 3"]}}},
            },
            {
                "name": "overlong",
                "image": "x",
                "command": ["sleep", "300"],
                "lifecycle": {"preStop": {"sleep": {"seconds": 300}}},
            },
        ],
    )
    worker = make_worker(pod, "127.10.200.12")
    events = _recording(worker)
    worker.start()
    await _until(lambda: all(worker.procs[c.name].child_pid() is not None for c in worker.state.main))
    groups = [worker.procs[c.name].record.launcher_pid for c in worker.state.main]  # type: ignore[union-attr]
    await worker.terminate(1)
    failures = sorted(message for reason, message in events if reason == "FailedPreStopHook")
    assert failures == [
        "PreStopHook failed: command ['sh', '-c', 'echo nope; exit 3'] exited with 3: nope",
        "PreStopHook failed: did not finish within the grace period (1s)",
    ]
    assert [c.exit_code for c in worker.state.main] == [128 + signal.SIGTERM] * 2
    assert all(group_members(group) == [] for group in groups)
