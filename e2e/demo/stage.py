"""What every part of the demo shares: the cluster, the namespace, the host addresses of Services, kubectl."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from loom.devstack import backing
from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.paths import AGENT_STATE_DIR, STATE_DIR

from .ui import Ui

T = TypeVar("T")
NAMESPACE = "loom-demo"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WORKDIR = STATE_DIR / "demo"
API_KEY_SECRET = "chargpt-api-keys"


@dataclass(frozen=True)
class Outcome:
    line: str  # one sentence: what happened
    figure: str  # the key number, for the summary table
    seconds: float | None = None  # the part's own time, when it is not the time the demo waited for it


@dataclass(frozen=True)
class Later:
    """A part that runs on in the background while the next part runs: `collect` waits for its outcome."""

    line: str  # what goes on meanwhile, and when its outcome follows
    collect: Callable[[], Outcome]


@dataclass
class Demo:
    cluster: Cluster
    ui: Ui
    namespace: str = NAMESPACE
    services: backing.BackingServices | None = None
    api_key: str = ""
    facts: dict[str, Any] = field(default_factory=dict)  # what later parts need from earlier ones

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> Any:
        return self.cluster.kubectl(*args, stdin=stdin, check=check)

    def get(self, kind: str, name: str) -> dict[str, Any]:
        result = self.kubectl("get", kind, name, "-n", self.namespace, "-o", "json", check=False)
        return dict(json.loads(result.stdout)) if result.returncode == 0 else {}

    def apply_file(self, name: str) -> list[dict[str, Any]]:
        """`kubectl apply -n <ns> -f examples/<name>`, as a user would; returns the file's documents."""
        self.kubectl("apply", "-n", self.namespace, "-f", str(EXAMPLES / name))
        return example(name)

    def apply_obj(self, obj: dict[str, Any]) -> None:
        self.kubectl("apply", "-n", self.namespace, "-f", "-", stdin=yaml.safe_dump(obj))

    def address(self, service: str, namespace: str | None = None) -> str:
        """host:port-less address of a Service on the node agent (what pods know as <service>.<ns>.svc)."""
        return wait(
            lambda: _address(service, namespace or self.namespace), 120, f"the Service {service}'s address", 0.5
        )

    def model_url(self, service: str, endpoint: str) -> str:
        return f"http://{self.address(service)}:80/v2/models/{service}/{endpoint}"


def _address(service: str, namespace: str) -> str | None:
    try:
        return str(service_address(service, namespace, AGENT_STATE_DIR))
    except (KeyError, OSError, ValueError):
        return None


def example(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}


def is_true(obj: dict[str, Any], ctype: str) -> bool:
    return conditions(obj).get(ctype, {}).get("status") == "True"


def wait(check: Callable[[], T | None], timeout: float, what: str, interval: float = 1.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def wait_obj(
    demo: Demo, kind: str, name: str, done: Callable[[dict[str, Any]], bool], timeout: float, what: str
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = demo.get(kind, name)
        return obj if obj and done(obj) else None

    try:
        return wait(check, timeout, f"{kind} {name} {what}", 2)
    except TimeoutError as error:
        status = json.dumps(demo.get(kind, name).get("status"), indent=1)
        pods = demo.kubectl("get", "pods", "-n", demo.namespace, "-o", "wide", check=False).stdout
        raise TimeoutError(f"{error}\nstatus: {status}\n{pods}") from None
