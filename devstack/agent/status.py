"""Container bookkeeping and the pod status computed from it (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

Obj = dict[str, Any]


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerState:
    """What the agent knows of one container; mirrors the containerStatuses entry."""

    name: str
    image: str
    pod_uid: str
    restart_count: int = 0
    state: str = "waiting"  # waiting | running | terminated
    reason: str | None = "ContainerCreating"
    message: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    exit_code: int | None = None
    attempt: int = 0
    ready: bool = False
    started: bool = False
    last_terminated: Obj | None = None
    ran_once: bool = False
    crash_streak: int = 0  # restarts since the container last ran long enough to reset the back-off

    def running(self, started_at: str, attempt: int) -> None:
        self.state, self.reason, self.message = "running", None, None
        self.started_at, self.attempt, self.exit_code, self.finished_at = started_at, attempt, None, None
        self.ran_once = True

    def terminated(self, exit_code: int, reason: str | None = None, message: str | None = None) -> None:
        self.state, self.exit_code, self.finished_at = "terminated", exit_code, now()
        self.reason = reason or ("Completed" if exit_code == 0 else "Error")
        self.message, self.ready = message, False

    def waiting(self, reason: str, message: str | None = None) -> None:
        if self.state == "terminated":
            self.last_terminated = self._terminated()
        self.state, self.reason, self.message, self.ready = "waiting", reason, message, False

    def _terminated(self) -> Obj:
        out: Obj = {
            "exitCode": self.exit_code if self.exit_code is not None else 0,
            "reason": self.reason,
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
            "containerID": self.container_id(),
        }
        if self.message:
            out["message"] = self.message
        return out

    def container_id(self) -> str:
        return f"loom://{self.pod_uid}/{self.name}/{self.attempt}"

    def to_status(self) -> Obj:
        if self.state == "running":
            state: Obj = {"running": {"startedAt": self.started_at}}
        elif self.state == "terminated":
            state = {"terminated": self._terminated()}
        else:
            waiting: Obj = {"reason": self.reason}
            if self.message:
                waiting["message"] = self.message
            state = {"waiting": waiting}
        out: Obj = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": self.ready,
            "started": self.state == "running" and self.started,
            "restartCount": self.restart_count,
            # Explicit nulls: a strategic-merge patch must not leave an old state beside the new one.
            "state": {"waiting": None, "running": None, "terminated": None, **state},
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }
        if self.ran_once:
            out["containerID"] = self.container_id()
        return out


@dataclass
class PodState:
    uid: str
    pod_ip: str
    host_ip: str
    start_time: str
    init: list[ContainerState] = field(default_factory=list)
    main: list[ContainerState] = field(default_factory=list)
    initialized: bool = False
    final_phase: str | None = None  # Succeeded/Failed once the pod will never run anything again
    message: str | None = None
    reason: str | None = None
    terminating: bool = False  # being deleted: never Ready again, so no Service sends it new traffic


def phase(pod: PodState) -> str:
    if pod.final_phase:
        return pod.final_phase
    if pod.initialized and all(c.ran_once for c in pod.main):
        return "Running"
    return "Pending"


def _condition(kind: str, ok: bool, reason: str | None, previous: dict[str, Obj]) -> Obj:
    status = "True" if ok else "False"
    old = previous.get(kind)
    changed_at = old["lastTransitionTime"] if old and old.get("status") == status else now()
    # reason is always sent (null when fine): conditions are merged by type in a strategic-merge patch.
    cond: Obj = {
        "type": kind,
        "status": status,
        "lastTransitionTime": changed_at,
        "lastProbeTime": None,
        "reason": None if ok else reason,
    }
    return cond


def pod_status(pod: PodState, previous_conditions: list[Obj] | None = None) -> Obj:
    """The status subresource body for the pod as the agent sees it now."""
    previous = {c["type"]: c for c in previous_conditions or []}
    containers_ready = bool(pod.main) and all(c.ready for c in pod.main)
    done = pod.final_phase is not None
    not_ready = "PodCompleted" if done else "ContainersNotReady"
    status: Obj = {
        "phase": phase(pod),
        "hostIP": pod.host_ip,
        "hostIPs": [{"ip": pod.host_ip}],
        "podIP": pod.pod_ip,
        "podIPs": [{"ip": pod.pod_ip}],
        "startTime": pod.start_time,
        "conditions": [
            _condition("PodScheduled", True, None, previous),
            _condition(
                "Initialized", pod.initialized, "PodCompleted" if done else "ContainersNotInitialized", previous
            ),
            _condition("ContainersReady", containers_ready, not_ready, previous),
            _condition(
                "Ready",
                containers_ready and not pod.terminating,
                "PodTerminating" if pod.terminating else not_ready,
                previous,
            ),
        ],
        "containerStatuses": [c.to_status() for c in pod.main],
    }
    if pod.init:
        status["initContainerStatuses"] = [c.to_status() for c in pod.init]
    if pod.message:
        status["message"] = pod.message
    if pod.reason:
        status["reason"] = pod.reason
    return status


def ran_for_seconds(started_at: str | None, finished_at: str | None) -> float:
    if not started_at or not finished_at:
        return 0.0
    fmt = "%Y-%m-%dT%H:%M:%SZ"
    return (datetime.strptime(finished_at, fmt) - datetime.strptime(started_at, fmt)).total_seconds()


def backoff_seconds(restarts: int, initial: float, maximum: float) -> float:
    """Delay before restart number `restarts` (1-based): initial, doubled each time, capped."""
    return float(min(maximum, initial * 2 ** max(0, restarts - 1)))
