"""The activator's two uses of the API server, with the standard `kubernetes` client in threads.

- A list+watch of the model-server pods (label selector), kept in `Targets` as their Ready endpoints.
- `wake`: read the InferenceService; when it asks for no replica, set one through its scale subresource (a merge
  patch carrying the resourceVersion read, so it never overrides a decision made meanwhile: a conflict means
  someone else already wrote it, and the wake loop reads it again).

Its ServiceAccount may only `get` this InferenceService and `patch` its `scale`, and `list`/`watch` pods of the
namespace (rendered by the operator: loom.operator.render.inferenceservice_activator).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

import kubernetes
from kubernetes.client.exceptions import ApiException

from .config import ActivatorConfig
from .targets import ready_endpoints

log = logging.getLogger("loom.workloads.activator.kube")

WATCH_TIMEOUT_S = 240  # the server ends each watch after this; it is resumed from its resourceVersion
ERROR_PAUSE_S = 1.0


def api_client() -> kubernetes.client.ApiClient:
    """In a pod: its ServiceAccount (the token file is re-read as it rotates). Elsewhere: the kubeconfig."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config()
    else:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


def wake_patch(service: dict[str, Any]) -> dict[str, Any] | None:
    """The scale merge patch that asks for one replica, or None when the service already asks for some (pure).
    The resourceVersion read is a precondition: the API server answers 409 if anything wrote the object since."""
    if (service.get("spec") or {}).get("replicas"):
        return None
    return {"metadata": {"resourceVersion": service["metadata"]["resourceVersion"]}, "spec": {"replicas": 1}}


class KubeWaker:
    def __init__(self, config: ActivatorConfig, api: kubernetes.client.ApiClient) -> None:
        self.config = config
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.group, self.version = config.api_version.split("/")

    async def wake(self) -> bool:
        return await asyncio.to_thread(self._wake)

    def _wake(self) -> bool:
        cfg = self.config
        service = self.custom.get_namespaced_custom_object(
            self.group, self.version, cfg.namespace, cfg.plural, cfg.service
        )
        patch = wake_patch(service)
        if patch is None:
            return False
        try:
            self.custom.patch_namespaced_custom_object_scale(
                self.group, self.version, cfg.namespace, cfg.plural, cfg.service, patch
            )
        except ApiException as exc:
            if exc.status == 409:  # the object changed since it was read
                log.info("%s/%s changed meanwhile; not scaled by the activator", cfg.namespace, cfg.service)
                return False
            raise
        return True


class WatchedPods(Protocol):
    """What a pod watch needs of its owner's config (the activator's, the endpoint picker's)."""

    @property
    def namespace(self) -> str: ...

    @property
    def target_port(self) -> int: ...

    def selector_string(self) -> str: ...


class PodWatch:
    """List, then watch, the service's pods in a thread; every change republishes the Ready endpoints (`_push`;
    the endpoint picker publishes its own view of the same pods)."""

    def __init__(
        self, config: WatchedPods, api: kubernetes.client.ApiClient, publish: Callable[[Any], object]
    ) -> None:
        self.config = config
        self.api = api
        self.core = kubernetes.client.CoreV1Api(api)
        self._publish = publish
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)
        self.synced = threading.Event()  # the first list arrived

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._list_and_watch()
            except Exception as exc:  # the API unreachable or the watch expired: list again
                if not self._stop.is_set():
                    log.warning("watching pods failed: %s; listing again", exc)
                    self._stop.wait(ERROR_PAUSE_S)

    def _list_and_watch(self) -> None:
        cfg = self.config
        selector = cfg.selector_string()
        listing = self.core.list_namespaced_pod(cfg.namespace, label_selector=selector)
        pods = {p.metadata.name: self.api.sanitize_for_serialization(p) for p in listing.items}
        self._push(pods)
        self.synced.set()
        version = listing.metadata.resource_version
        while not self._stop.is_set():
            stream = kubernetes.watch.Watch().stream(
                self.core.list_namespaced_pod,
                cfg.namespace,
                label_selector=selector,
                resource_version=version,
                timeout_seconds=WATCH_TIMEOUT_S,
                allow_watch_bookmarks=True,
            )
            for event in stream:
                obj = event["raw_object"]
                kind = event["type"]
                if kind == "ERROR":
                    raise RuntimeError(f"watch error: {obj.get('message', obj)}")  # e.g. 410 Gone: relist
                version = obj.get("metadata", {}).get("resourceVersion", version)
                if kind == "BOOKMARK":
                    continue
                name = obj["metadata"]["name"]
                if kind == "DELETED":
                    pods.pop(name, None)
                else:
                    pods[name] = obj
                self._push(pods)
                if self._stop.is_set():
                    return

    def _push(self, pods: dict[str, Any]) -> None:
        self._publish(ready_endpoints(pods.values(), self.config.target_port))
