"""The evidence a failed e2e test prints (loom.e2e.failure_evidence), against a recorded kubectl: which namespaces it
looks at, which pods' logs it reads, and that a kubectl that cannot answer never hides the test's own failure."""

from __future__ import annotations

import calendar
import json
import subprocess
import time
from typing import Any

from loom.e2e.failure_evidence import gather, namespaces_created_since

NOW = calendar.timegm(time.strptime("2026-11-28T18:00:10Z", "%Y-%m-%dT%H:%M:%SZ"))


def _namespace(name: str, created: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": created}}


def _pod(name: str, ready: bool, phase: str = "Running") -> dict[str, Any]:
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {"metadata": {"name": name}, "status": {"phase": phase, "conditions": [condition]}}


class RecordedCluster:
    """Answers `kubectl get namespaces|pods -o json` and `logs` from what it was given; records every call."""

    def __init__(self, namespaces: list[dict[str, Any]], pods: list[dict[str, Any]], broken: bool = False) -> None:
        self.namespaces, self.pods, self.broken, self.calls = namespaces, pods, broken, []

    def kubectl(self, *args: str, check: bool, timeout: float) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(args))
        if self.broken:
            raise subprocess.TimeoutExpired(["kubectl"], timeout)
        out = ""
        if args[:2] == ("get", "namespaces") and "json" in args:
            out = json.dumps({"items": self.namespaces})
        elif args[:2] == ("get", "pods") and "json" in args:
            out = json.dumps({"items": self.pods})
        elif args[0] == "logs":
            out = f"log of {args[3]}"
        return subprocess.CompletedProcess(list(args), 0, out, "")


class Operator:
    watch = ["watched"]

    def log_tail(self, lines: int) -> str:
        return f"operator: last {lines} lines"


def test_namespaces_created_at_or_after_the_start_are_found_utc() -> None:
    listed = [_namespace("old", "2026-11-28T17:59:00Z"), _namespace("new", "2026-11-28T18:00:09Z")]
    assert namespaces_created_since(listed, NOW) == ["new"]  # one second of slack, read as UTC


def test_evidence_covers_the_fixtures_namespaces_the_new_ones_and_logs_of_pods_not_ready() -> None:
    cluster = RecordedCluster(
        [_namespace("watched", "2026-11-28T17:00:00Z"), _namespace("made-by-test", "2026-11-28T18:00:20Z")],
        [_pod("ready", True), _pod("stuck", False), _pod("done", False, phase="Succeeded")],
    )
    text = gather(cluster, {"cluster": cluster, "op": Operator(), "bucket": "b-1234"}, NOW)
    assert "--- namespace watched" in text and "--- namespace made-by-test" in text
    assert "log of stuck" in text and "log of ready" not in text and "log of done" not in text
    assert "operator: last 60 lines" in text
    assert not any(call[:1] == ["get"] and "secrets" in call for call in cluster.calls)


def test_a_kubectl_that_cannot_answer_still_gives_a_report() -> None:
    cluster = RecordedCluster([], [], broken=True)
    text = gather(cluster, {"cluster": cluster, "op": Operator()}, NOW)
    assert "(no namespace of the test found)" in text and "operator: last 60 lines" in text
