"""The node agent: keeps the Node fresh, runs the pods bound to it, serves Services and logs.

Reconciliation is level-triggered: watches only wake the loop, which then lists pods, Services and
EndpointSlices and brings workers, proxies and hosts files in line. Pod processes survive an agent
restart (they run in their own sessions) and are re-adopted from the state dir on start; pods that
no longer exist in the API are killed then.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loom.devstack.agent import plan
from loom.devstack.agent.config import POD_NETWORK, AgentConfig
from loom.devstack.agent.hosts import render_hosts, write_in_place
from loom.devstack.agent.kubeapi import KubeApi
from loom.devstack.agent.logserver import LogServer
from loom.devstack.agent.node import NodeKeeper
from loom.devstack.agent.plan import ClusterData
from loom.devstack.agent.podworker import PodWorker
from loom.devstack.agent.proxies import PodEndpoint, ServiceTable, api_endpoints, named_ports
from loom.devstack.agent.runtime import ContainerProcess
from loom.devstack.agent.shim import host_ports_environment
from loom.devstack.agent.status import pod_status
from loom.devstack.agent.volumes import needs_token, refresh_config_maps

Obj = dict[str, Any]
log = logging.getLogger("loom.agent")
RESYNC_SECONDS = 5.0


def _comparable(status: Obj) -> Obj:
    """Status without timestamps that change on every computation."""
    return {
        **status,
        "conditions": [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions", [])],
    }


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.api = KubeApi(cfg.kubeconfig)
        self.node = NodeKeeper(cfg, self.api)
        self.services = ServiceTable(cfg.state_dir)
        self.workers: dict[str, PodWorker] = {}
        self.published: dict[str, Obj] = {}
        self.deleting: dict[str, asyncio.Task[None]] = {}
        self._event_tasks: set[asyncio.Task[None]] = set()
        # On a hand-over (SIGHUP) connections through the Service proxies get this long to finish.
        self.drain_seconds = 0.0
        self.kick = asyncio.Event()
        # (namespace, name) -> ConfigMap, as the configmaps watch last saw it (written from its thread).
        self.config_maps: dict[tuple[str, str], Obj] = {}
        self.dirty = asyncio.Event()
        self.logs = LogServer(self.locate_log, cfg.kubelet_port, cfg.tls_cert, cfg.tls_key)
        host, port = self.api.server
        # Pods reach host loopback ports only where published (shim.py): the API server's, and <state>/host-ports.
        self.extra_env = {
            **plan.api_server_environment(host, port),
            **host_ports_environment(cfg.state_dir, host, port),
        }

    # ---- main loop -----------------------------------------------------------------------------

    async def warm_up(self) -> None:
        """Serve Services and logs before taking over from a previous agent, so a hand-over does not
        interrupt them (both agents listen with SO_REUSEPORT until the old one leaves)."""
        try:
            pods = await self.api.list_pods(self.cfg.node_name)
            services, slices = await asyncio.gather(self.api.list_services(), self.api.list_endpoint_slices())
            await self.services.sync(services, slices, api_endpoints(pods), move_when_taken=False)
        except Exception as exc:  # the API server may be down: run() waits for it
            log.info("Service warm-up skipped: %s", exc)
        try:
            await self.logs.start()
        except OSError as exc:  # a previous agent without reuse_port still holds the port
            log.info("log endpoint starts after the hand-over: %s", exc)

    async def run(self) -> None:
        self.cfg.pods_dir.mkdir(parents=True, exist_ok=True)
        while True:  # the API server may still be starting
            try:
                await self.node.register()
                break
            except Exception as exc:
                log.warning("registering node %s failed, retrying: %s", self.cfg.node_name, exc)
                await asyncio.sleep(2)
        if not self.logs.started:
            await self.logs.start()
        loop = asyncio.get_running_loop()
        self.api.watch_forever(
            ["pods", "services", "endpointslices"], self.cfg.node_name, lambda: loop.call_soon_threadsafe(self.kick.set)
        )
        self.api.watch_config_maps(lambda kind, cm: self._config_map_seen(kind, cm, loop))
        background = [asyncio.create_task(self.node.keep_fresh()), asyncio.create_task(self._publisher())]
        try:
            while True:
                try:
                    await self.reconcile()
                except Exception:  # keep the node alive through API hiccups
                    log.exception("reconcile failed")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.kick.wait(), RESYNC_SECONDS)
                self.kick.clear()
                await asyncio.sleep(0.05)  # coalesce bursts of watch events
        finally:
            for task in background:
                task.cancel()
            self.api.stop()
            await self.services.close(self.drain_seconds)
            await self.logs.stop()

    async def reconcile(self) -> None:
        pods = await self.api.list_pods(self.cfg.node_name)
        services, slices = await asyncio.gather(self.api.list_services(), self.api.list_endpoint_slices())
        live = {p["metadata"]["uid"]: p for p in pods}
        # Every round, not only at start: a terminal pod this agent did not run (it finished before a
        # restart) vanishes from the API at once when deleted, without a deletion this agent would see.
        await self._reap_unknown(set(live) | set(self.workers) | set(self.deleting))
        admitted: list[PodWorker] = []
        doomed: list[Obj] = []
        for uid, pod in live.items():
            if pod["metadata"].get("deletionTimestamp"):
                if uid not in self.deleting:
                    doomed.append(pod)
            elif uid in self.workers:
                self.workers[uid].pod = pod
            elif (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                try:
                    if (worker := await self._admit(pod)) is not None:
                        admitted.append(worker)
                except Exception:  # one pod that cannot be admitted must not hold up the others
                    log.exception(
                        "admitting pod %s/%s failed; will retry", pod["metadata"]["namespace"], pod["metadata"]["name"]
                    )
        for uid in set(self.workers) - set(live):
            if uid not in self.deleting:  # deleted behind our back (force delete): stop right away
                self.deleting[uid] = asyncio.create_task(self._delete(self.workers[uid].pod, force=True))
        # New pods count as (not yet ready) endpoints before anything starts, so a headless name with
        # publishNotReadyAddresses resolves in every pod's hosts file by the time its peers run.
        await self.services.sync(services, slices, self._endpoints(live))
        # Only now, with the Service proxies no longer choosing them, do deleted pods start to stop.
        for pod in doomed:
            self.deleting[pod["metadata"]["uid"]] = asyncio.create_task(self._delete(pod))
        for worker in self.workers.values():
            try:
                self._write_hosts(worker)
            except OSError as exc:
                log.warning("hosts file of %s/%s not written: %s", worker.namespace, worker.name, exc)
        for worker in admitted:
            worker.start()
        if admitted:
            self.dirty.set()
        self._refresh_volumes()

    def _config_map_seen(self, kind: str, cm: Obj, loop: asyncio.AbstractEventLoop) -> None:
        """From the watch thread: remember the ConfigMap; a change wakes the loop, which updates the volumes."""
        meta = cm.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if kind == "DELETED":
            self.config_maps.pop(key, None)
            return
        before = self.config_maps.get(key)
        self.config_maps[key] = cm
        if before is None or (before.get("metadata") or {}).get("resourceVersion") != meta.get("resourceVersion"):
            loop.call_soon_threadsafe(self.kick.set)

    def _refresh_volumes(self) -> None:
        """Running pods' configMap volumes follow their ConfigMaps (the kubelet's in-place update)."""
        for worker in self.workers.values():
            if not worker.folders or worker.state.final_phase is not None:
                continue
            namespace = worker.namespace
            cms = {name: cm for (ns, name), cm in list(self.config_maps.items()) if ns == namespace}
            try:
                changed = refresh_config_maps(worker.pod, worker.folders, cms)
            except OSError as exc:
                log.warning("configMap volumes of %s/%s not updated: %s", namespace, worker.name, exc)
                continue
            if changed:
                log.info("updated configMap volumes %s of %s/%s", changed, namespace, worker.name)

    def _endpoints(self, live: dict[str, Obj]) -> list[PodEndpoint]:
        """This node's pods as Service endpoints; readiness straight from the workers' probes."""
        endpoints = []
        for uid, worker in self.workers.items():
            pod = live.get(uid)
            if pod is None:
                continue
            spec = pod["spec"]
            serving = (
                worker.state.final_phase is None and bool(worker.state.main) and all(c.ready for c in worker.state.main)
            )
            terminating = bool(pod["metadata"].get("deletionTimestamp")) or worker.state.terminating
            endpoints.append(
                PodEndpoint(
                    worker.namespace,
                    pod["metadata"].get("labels") or {},
                    worker.state.pod_ip,
                    serving and not terminating,
                    spec.get("hostname"),
                    spec.get("subdomain"),
                    named_ports(spec),
                    serving=serving,
                    terminating=terminating,
                )
            )
        return endpoints

    async def stop_all_pods(self, max_grace: float) -> None:
        """Stop every pod process this agent knows of, adopted or not (the agent is going away).

        Their state stays: a later agent sees them terminated and restarts them per restartPolicy."""
        await asyncio.gather(
            *(w.terminate(min(w.grace_seconds(), max_grace)) for w in self.workers.values()), return_exceptions=True
        )
        known = {w.dir for w in self.workers.values()}
        if self.cfg.pods_dir.exists():
            for pod_dir in self.cfg.pods_dir.iterdir():
                if pod_dir not in known:
                    await self._kill_recorded(pod_dir)

    async def _reap_unknown(self, live: set[str]) -> None:
        """Kill processes of, and forget, pods that no longer exist (e.g. deleted while the agent was down)."""
        for pod_dir in self.cfg.pods_dir.iterdir():
            if pod_dir.name not in live:
                await self._kill_recorded(pod_dir)
                shutil.rmtree(pod_dir, ignore_errors=True)
        if self.cfg.logs_dir.exists():
            for logs in self.cfg.logs_dir.iterdir():
                if logs.name.rsplit("_", 1)[-1] not in live:
                    shutil.rmtree(logs, ignore_errors=True)

    @staticmethod
    async def _kill_recorded(pod_dir: Path, grace: float = 0) -> None:
        for folder in (pod_dir / "c").glob("*"):
            proc = ContainerProcess(folder)
            # Even when the launcher is gone, whatever is left in its process group goes too.
            if proc.adopt() or proc.record is not None:
                await proc.stop(grace)

    # ---- admission and deletion -----------------------------------------------------------------

    def _allocations(self) -> tuple[set[str], set[int]]:
        ips = {w.state.pod_ip for w in self.workers.values()}
        gpus = {g for w in self.workers.values() if w.state.final_phase is None for g in w.gpus}
        return ips, gpus

    async def _admit(self, pod: Obj) -> PodWorker | None:
        """Allocate address and GPUs and create the worker; the caller starts it once hosts files exist."""
        uid = pod["metadata"]["uid"]
        pod_dir = self.cfg.pods_dir / uid
        meta_file = pod_dir / "meta.json"
        ips, used_gpus = self._allocations()
        try:
            saved = json.loads(meta_file.read_text())
            ip, gpus = saved["ip"], saved["gpus"]
        except (OSError, ValueError, KeyError):
            ip = plan.allocate_address(POD_NETWORK, ips, uid)
            found = plan.allocate_gpus(plan.gpu_request(pod["spec"]), self.cfg.gpus, used_gpus)
            if found is None:
                await self._reject(
                    pod,
                    "UnexpectedAdmissionError",
                    f"Allocate failed: not enough free nvidia.com/gpu on {self.cfg.node_name}",
                )
                return None
            gpus = found
            pod_dir.mkdir(parents=True, exist_ok=True)
            meta_file.write_text(json.dumps({"ip": ip, "gpus": gpus}))
        worker = PodWorker(
            self.cfg,
            pod,
            ip,
            gpus,
            self._fetch,
            self.dirty.set,
            self.extra_env,
            lambda reason, message, warning: self._event(pod, reason, message, warning),
        )
        self.workers[uid] = worker
        return worker

    async def _reject(self, pod: Obj, reason: str, message: str) -> None:
        meta = pod["metadata"]
        await self.api.patch_pod_status(
            meta["namespace"], meta["name"], {"phase": "Failed", "reason": reason, "message": message}
        )

    async def _delete(self, pod: Obj, force: bool = False) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        worker = self.workers.get(uid)
        try:
            grace = 0.0 if force else meta.get("deletionGracePeriodSeconds")
            if worker is not None:
                await worker.terminate(None if grace is None else float(grace))
                with contextlib.suppress(Exception):
                    await self._publish(worker)
            else:  # deleted while the agent was away: its processes may still run unadopted
                await self._kill_recorded(self.cfg.pods_dir / uid, float(grace or 0))
            if not force:
                await self.api.delete_pod_now(meta["namespace"], meta["name"], uid)
            self.workers.pop(uid, None)
            self.published.pop(uid, None)
            shutil.rmtree(self.cfg.pods_dir / uid, ignore_errors=True)
            for logs in self.cfg.logs_dir.glob(f"*_{uid}"):  # like kubelet: logs go with the pod
                shutil.rmtree(logs, ignore_errors=True)
        except Exception:
            log.exception("deleting pod %s/%s failed; will retry", meta["namespace"], meta["name"])
        finally:
            self.deleting.pop(uid, None)
            self.kick.set()

    def _event(self, pod: Obj, reason: str, message: str, warning: bool) -> None:
        """Fire and forget: an Event that cannot be written must not hold a pod up."""

        async def send() -> None:
            try:
                await self.api.pod_event(pod, reason, message, warning, self.cfg.node_name)
            except Exception as exc:
                log.debug("event %s for %s not recorded: %s", reason, pod["metadata"]["name"], exc)

        task = asyncio.create_task(send())
        self._event_tasks.add(task)
        task.add_done_callback(self._event_tasks.discard)

    # ---- data the workers need -------------------------------------------------------------------

    async def _fetch(self, pod: Obj, want_token: bool) -> tuple[ClusterData, str | None]:
        """The ConfigMaps and Secrets a pod refers to, and a service account token if it mounts one."""
        namespace, spec = pod["metadata"]["namespace"], pod["spec"]
        cm_names, secret_names = plan.referenced_objects(spec)
        cms = {n: cm for n in cm_names if (cm := await self.api.config_map(namespace, n)) is not None}
        secrets = {n: s for n in secret_names if (s := await self.api.secret(namespace, n)) is not None}
        token = None
        for projection in needs_token(pod)[:1] if want_token else []:
            token = await self.api.token(
                namespace,
                spec.get("serviceAccountName", "default"),
                projection.get("audience"),
                int(projection.get("expirationSeconds", 3600)),
                pod,
            )
        return ClusterData(cms, secrets), token

    def _write_hosts(self, worker: PodWorker) -> None:
        spec = worker.pod["spec"]
        content = render_hosts(
            worker.state.pod_ip,
            worker.name,
            worker.namespace,
            spec.get("hostname"),
            spec.get("subdomain"),
            self.services.views,
        )
        worker.hosts_file.parent.mkdir(parents=True, exist_ok=True)
        write_in_place(worker.hosts_file, content)

    # ---- status ----------------------------------------------------------------------------------

    async def _publisher(self) -> None:
        while True:
            await self.dirty.wait()
            self.dirty.clear()
            await asyncio.sleep(0.1)
            for worker in list(self.workers.values()):
                try:
                    await self._publish(worker)
                except Exception as exc:
                    log.warning("status of %s/%s not published: %s", worker.namespace, worker.name, exc)
                    self.published.pop(worker.uid, None)
                    asyncio.get_running_loop().call_later(1.0, self.dirty.set)

    async def _publish(self, worker: PodWorker) -> None:
        previous = (worker.pod.get("status") or {}).get("conditions")
        status = pod_status(worker.state, previous)
        if self.published.get(worker.uid) == _comparable(status):
            return
        await self.api.patch_pod_status(worker.namespace, worker.name, status)
        self.published[worker.uid] = _comparable(status)

    # ---- logs ------------------------------------------------------------------------------------

    def locate_log(
        self, namespace: str, pod: str, container: str, previous: bool
    ) -> tuple[Path, Callable[[], bool]] | None:
        worker = next((w for w in self.workers.values() if (w.namespace, w.name) == (namespace, pod)), None)
        if worker is None:
            return self._archived_log(namespace, pod, container, previous)
        if container not in worker.procs:
            return None
        state = next(c for c in worker.state.init + worker.state.main if c.name == container)
        attempt = state.attempt - 1 if previous else state.attempt
        if attempt < 0 or not state.ran_once:
            return None
        proc = worker.procs[container]
        current = not previous
        return worker.log_path(container, attempt), lambda: current and proc.running()

    def _archived_log(
        self, namespace: str, pod: str, container: str, previous: bool
    ) -> tuple[Path, Callable[[], bool]] | None:
        """Logs of a pod this agent does not run (it finished before a restart): newest attempts on disk."""
        folders = sorted(self.cfg.logs_dir.glob(f"{namespace}_{pod}_*/{container}"), key=lambda f: f.stat().st_mtime)
        if not folders:
            return None
        attempts = sorted(folders[-1].glob("*.log"), key=lambda f: int(f.stem) if f.stem.isdigit() else -1)
        index = -2 if previous else -1
        if len(attempts) < -index:
            return None
        return attempts[index], lambda: False
