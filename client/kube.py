"""The SDK's only door to the API server: a kubernetes ApiClient from a kubeconfig (any context) or the pod's
in-cluster credentials, and the few REST calls the SDK makes. Errors come back as the API server's own message."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

Manifest = dict[str, Any]

# Server-side apply under the SDK's own field manager: a person's `loom apply` and the operator's writes to
# status never fight over the same fields.
FIELD_MANAGER = "loom-client"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml; charset=utf-8"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class ApiError(RuntimeError):
    """The API server refused a request; `status` is its HTTP status, the text its own message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NotFound(ApiError):
    pass


def _error(exc: ApiException) -> ApiError:
    try:
        message = str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except (ValueError, AttributeError):
        message = str(exc.reason)
    status = int(exc.status or 0)
    return NotFound(status, message) if status == 404 else ApiError(status, message)


def in_cluster() -> bool:
    """True inside a pod that has the in-cluster environment (a ServiceAccount token and the API server's address)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and SERVICE_ACCOUNT_NAMESPACE.parent.joinpath(
        "token"
    ).is_file()


@dataclass
class Connection:
    """An ApiClient and the namespace to use when a call names none (the context's, the pod's, or default)."""

    api: kubernetes.client.ApiClient
    namespace: str

    @classmethod
    def connect(
        cls, *, context: str | None = None, kubeconfig: str | Path | None = None, namespace: str | None = None
    ) -> Connection:
        """In a pod (and with no kubeconfig or context asked for): the in-cluster credentials. Elsewhere the
        kubeconfig ($KUBECONFIG or ~/.kube/config, or `kubeconfig`), its current context or `context`."""
        configuration = kubernetes.client.Configuration()
        if kubeconfig is None and context is None and in_cluster():
            kubernetes.config.load_incluster_config(client_configuration=configuration)
            default_ns = SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
        else:
            # $KUBECONFIG as it is now: the kubernetes package reads it once, when it is first imported.
            config_file = str(kubeconfig) if kubeconfig else os.environ.get("KUBECONFIG") or None
            kubernetes.config.load_kube_config(
                config_file=config_file, context=context, client_configuration=configuration
            )
            default_ns = _context_namespace(config_file, context)
        return cls(kubernetes.client.ApiClient(configuration), namespace or default_ns)

    def call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, Any]] | None = None,
        content_type: str = "application/json",
    ) -> Manifest:
        try:
            response = self.api.call_api(
                path,
                method,
                query_params=query or [],
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _return_http_data_only=True,
            )
        except ApiException as exc:
            raise _error(exc) from None
        data = response.data
        return dict(json.loads(data)) if data else {}

    def stream_lines(self, path: str, query: list[tuple[str, Any]], timeout: float | None = None) -> Iterator[bytes]:
        """The response body line by line as it arrives (watches, followed logs)."""
        try:
            response = self.api.call_api(
                path,
                "GET",
                query_params=query,
                header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"],
                _preload_content=False,
                _return_http_data_only=True,
                _request_timeout=timeout,
            )
        except ApiException as exc:
            raise _error(exc) from None
        try:
            pending = b""
            # amt=None: each chunk as the server flushes it (watch events, log lines), as kubernetes.watch reads.
            for chunk in response.stream(amt=None, decode_content=False):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                yield from lines
            if pending:
                yield pending
        finally:
            response.release_conn()

    def text(self, path: str, query: list[tuple[str, Any]]) -> str:
        try:
            response = self.api.call_api(
                path,
                "GET",
                query_params=query,
                header_params={"Accept": "*/*"},
                auth_settings=["BearerToken"],
                _preload_content=False,
                _return_http_data_only=True,
            )
        except ApiException as exc:
            raise _error(exc) from None
        return bytes(response.data).decode(errors="replace")

    def close(self) -> None:
        self.api.close()


def _context_namespace(config_file: str | None, context: str | None) -> str:
    """The namespace a kubeconfig context names (kubectl's default for -n), else default."""
    try:
        contexts, current = kubernetes.config.list_kube_config_contexts(config_file=config_file)
    except (kubernetes.config.ConfigException, OSError):
        return "default"
    chosen = next((c for c in contexts if c["name"] == context), None) if context else current
    return str(((chosen or {}).get("context") or {}).get("namespace") or "default")
