"""Why a child pod cannot start or keep running, as the person who must act needs to read it (pure).

A kind's status says "Applying" or "Starting" while its pods work their way up; when a pod is stuck on something
only a person can fix, the owning object must say so instead, with the pod's own reason and message. This module
turns a list of pods into that one cause (or None while they are merely on their way):

  CreateContainerConfigError  a Secret or ConfigMap (or a key in one) that the pod references is missing; the
                              message is the kubelet's: `secret "redis-connection" not found`
  CreateContainerError, RunContainerError, InvalidImageName, ErrImagePull, ImagePullBackOff
  CrashLoopBackOff            with the last termination: its reason, exit code and termination message
  OOMKilled                   a container killed for exceeding its memory limit (with the limit)
  Unschedulable               the scheduler's message (no node with the GPUs, a taint, a missing label)

Kinds call `find_problem(pods)` with the pods of the part concerned and put the problem's reason and message on
that part's condition and on Ready. Events follow from the condition's transition (one per cause, not per pass).

Secrets: the kubelet's messages name Secrets, never their data. A termination message is what the program wrote
(or the tail of its log), so it is scrubbed of what looks like a credential (`password=...`, `token: ...`,
`user:pass@host`) and cut short before it reaches status or an event.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from .model import Manifest

# Waiting reasons a person must act on, most actionable first (the order ranks problems across pods).
WAITING_REASONS = (
    "CreateContainerConfigError",
    "CreateContainerError",
    "InvalidImageName",
    "ErrImagePull",
    "ImagePullBackOff",
    "RunContainerError",
    "CrashLoopBackOff",
)
OOM_KILLED, UNSCHEDULABLE = "OOMKilled", "Unschedulable"
# Every reason this module reports, for the kinds' Warning-event sets.
REASONS = frozenset({*WAITING_REASONS, OOM_KILLED, UNSCHEDULABLE})
_RANK = {reason: rank for rank, reason in enumerate((*WAITING_REASONS[:-1], OOM_KILLED, "CrashLoopBackOff"))}
_RANK[UNSCHEDULABLE] = len(_RANK)
MAX_MESSAGE = 300

# key=value / key: value pairs whose key names a credential, and the userinfo of a URL.
_SECRET_PAIR = re.compile(
    r"(?i)\b([\w.-]*(?:password|passwd|secret|token|api[_-]?key|access[_-]?key|credential)s?[\w.-]*)"
    r"(\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^\s,;&\"']+)"
)
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@")


@dataclass(frozen=True)
class PodProblem:
    reason: str  # one of REASONS
    pod: str
    container: str | None
    detail: str  # the kubelet's or scheduler's message, or the last termination; scrubbed

    @property
    def message(self) -> str:
        where = f"pod {self.pod}" + (f" container {self.container}" if self.container else "")
        return f"{where}: {self.reason}: {self.detail}" if self.detail else f"{where}: {self.reason}"


def scrub(text: str, limit: int = MAX_MESSAGE) -> str:
    """`text` without what looks like a credential, on one line, at most `limit` characters."""
    text = _USERINFO.sub(r"\1***@", text)
    text = _SECRET_PAIR.sub(lambda m: f"{m[1]}{m[2]}***", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _memory_limit(pod: Manifest, container: str) -> str | None:
    spec = pod.get("spec") or {}
    for item in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        if item.get("name") == container:
            return ((item.get("resources") or {}).get("limits") or {}).get("memory")
    return None


def _termination(terminated: Manifest) -> str:
    """The last termination as a person reads it: reason, exit code and its message."""
    text = f"last terminated {terminated.get('reason') or 'Error'} with exit code {terminated.get('exitCode', '?')}"
    message = str(terminated.get("message") or "").strip()
    return f"{text}: {message}" if message else text


def _container_problem(pod: Manifest, name: str, status: Manifest) -> PodProblem | None:
    pod_name = str((pod.get("metadata") or {}).get("name") or "?")
    state = status.get("state") or {}
    last = (status.get("lastState") or {}).get("terminated") or {}
    terminated = state.get("terminated") or {}
    waiting = state.get("waiting") or {}
    for ended in (terminated, last):
        if ended.get("reason") == OOM_KILLED and (ended is terminated or waiting.get("reason") == "CrashLoopBackOff"):
            limit = _memory_limit(pod, name)
            within = f" (memory limit {limit})" if limit else ""
            return PodProblem(OOM_KILLED, pod_name, name, f"killed for using more memory than it may{within}")
    reason = waiting.get("reason")
    if reason not in WAITING_REASONS:
        return None
    if reason == "CrashLoopBackOff":
        detail = _termination(last) if last else str(waiting.get("message") or "")
    else:
        detail = str(waiting.get("message") or "")
    return PodProblem(str(reason), pod_name, name, scrub(detail))


def pod_problems(pod: Manifest) -> list[PodProblem]:
    """Every problem of one pod a person must act on (per container, and Unschedulable). A pod being deleted has
    none."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return []
    status = pod.get("status") or {}
    found = [
        problem
        for item in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
        if (problem := _container_problem(pod, str(item.get("name") or ""), item)) is not None
    ]
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == UNSCHEDULABLE:
            detail = scrub(str(cond.get("message") or "no node fits the pod"))
            found.append(PodProblem(UNSCHEDULABLE, str(meta.get("name") or "?"), None, detail))
    return found


def find_problem(pods: Iterable[Manifest], ignore: Iterable[str] = ()) -> PodProblem | None:
    """The one cause to report for these pods, or None while they are merely on their way: the most actionable
    problem (a missing Secret before a crash loop), the first pod by name among equals, so passes agree.
    `ignore`: reasons the caller reports in its own way (a TrainingJob's Unschedulable after its timeout)."""
    skip = set(ignore)
    ordered = sorted(pods, key=lambda p: str((p.get("metadata") or {}).get("name") or ""))
    found = [problem for pod in ordered for problem in pod_problems(pod) if problem.reason not in skip]
    return min(found, key=lambda p: _RANK[p.reason]) if found else None
