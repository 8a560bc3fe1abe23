"""Readiness, liveness and startup probes (httpGet, tcpSocket, exec) against the pod's address."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import httpx

Obj = dict[str, Any]


@dataclass
class ProbeTracker:
    """Consecutive-result thresholds of one probe; `ok` is the current verdict."""

    success_threshold: int = 1
    failure_threshold: int = 3
    ok: bool | None = None  # None: no verdict yet
    _successes: int = 0
    _failures: int = 0

    @classmethod
    def from_spec(cls, probe: Obj) -> ProbeTracker:
        return cls(int(probe.get("successThreshold", 1)), int(probe.get("failureThreshold", 3)))

    def record(self, success: bool) -> bool | None:
        """Count one result; returns the new verdict when it changed, else None."""
        if success:
            self._successes, self._failures = self._successes + 1, 0
            if self._successes >= self.success_threshold and self.ok is not True:
                self.ok = True
                return True
        else:
            self._failures, self._successes = self._failures + 1, 0
            if self._failures >= self.failure_threshold and self.ok is not False:
                self.ok = False
                return False
        return None


_clients: dict[int, httpx.AsyncClient] = {}


def _client() -> httpx.AsyncClient:
    """One shared client per event loop: building one (and its TLS context) per probe costs real CPU.

    No keep-alive, so every probe opens a fresh connection as kubelet's do."""
    loop = id(asyncio.get_running_loop())
    if loop not in _clients:
        _clients[loop] = httpx.AsyncClient(
            verify=False, trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)
        )
    return _clients[loop]


def resolve_port(port: int | str, container: Obj) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for declared in container.get("ports") or []:
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise ValueError(f"named port {port!r} is not declared by container {container['name']!r}")


async def run_probe(
    probe: Obj, container: Obj, pod_ip: str, env: dict[str, str], exec_prefix: list[str], cwd: str
) -> bool:
    """One probe attempt; any error is a failure (as kubelet treats it)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            spec = probe["httpGet"]
            scheme = str(spec.get("scheme", "HTTP")).lower()
            host = spec.get("host") or pod_ip
            url = f"{scheme}://{host}:{resolve_port(spec['port'], container)}{spec.get('path', '/')}"
            headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
            response = await _client().get(url, headers=headers, timeout=timeout)
            return 200 <= response.status_code < 400
        if "tcpSocket" in probe:
            spec = probe["tcpSocket"]
            host = spec.get("host") or pod_ip
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host, resolve_port(spec["port"], container)), timeout
            )
            writer.close()
            return True
        if "exec" in probe:
            proc = await asyncio.create_subprocess_exec(
                *exec_prefix,
                *probe["exec"]["command"],
                env=env,
                cwd=cwd,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            try:
                return await asyncio.wait_for(proc.wait(), timeout) == 0
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
                return False
    except (TimeoutError, OSError, ValueError, httpx.HTTPError):
        return False
    return False
