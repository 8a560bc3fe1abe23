"""What an e2e test prints when it fails: the evidence that names the cause, gathered once, for every test.

A wait that runs out says only what it waited for ("timed out after 300s waiting for TrainingJob x to finish"). Under
load the cause is elsewhere: a pod never scheduled, an image not pulled, a container crash-looping, a controller
behind, an operator that logged a traceback. So when an e2e test fails, whatever failed in it (a wait, an assertion,
a fixture), its report gets a section with, for each namespace the test touched: Loom's objects with their phase and
conditions, the pods with their phase, node and container states, the workloads' counters, the namespace's latest
events, the last log lines of every pod that is not Ready; then the test's operator log tail and what the stack's
controllers logged about those namespaces. `e2e/rollout_evidence.py` began this for rollouts; this is the general
form, so no test has to remember to collect it.

Bounded: every kubectl call has its own deadline, and gathering never raises (evidence is best effort, the test's own
failure is what the report is about). Secrets are never listed (the kinds below name none).
"""

from __future__ import annotations

import calendar
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loom.devstack.cluster.paths import AGENT_STATE_DIR, LOG_DIR

KUBECTL_TIMEOUT_S = 15
EVENTS = 40
POD_LOG_LINES = 30
COMPONENT_LOG_LINES = 15
OPERATOR_LOG_LINES = 60
WORKLOADS = "deployments,replicasets,statefulsets,jobs,services"
COMPONENT_LOGS = ("kube-controller-manager", "kube-scheduler", "node-agent", "kubelet", "kueue")
CONDITIONS = (
    "{range .items[*]}{.kind}/{.metadata.name} phase={.status.phase} "
    "{range .status.conditions[*]}[{.type}={.status} {.reason}: {.message}] {end}\n{end}"
)
CONTAINERS = (
    "{range .items[*]}{.metadata.name}: {range .status.containerStatuses[*]}"
    "{.name} restarts={.restartCount} state={.state} last={.lastState.terminated.reason} {end}\n{end}"
)


def _kubectl(cluster: Any, *args: str) -> str:
    try:
        request_timeout = f"--request-timeout={KUBECTL_TIMEOUT_S}s"
        result = cluster.kubectl(*args, request_timeout, check=False, timeout=KUBECTL_TIMEOUT_S + 5)
    except Exception as error:  # best effort: a hung or missing kubectl must not hide the failure
        return f"(kubectl {' '.join(args)}: {error})"
    return (result.stdout or result.stderr or "(nothing)").rstrip()


def _items(cluster: Any, *args: str) -> list[dict[str, Any]]:
    """The items of a `kubectl get ... -o json`; none when kubectl could not answer."""
    try:
        items: list[dict[str, Any]] = json.loads(_kubectl(cluster, "get", *args, "-o", "json"))["items"]
    except (ValueError, KeyError):
        return []
    return items


def namespaces_created_since(namespaces: list[dict[str, Any]], since: float) -> list[str]:
    """Of these namespaces, those created at or after `since` (epoch seconds, a second of slack for clock rounding)."""
    found = []
    for item in namespaces:
        created = calendar.timegm(time.strptime(item["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ"))
        if created >= since - 1:
            found.append(item["metadata"]["name"])
    return found


def not_ready(pods: list[dict[str, Any]]) -> list[str]:
    """The pods that are neither Ready nor finished: the ones whose logs say why."""
    names = []
    for pod in pods:
        status = pod.get("status", {})
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
        if not ready and status.get("phase") != "Succeeded":
            names.append(pod["metadata"]["name"])
    return names


def _tail_matching(path: Path, needles: Iterable[str], lines: int) -> list[str]:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    wanted = tuple(needles)
    return [line for line in text if any(n in line for n in wanted)][-lines:]


def namespace_evidence(cluster: Any, namespace: str) -> str:
    parts = [f"--- namespace {namespace}"]
    parts.append("Loom objects:\n" + _kubectl(cluster, "get", "loom", "-n", namespace, "-o", f"jsonpath={CONDITIONS}"))
    parts.append("pods:\n" + _kubectl(cluster, "get", "pods", "-n", namespace, "-o", "wide"))
    parts.append("containers:\n" + _kubectl(cluster, "get", "pods", "-n", namespace, "-o", f"jsonpath={CONTAINERS}"))
    parts.append("workloads:\n" + _kubectl(cluster, "get", WORKLOADS, "-n", namespace, "-o", "wide"))
    events = _kubectl(cluster, "get", "events", "-n", namespace, "--sort-by=.lastTimestamp")
    parts.append(f"events (last {EVENTS}):\n" + "\n".join(events.splitlines()[-EVENTS:]))
    for pod in not_ready(_items(cluster, "pods", "-n", namespace))[:6]:
        log = _kubectl(cluster, "logs", "-n", namespace, pod, "--all-containers", f"--tail={POD_LOG_LINES}")
        parts.append(f"log of {pod} (not Ready), last {POD_LOG_LINES} lines:\n{log}")
    return "\n".join(parts)


def component_evidence(log_dir: Path, agent_log_dir: Path, namespaces: list[str]) -> str:
    """What the stack's own components logged about these namespaces (their last lines each)."""
    parts = []
    for component in COMPONENT_LOGS:
        for folder in (log_dir, agent_log_dir):
            about = _tail_matching(folder / f"{component}.log", namespaces, COMPONENT_LOG_LINES)
            if about:
                parts.append(f"{component} about them:\n" + "\n".join(about))
    return "\n".join(parts)


def operator_logs(fixtures: dict[str, Any]) -> str:
    """The tail of every operator log among the test's fixtures (anything with a `log_tail()`)."""
    parts = []
    for name, value in fixtures.items():
        tail = getattr(value, "log_tail", None)
        if callable(tail):
            try:
                parts.append(f"--- {name}: operator log, last {OPERATOR_LOG_LINES} lines\n{tail(OPERATOR_LOG_LINES)}")
            except Exception as error:
                parts.append(f"--- {name}: operator log unreadable: {error}")
    return "\n".join(parts)


def fixture_namespaces(fixtures: dict[str, Any], existing: set[str]) -> list[str]:
    """Namespaces named by the test's fixtures: string values that are namespaces, and operators' watched ones."""
    candidates: list[str] = []
    for value in fixtures.values():
        if isinstance(value, str):
            candidates.append(value)
        candidates.extend(str(n) for n in getattr(value, "watch", None) or () if isinstance(n, str))
    return [c for c in dict.fromkeys(candidates) if c in existing]


def gather(cluster: Any, fixtures: dict[str, Any], started: float, limit: int = 4) -> str:
    """The whole evidence of a failed test that started at `started` (epoch seconds)."""
    listed = _items(cluster, "namespaces")
    existing = {item["metadata"]["name"] for item in listed}
    found = fixture_namespaces(fixtures, existing) + namespaces_created_since(listed, started)
    namespaces = [n for n in dict.fromkeys(found) if not n.startswith("kube-")][:limit]
    parts = [namespace_evidence(cluster, ns) for ns in namespaces] or ["(no namespace of the test found)"]
    parts.append(_kubectl(cluster, "get", "nodes", "-o", "wide"))
    parts.append(component_evidence(LOG_DIR, AGENT_STATE_DIR / "logs", namespaces))
    parts.append(operator_logs(fixtures))
    return "\n".join(p for p in parts if p)
