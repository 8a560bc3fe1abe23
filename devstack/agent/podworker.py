"""One pod's life on this node: volumes, init containers in order, containers with restarts and
probes, termination. Container bookkeeping is saved after every change so a restarted agent can
re-adopt running processes instead of orphaning them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loom.devstack.agent import plan
from loom.devstack.agent.config import AgentConfig
from loom.devstack.agent.hooks import HookError, run_hook
from loom.devstack.agent.plan import ClusterData, ConfigError
from loom.devstack.agent.probes import ProbeTracker, run_probe
from loom.devstack.agent.runtime import ContainerProcess
from loom.devstack.agent.status import ContainerState, PodState, backoff_seconds, now, ran_for_seconds
from loom.devstack.agent.volumes import container_mounts, materialize

Obj = dict[str, Any]
log = logging.getLogger("loom.agent.pod")
RETRY_CONFIG_SECONDS = 2.0
BACKOFF_RESET_SECONDS = 600.0
# As the kubelet: a container whose preStop hook used up the grace period still gets this long after SIGTERM.
MIN_GRACE_AFTER_HOOK_SECONDS = 2.0

# Fetches what a pod refers to (configmaps, secrets, and a service account token when asked).
DataFetcher = Callable[[Obj, bool], Awaitable[tuple[ClusterData, str | None]]]
# Records a Kubernetes Event on the pod: (reason, message, is_warning).
EventSink = Callable[[str, str, bool], None]


def _as_config_error(error: Exception) -> ConfigError:
    if isinstance(error, ConfigError):
        return error
    log.warning("preparing a container failed, will retry: %s", str(error).splitlines()[0] if str(error) else error)
    return ConfigError(
        "CreateContainerConfigError",
        f"node agent could not prepare the container: {type(error).__name__}: {str(error)[:200]}",
    )


class PodWorker:
    def __init__(
        self,
        cfg: AgentConfig,
        pod: Obj,
        pod_ip: str,
        gpus: list[int],
        fetch: DataFetcher,
        on_change: Callable[[], None],
        extra_env: dict[str, str],
        event: EventSink | None = None,
    ) -> None:
        self.cfg, self.pod, self.fetch, self.on_change, self.extra_env = cfg, pod, fetch, on_change, extra_env
        self.event: EventSink = event or (lambda reason, message, warning: None)
        meta, spec = pod["metadata"], pod["spec"]
        self.uid: str = meta["uid"]
        self.name: str = meta["name"]
        self.namespace: str = meta["namespace"]
        self.dir = cfg.pods_dir / self.uid
        self.log_dir: Path = cfg.logs_dir / f"{self.namespace}_{self.name}_{self.uid}"
        self.gpus = gpus
        self.hostname = spec.get("hostname") or self.name
        self.hosts_file = self.dir / "hosts"
        start = (pod.get("status") or {}).get("startTime") or now()
        self.state = PodState(self.uid, pod_ip, cfg.host_ip, start)
        self.state.init = [self._load(c, True) for c in spec.get("initContainers") or []]
        self.state.main = [self._load(c, False) for c in spec.get("containers") or []]
        self.procs = {c.name: ContainerProcess(self.dir / "c" / c.name) for c in self.state.init + self.state.main}
        self.folders: dict[str, Path] = {}
        self.task: asyncio.Task[None] | None = None
        self.terminating = False

    # ---- bookkeeping -------------------------------------------------------------------------

    def _load(self, container: Obj, init: bool) -> ContainerState:
        path = self.dir / "c" / container["name"] / "state.json"
        with contextlib.suppress(OSError, ValueError, TypeError):
            return ContainerState(**json.loads(path.read_text()))
        return ContainerState(
            container["name"],
            container.get("image", ""),
            self.uid,
            reason="PodInitializing" if not init and self.pod["spec"].get("initContainers") else "ContainerCreating",
        )

    def _changed(self, container: ContainerState) -> None:
        path = self.dir / "c" / container.name / "state.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(container)))
        self.on_change()

    def log_path(self, container: str, attempt: int) -> Path:
        return Path(self.log_dir, container, f"{attempt}.log")

    def spec_of(self, name: str) -> Obj:
        spec = self.pod["spec"]
        return next(c for c in (spec.get("initContainers") or []) + spec["containers"] if c["name"] == name)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"pod-{self.namespace}/{self.name}")

    async def _run(self) -> None:
        try:
            await self._prepare()
            policy = self.pod["spec"].get("restartPolicy", "Always")
            sidecars: list[asyncio.Task[int]] = []
            for container in self.state.init:
                if self.spec_of(container.name).get("restartPolicy") == "Always":
                    # A native sidecar: runs (and restarts) beside the pod; the next step waits for its start.
                    sidecars.append(asyncio.create_task(self._supervise(container, "Always")))
                    while not (container.state == "running" and container.started):
                        await asyncio.sleep(0.1)
                    continue
                if not await self._run_init(container, policy):
                    self.state.final_phase = "Failed"
                    self.on_change()
                    await self._stop_sidecars(sidecars)
                    return
            self.state.initialized = True
            self.on_change()
            results = await asyncio.gather(*(self._supervise(c, policy) for c in self.state.main))
            await self._stop_sidecars(sidecars)
            self.state.final_phase = "Succeeded" if all(code == 0 for code in results) else "Failed"
            self.on_change()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one broken pod must never take the agent down
            log.exception("pod %s/%s failed in the agent", self.namespace, self.name)
            self.state.message, self.state.reason = f"node agent error: {exc}", "AgentError"
            self.on_change()

    async def _stop_sidecars(self, sidecars: list[asyncio.Task[int]]) -> None:
        """Sidecars end with the pod's main containers (their exit code does not count)."""
        for task in sidecars:
            task.cancel()
        await asyncio.gather(*sidecars, return_exceptions=True)
        for container in self.state.init:
            proc = self.procs[container.name]
            if container.state == "running" and proc.record is not None:
                await proc.stop(self.grace_seconds())
                code, reason = await proc.wait()
                container.terminated(code, reason)
                self._changed(container)

    async def _prepare(self) -> None:
        """Create volumes, retrying while something they need is missing."""
        while True:
            try:
                data, token = await self.fetch(self.pod, True)
                # In a thread: an image volume's pull takes as long as its layers take to download.
                self.folders = await asyncio.to_thread(materialize, self.pod, self.dir, self.cfg.state_dir, data, token)
                return
            except Exception as error:  # API hiccups (or a terminating namespace) retry like config errors
                exc = _as_config_error(error)
                first = next((c for c in self.state.init + self.state.main if c.state == "waiting"), None)
                if first is not None and (first.reason, first.message) != (exc.reason, exc.message):
                    first.waiting(exc.reason, exc.message)
                    self.event("Failed", f"Error: {exc.message}", True)
                    self._changed(first)
                await asyncio.sleep(RETRY_CONFIG_SECONDS)

    async def _run_init(self, container: ContainerState, policy: str) -> bool:
        if container.state == "terminated" and container.exit_code is not None:  # ended before an agent restart
            if container.exit_code == 0:
                return True
            if policy == "Never":
                return False
            await self._back_off(container)
        while True:
            code = await self._attempt(container)
            if code == 0:
                return True
            if policy == "Never":
                return False
            await self._back_off(container)

    async def _supervise(self, container: ContainerState, policy: str) -> int:
        if container.state == "terminated" and container.exit_code is not None:  # ended before an agent restart
            code: int = container.exit_code
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                return code
            await self._back_off(container)
        while True:
            code = await self._attempt(container)
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                return code
            await self._back_off(container)

    async def _back_off(self, container: ContainerState) -> None:
        container.restart_count += 1
        # As kubelet: a container that ran for 10 minutes starts the back-off over.
        long_run = ran_for_seconds(container.started_at, container.finished_at) >= BACKOFF_RESET_SECONDS
        container.crash_streak = 1 if long_run else container.crash_streak + 1
        delay = backoff_seconds(container.crash_streak, self.cfg.backoff_initial, self.cfg.backoff_max)
        self.event("BackOff", f"Back-off restarting failed container {container.name} in pod {self.name}", True)
        container.waiting(
            "CrashLoopBackOff",
            f"back-off {delay:g}s restarting failed container={container.name} "
            f"pod={self.name}_{self.namespace}({self.uid})",
        )
        self._changed(container)
        await asyncio.sleep(delay)

    async def _attempt(self, container: ContainerState) -> int:
        """Run (or re-adopt) one attempt of a container and return its exit code."""
        proc = self.procs[container.name]
        adopted = container.state == "running" and proc.adopt()
        if not adopted:
            while True:
                try:
                    await self._launch(container, proc)
                    break
                except Exception as error:
                    exc = _as_config_error(error)
                    if (container.reason, container.message) != (exc.reason, exc.message):
                        container.waiting(exc.reason, exc.message)
                        self.event("Failed", f"Error: {exc.message}", True)
                        self._changed(container)
                    await asyncio.sleep(RETRY_CONFIG_SECONDS)
        probes = asyncio.create_task(self._probe(container, proc))
        try:
            code, reason = await proc.wait()
        finally:
            probes.cancel()
        container.started = False
        container.terminated(code, reason, proc.termination_message())
        self._changed(container)
        return int(code)

    def container_env(self, spec: Obj, data: ClusterData, index: int) -> dict[str, str]:
        bin_dir = plan.environment_for(spec.get("image", ""), dict(self.cfg.image_environments), self.cfg.bin_dir)
        env: dict[str, str] = plan.base_environment(bin_dir, self.state.pod_ip, self.cfg.shim_path)
        env.update(self.extra_env)
        env["HOSTNAME"] = self.hostname
        wanted = plan.gpu_request({"containers": [spec]})
        before = sum(plan.gpu_request({"containers": [c]}) for c in self.pod["spec"]["containers"][:index])
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus[before : before + wanted])
        env.update(plan.resolve_env(self.pod, spec, data))
        return env

    def host_paths(self) -> tuple[str, ...]:
        """What the process needs from the host whatever the pod mounts: venv, checkout, the bind shim."""
        shim = (os.path.dirname(self.cfg.shim_path),) if self.cfg.shim_path else ()
        return (*self.cfg.host_paths, *shim)

    async def _launch(self, container: ContainerState, proc: ContainerProcess) -> None:
        spec = self.spec_of(container.name)
        data, _ = await self.fetch(self.pod, False)
        mains = [c["name"] for c in self.pod["spec"]["containers"]]
        env = self.container_env(spec, data, mains.index(spec["name"]) if spec["name"] in mains else 0)
        argv = plan.command_line(spec, env)
        if plan.shutil_which(argv[0], env["PATH"]) is None:
            raise ConfigError("RunContainerError", f'exec: "{argv[0]}": executable file not found in $PATH')
        mounts = container_mounts(spec, self.folders)
        cwd = spec.get("workingDir") or str(self.dir / "work")
        attempt = container.attempt + 1 if container.ran_once else 0
        started_at = now()
        await proc.start(
            argv,
            env,
            cwd,
            mounts,
            str(self.hosts_file),
            self.hostname,
            self.log_path(container.name, attempt),
            attempt,
            started_at,
            spec.get("terminationMessagePath") or "/dev/termination-log",
            self.host_paths(),
        )
        container.running(started_at, attempt)
        self.event("Started", f"Started container {container.name}", False)
        container.started = not spec.get("startupProbe")
        container.ready = not spec.get("readinessProbe") and container.started
        self._changed(container)

    async def _probe(self, container: ContainerState, proc: ContainerProcess) -> None:
        spec = self.spec_of(container.name)
        is_main = container.name in {c["name"] for c in self.pod["spec"]["containers"]}
        if not is_main and spec.get("restartPolicy") != "Always":
            return  # init containers are not probed (sidecars are)
        env, prefix, cwd = self._exec_context(spec, proc)
        loops = [
            self._probe_loop(container, proc, kind, spec[kind], env, prefix, cwd)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe")
            if spec.get(kind)
        ]
        if loops:
            await asyncio.gather(*loops)

    def _exec_context(self, spec: Obj, proc: ContainerProcess) -> tuple[dict[str, str], list[str], str]:
        """Env, command prefix (the container's mount and UTS namespaces) and work dir for exec probes and hooks."""
        env, cwd = {}, spec.get("workingDir") or str(self.dir / "work")
        with contextlib.suppress(OSError):
            env = json.loads((proc.folder / "spec.json").read_text())["env"]
        pid = proc.child_pid()
        prefix = ["nsenter", "-t", str(pid), "-m", "-u", "--"] if pid else []
        return env, prefix, cwd

    async def _probe_loop(
        self,
        container: ContainerState,
        proc: ContainerProcess,
        kind: str,
        probe: Obj,
        env: dict[str, str],
        prefix: list[str],
        cwd: str,
    ) -> None:
        tracker = ProbeTracker.from_spec(probe)
        if kind == "readinessProbe":
            tracker.success_threshold = max(1, tracker.success_threshold)
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)))
        period = float(probe.get("periodSeconds", 10))
        while True:
            if kind == "startupProbe" or container.started:
                ok = await run_probe(probe, self.spec_of(container.name), self.state.pod_ip, env, prefix, cwd)
                verdict = tracker.record(ok)
                if verdict is False:
                    probe_name = kind.removesuffix("Probe").capitalize()
                    self.event("Unhealthy", f"{probe_name} probe failed for container {container.name}", True)
                if kind == "readinessProbe" and verdict is not None:
                    container.ready = verdict
                    self._changed(container)
                elif kind == "startupProbe" and verdict is True:
                    container.started = True
                    container.ready = not self.spec_of(container.name).get("readinessProbe")
                    self._changed(container)
                    return
                elif verdict is False and kind in ("livenessProbe", "startupProbe"):
                    container.ready = False
                    self._changed(container)
                    log.info("%s of %s/%s failed: restarting", kind, self.name, container.name)
                    self.event("Killing", f"Container {container.name} failed {kind}, will be restarted", False)
                    await self._stop_container(container, proc, self.grace_seconds(probe))
                    return
            await asyncio.sleep(period)

    def grace_seconds(self, probe: Obj | None = None) -> float:
        if probe and probe.get("terminationGracePeriodSeconds") is not None:
            return float(probe["terminationGracePeriodSeconds"])
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    async def _stop_container(self, container: ContainerState, proc: ContainerProcess, grace: float) -> None:
        """Stop one container as the kubelet does: its preStop hook (while there is a grace period), then
        SIGTERM, then SIGKILL once the grace period, counted from the start and so including the hook, is over."""
        started = time.monotonic()
        spec = self.spec_of(container.name)
        hook = (spec.get("lifecycle") or {}).get("preStop")
        if hook and grace > 0 and container.state == "running" and proc.running():
            await self._pre_stop(container, proc, spec, hook, grace)
            grace = max(grace - (time.monotonic() - started), MIN_GRACE_AFTER_HOOK_SECONDS)
        if container.ready:  # signalled: no longer serving, not even as a fallback endpoint
            container.ready = False
            self._changed(container)
        await proc.stop(grace)

    async def _pre_stop(
        self, container: ContainerState, proc: ContainerProcess, spec: Obj, hook: Obj, grace: float
    ) -> None:
        env, prefix, cwd = self._exec_context(spec, proc)
        try:
            await asyncio.wait_for(run_hook(hook, spec, self.state.pod_ip, env, prefix, cwd), grace)
            return
        except HookError as exc:
            message = str(exc)
        except TimeoutError:
            message = f"did not finish within the grace period ({grace:g}s)"
        log.info("preStop hook of %s/%s failed: %s", self.name, container.name, message)
        self.event("FailedPreStopHook", f"PreStopHook failed: {message}", True)

    async def terminate(self, grace: float | None = None) -> None:
        """Stop everything: the lifecycle task first (so nothing restarts), then the processes: main
        containers (each with its preStop hook), then native sidecars, all within one grace period."""
        self.terminating = True
        self.state.terminating = True
        self.on_change()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        seconds = self.grace_seconds() if grace is None else grace
        deadline = time.monotonic() + seconds
        running = [(c, self.procs[c.name]) for c in self.state.init + self.state.main]
        for _, proc in running:
            if proc.record is None:  # recorded by an earlier agent but not re-adopted yet (still preparing)
                proc.adopt()
        for container in self.state.main:
            if container.state == "running":
                self.event("Killing", f"Stopping container {container.name}", False)
        sidecars = {c.name for c in self.state.init if self.spec_of(c.name).get("restartPolicy") == "Always"}
        first = [(c, p) for c, p in running if c.name not in sidecars]
        await asyncio.gather(*(self._stop_container(c, p, seconds) for c, p in first))
        # Sidecars outlive the main containers (they may carry their traffic), as with the kubelet.
        left = max(deadline - time.monotonic(), 0.0)
        await asyncio.gather(*(self._stop_container(c, p, left) for c, p in running if c.name in sidecars))
        for container, proc in running:
            if container.state == "running" and proc.record is not None:
                code, reason = await proc.wait()
                container.terminated(code, reason)
                self._changed(container)
