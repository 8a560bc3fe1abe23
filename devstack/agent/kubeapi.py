"""The agent's only door to the API server: the official client, called from threads, JSON dicts out."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlparse

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

Obj = dict[str, Any]
log = logging.getLogger("loom.agent.api")


class KubeApi:
    def __init__(self, kubeconfig: str) -> None:
        configuration = client.Configuration()
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        # Status patches, fetches and events run concurrently in threads: the default pool of 10 churns.
        configuration.connection_pool_maxsize = 32
        self.api_client = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.api_client)
        self.discovery = client.DiscoveryV1Api(self.api_client)
        self.coordination = client.CoordinationV1Api(self.api_client)
        self._stop = threading.Event()

    @property
    def server(self) -> tuple[str, int]:
        url = urlparse(self.api_client.configuration.host)
        return url.hostname or "127.0.0.1", url.port or 443

    @staticmethod
    def _json(response: Any) -> Any:
        return json.loads(response.data)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a client call in a thread and return its decoded JSON body."""
        response = await asyncio.to_thread(fn, *args, _preload_content=False, **kwargs)
        return self._json(response)

    async def get_or_none(self, fn: Callable[..., Any], *args: Any) -> Obj | None:
        try:
            result: Obj = await self.call(fn, *args)
            return result
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def list_pods(self, node_name: str) -> list[Obj]:
        body = await self.call(self.core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node_name}")
        return list(body["items"])

    async def list_services(self) -> list[Obj]:
        return list((await self.call(self.core.list_service_for_all_namespaces))["items"])

    async def list_endpoint_slices(self) -> list[Obj]:
        return list((await self.call(self.discovery.list_endpoint_slice_for_all_namespaces))["items"])

    async def config_map(self, namespace: str, name: str) -> Obj | None:
        return await self.get_or_none(self.core.read_namespaced_config_map, name, namespace)

    async def secret(self, namespace: str, name: str) -> Obj | None:
        return await self.get_or_none(self.core.read_namespaced_secret, name, namespace)

    async def token(self, namespace: str, service_account: str, audience: str | None, seconds: int, pod: Obj) -> str:
        spec: Obj = {
            "expirationSeconds": max(600, seconds),
            "boundObjectRef": {
                "kind": "Pod",
                "apiVersion": "v1",
                "name": pod["metadata"]["name"],
                "uid": pod["metadata"]["uid"],
            },
        }
        if audience:
            spec["audiences"] = [audience]
        body = await self.call(
            self.core.create_namespaced_service_account_token, service_account, namespace, {"spec": spec}
        )
        return str(body["status"]["token"])

    async def patch_pod_status(self, namespace: str, name: str, status: Obj) -> None:
        await self.call(self.core.patch_namespaced_pod_status, name, namespace, {"status": status})

    async def delete_pod_now(self, namespace: str, name: str, uid: str) -> None:
        body = client.V1DeleteOptions(grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid))
        try:
            await self.call(self.core.delete_namespaced_pod, name, namespace, body=body)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    async def pod_event(self, pod: Obj, reason: str, message: str, warning: bool, node: str) -> None:
        meta = pod["metadata"]
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message,
            "type": "Warning" if warning else "Normal",
            "source": {"component": "kubelet", "host": node},
            "reportingComponent": "kubelet",
            "reportingInstance": node,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        await self.call(self.core.create_namespaced_event, meta["namespace"], body)

    def watch_forever(self, kinds: list[str], node_name: str, on_event: Callable[[], None]) -> list[threading.Thread]:
        """One daemon thread per kind; each event (or reconnect) calls on_event, which must be thread-safe."""
        sources: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
            "pods": (self.core.list_pod_for_all_namespaces, {"field_selector": f"spec.nodeName={node_name}"}),
            "services": (self.core.list_service_for_all_namespaces, {}),
            "endpointslices": (self.discovery.list_endpoint_slice_for_all_namespaces, {}),
        }
        threads = []
        for kind in kinds:
            fn, kwargs = sources[kind]
            thread = threading.Thread(
                target=self._watch, args=(fn, kwargs, on_event), name=f"watch-{kind}", daemon=True
            )
            thread.start()
            threads.append(thread)
        return threads

    def watch_config_maps(self, on_change: Callable[[str, Obj], None]) -> threading.Thread:
        """A daemon thread that calls on_change(event type, ConfigMap) for every ConfigMap event (the agent's cache
        for updating mounted ConfigMap volumes in place)."""

        def run() -> None:
            while not self._stop.is_set():
                try:
                    for event in watch.Watch().stream(self.core.list_config_map_for_all_namespaces, timeout_seconds=30):
                        on_change(str(event["type"]), dict(event["raw_object"]))
                        if self._stop.is_set():
                            return
                except Exception as exc:  # the API server restarting must not end the watch
                    log.debug("watch configmaps ended: %s", exc)
                    self._stop.wait(1.0)

        thread = threading.Thread(target=run, name="watch-configmaps", daemon=True)
        thread.start()
        return thread

    def _watch(self, fn: Callable[..., Any], kwargs: dict[str, Any], on_event: Callable[[], None]) -> None:
        while not self._stop.is_set():
            try:
                for _ in watch.Watch().stream(fn, timeout_seconds=30, **kwargs):
                    on_event()
                    if self._stop.is_set():
                        return
            except Exception as exc:  # the API server restarting must not end the watch
                log.debug("watch %s ended: %s", fn.__name__, exc)
                self._stop.wait(1.0)
            on_event()

    def stop(self) -> None:
        self._stop.set()
