"""`Client`: apply, get, list, delete, watch and wait for Loom objects, typed by the API's own models."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from loom.operator.api import API_VERSION, GROUP, VERSION, InferenceService, Kind, TrainingJob

from .access import ServiceAccess, default_access
from .kube import APPLY_CONTENT_TYPE, FIELD_MANAGER, ApiError, Connection, Manifest, NotFound
from .models import AnyObject, LoomObject, from_manifest, kind_of, name_of, namespace_of
from .validation import validate
from .waiting import Target, judge, summary

if TYPE_CHECKING:
    from .serving import Service
    from .training import Training


class WaitFailed(RuntimeError):
    """The object can no longer reach what was waited for; the message is the object's own (its conditions)."""

    def __init__(self, message: str, obj: Manifest) -> None:
        super().__init__(message)
        self.object = obj


class WaitTimeout(TimeoutError):
    """The wait ran out of time; the message says where the object stood."""

    def __init__(self, message: str, obj: Manifest | None) -> None:
        super().__init__(message)
        self.object = obj


def _path(kind: Kind, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{kind.plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class Client:
    """A connection to one cluster (a kubeconfig context, or in-cluster) and a default namespace.

    >>> client = Client(namespace="team-a")              # kubeconfig's current context, or in-cluster
    >>> job = client.apply(training_job("gpt", spec))     # validated here first, then server-side applied
    >>> client.wait_for(job, phase="Succeeded", timeout=3600)
    """

    def __init__(
        self,
        *,
        namespace: str | None = None,
        context: str | None = None,
        kubeconfig: str | Path | None = None,
        connection: Connection | None = None,
        access: ServiceAccess | None = None,
    ) -> None:
        self.connection = connection or Connection.connect(context=context, kubeconfig=kubeconfig, namespace=namespace)
        if namespace:
            self.connection.namespace = namespace
        # How the SDK reaches Services (model servers, MLflow): directly in a pod, through a port-forward outside.
        self.access = access or default_access(self.connection)

    @property
    def namespace(self) -> str:
        return self.connection.namespace

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- objects

    def _namespace(self, obj: LoomObject | None, namespace: str | None) -> str:
        return namespace or (namespace_of(obj) if obj is not None else None) or self.namespace

    def apply(self, obj: AnyObject, *, namespace: str | None = None, dry_run: bool = False) -> AnyObject:
        """Create or update the object by server-side apply (the fields it sets are the SDK's to own) after
        checking it here with the API server's own rules (InvalidObject lists every problem). Returns the object
        as stored, status included."""
        validate(obj)
        kind = kind_of(obj)
        ns = self._namespace(obj, namespace)
        manifest = obj.to_wire()
        manifest.pop("status", None)
        manifest["metadata"] = {**manifest.get("metadata", {}), "namespace": ns}
        for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
            manifest["metadata"].pop(key, None)
        query: list[tuple[str, Any]] = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        if dry_run:
            query.append(("dryRun", "All"))
        stored = self.connection.call(
            "PATCH",
            _path(kind, ns, name_of(obj)),
            body=json.dumps(manifest).encode(),
            query=query,
            content_type=APPLY_CONTENT_TYPE,
        )
        return type(obj).model_validate(stored)

    def get(self, kind: type[AnyObject], name: str, namespace: str | None = None) -> AnyObject:
        """The object as stored (NotFound when there is none)."""
        stored = self.connection.call("GET", _path(kind_of(kind), namespace or self.namespace, name))
        return kind.model_validate(stored)

    def get_manifest(self, kind: Kind, name: str, namespace: str | None = None) -> Manifest:
        return self.connection.call("GET", _path(kind, namespace or self.namespace, name))

    def list(
        self, kind: type[AnyObject], namespace: str | None = None, *, label_selector: str | None = None
    ) -> list[AnyObject]:
        """Objects of one kind in a namespace (the client's by default), by name."""
        query = [("labelSelector", label_selector)] if label_selector else []
        listed = self.connection.call("GET", _path(kind_of(kind), namespace or self.namespace), query=query)
        items = [kind.model_validate({"apiVersion": API_VERSION, "kind": kind_of(kind).kind, **item})
                 for item in listed.get("items", [])]
        return sorted(items, key=lambda item: name_of(item))

    @overload
    def delete(self, target: LoomObject, name: None = None, namespace: str | None = None) -> bool: ...

    @overload
    def delete(self, target: type[LoomObject], name: str, namespace: str | None = None) -> bool: ...

    def delete(self, target: LoomObject | type[LoomObject], name: str | None = None,
               namespace: str | None = None) -> bool:
        """Delete an object (or kind and name); False when it was already gone. Its children go with it."""
        if isinstance(target, type):
            if not name:
                raise ValueError("delete(kind, name): the name is missing")
            kind, ns = kind_of(target), namespace or self.namespace
        else:
            kind, ns, name = kind_of(target), self._namespace(target, namespace), name_of(target)
        try:
            self.connection.call("DELETE", _path(kind, ns, name), query=[("propagationPolicy", "Background")])
        except NotFound:
            return False
        return True

    # ------------------------------------------------------------------------------------------- watching

    def watch_manifests(
        self, kind: Kind, name: str, namespace: str | None = None, timeout: float | None = None
    ) -> Iterator[Manifest]:
        """The object now, then each time its status (or generation) changes, until `timeout` seconds have passed
        (forever when None). Ends when the object is deleted. Reconnects when the API server closes the watch."""
        ns = namespace or self.namespace
        deadline = None if timeout is None else time.monotonic() + timeout
        current = self.connection.call("GET", _path(kind, ns, name))
        yield current
        seen = _fingerprint(current)
        version = current["metadata"].get("resourceVersion", "")
        while deadline is None or time.monotonic() < deadline:
            left = 300.0 if deadline is None else max(1.0, deadline - time.monotonic())
            query: list[tuple[str, Any]] = [
                ("watch", "true"),
                ("fieldSelector", f"metadata.name={name}"),
                ("resourceVersion", version),
                ("timeoutSeconds", str(math.ceil(min(left, 300.0)))),
            ]
            restart = False
            for line in self.connection.stream_lines(_path(kind, ns), query, timeout=min(left, 300.0) + 10):
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    restart = True  # e.g. 410 Gone: our resourceVersion is too old; read the object again
                    break
                obj = event.get("object") or {}
                if event.get("type") == "DELETED":
                    return
                version = obj.get("metadata", {}).get("resourceVersion", version)
                if _fingerprint(obj) != seen:
                    seen = _fingerprint(obj)
                    yield {"apiVersion": API_VERSION, "kind": kind.kind, **obj}
                if deadline is not None and time.monotonic() >= deadline:
                    return
            if restart:
                try:
                    current = self.connection.call("GET", _path(kind, ns, name))
                except NotFound:
                    return
                version = current["metadata"].get("resourceVersion", "")
                if _fingerprint(current) != seen:
                    seen = _fingerprint(current)
                    yield current

    def watch(
        self, kind: type[AnyObject], name: str, namespace: str | None = None, timeout: float | None = None
    ) -> Iterator[AnyObject]:
        """Typed `watch_manifests`: the object now, then on every status change."""
        for manifest in self.watch_manifests(kind_of(kind), name, namespace, timeout):
            yield kind.model_validate(manifest)

    def wait_for_manifest(
        self,
        kind: Kind,
        name: str,
        target: Target,
        *,
        namespace: str | None = None,
        timeout: float = 600,
        on_change: Callable[[Manifest], None] | None = None,
    ) -> Manifest:
        last: Manifest | None = None
        for manifest in self.watch_manifests(kind, name, namespace, timeout):
            last = manifest
            if on_change is not None:
                on_change(manifest)
            verdict = judge(manifest, target)
            if verdict.done:
                return manifest
            if verdict.failure:
                raise WaitFailed(verdict.failure, manifest)
        where = summary(last) if last else "deleted"
        raise WaitTimeout(
            f"{kind.kind} {name} did not reach {target.describe()} within {timeout:g}s ({where})", last
        )

    @overload
    def wait_for(
        self, target: AnyObject, name: None = None, *, condition: str | None = ..., status: str = ...,
        phase: str | None = ..., timeout: float = ..., namespace: str | None = ...,
    ) -> AnyObject: ...

    @overload
    def wait_for(
        self, target: type[AnyObject], name: str, *, condition: str | None = ..., status: str = ...,
        phase: str | None = ..., timeout: float = ..., namespace: str | None = ...,
    ) -> AnyObject: ...

    def wait_for(
        self,
        target: AnyObject | type[AnyObject],
        name: str | None = None,
        *,
        condition: str | None = "Ready",
        status: str = "True",
        phase: str | None = None,
        timeout: float = 600,
        namespace: str | None = None,
    ) -> AnyObject:
        """Wait until the object has `condition` (Ready by default) with `status`, or is in `phase`; return it.

        Raises WaitFailed, with the object's own condition message, as soon as it can no longer get there (a
        Failed object, a TrainingJob that ended otherwise), and WaitTimeout after `timeout` seconds."""
        if isinstance(target, type):
            model, ns = target, namespace or self.namespace
            if not name:
                raise ValueError("wait_for(kind, name): the name is missing")
        else:
            model, ns, name = type(target), self._namespace(target, namespace), name_of(target)
        wanted = Target(condition=None, phase=phase) if phase else Target(condition=condition, status=status)
        manifest = self.wait_for_manifest(kind_of(model), name, wanted, namespace=ns, timeout=timeout)
        return model.model_validate(manifest)

    # ------------------------------------------------------------------------------------------- helpers by kind

    def training(self, job: TrainingJob | str, namespace: str | None = None) -> Training:
        """Progress, logs, metrics and results of a TrainingJob."""
        from .training import Training

        name = job if isinstance(job, str) else name_of(job)
        ns = namespace or (None if isinstance(job, str) else namespace_of(job)) or self.namespace
        return Training(self, name, ns)

    def service(
        self, service: InferenceService | str, namespace: str | None = None, *, api_key: str | None = None
    ) -> Service:
        """Predict, generate and chat with an InferenceService."""
        from .serving import Service

        name = service if isinstance(service, str) else name_of(service)
        ns = namespace or (None if isinstance(service, str) else namespace_of(service)) or self.namespace
        return Service(self, name, ns, api_key=api_key)


def _fingerprint(obj: Manifest) -> str:
    """What a watcher cares about: the status and the spec's generation (not every resourceVersion bump)."""
    return json.dumps([obj.get("status"), obj.get("metadata", {}).get("generation")], sort_keys=True)


__all__ = ["ApiError", "Client", "NotFound", "WaitFailed", "WaitTimeout", "from_manifest"]
