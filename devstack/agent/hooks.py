"""Container lifecycle hooks (preStop) as the kubelet runs them: exec, httpGet and sleep.

A hook has no timeout of its own: the caller bounds it by what is left of the grace period. Any
error is a failed hook, which the kubelet reports as an event and then goes on stopping the container.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx

from loom.devstack.agent.probes import resolve_port

Obj = dict[str, Any]
OUTPUT_LIMIT = 1024  # bytes of an exec hook's output kept for the event


class HookError(Exception):
    """The hook ran and failed (exit code, HTTP status, connection error, bad spec)."""


async def run_hook(
    handler: Obj, container: Obj, pod_ip: str, env: dict[str, str], exec_prefix: list[str], cwd: str
) -> None:
    """Run one lifecycle handler to its end; HookError says why it failed."""
    if "sleep" in handler:
        seconds = handler["sleep"].get("seconds")
        if not isinstance(seconds, int) or seconds < 0:
            raise HookError(f"sleep.seconds must be a non-negative integer, got {seconds!r}")
        await asyncio.sleep(seconds)
        return
    if "exec" in handler:
        await _exec(handler["exec"].get("command") or [], env, exec_prefix, cwd)
        return
    if "httpGet" in handler:
        await _http_get(handler["httpGet"], container, pod_ip)
        return
    raise HookError(f"unsupported lifecycle handler: {sorted(handler)}")


async def _exec(command: list[str], env: dict[str, str], exec_prefix: list[str], cwd: str) -> None:
    if not command:
        raise HookError("exec hook without a command")
    try:
        proc = await asyncio.create_subprocess_exec(
            *exec_prefix,
            *command,
            env=env,
            cwd=cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError as exc:
        raise HookError(f"exec {command[0]!r}: {exc}") from exc
    try:
        output, _ = await proc.communicate()
    except asyncio.CancelledError:  # out of grace: the hook goes with the container
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        text = output[-OUTPUT_LIMIT:].decode(errors="replace").strip()
        raise HookError(f"command {command!r} exited with {proc.returncode}: {text}")


async def _http_get(spec: Obj, container: Obj, pod_ip: str) -> None:
    try:
        port = resolve_port(spec["port"], container)
    except (KeyError, ValueError) as exc:
        raise HookError(f"httpGet hook: {exc}") from exc
    scheme = str(spec.get("scheme", "HTTP")).lower()
    url = f"{scheme}://{spec.get('host') or pod_ip}:{port}{spec.get('path', '/')}"
    headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
    try:
        async with httpx.AsyncClient(verify=False, trust_env=False, timeout=None) as client:
            response = await client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise HookError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
    if not 200 <= response.status_code < 400:
        raise HookError(f"GET {url} answered {response.status_code}")
