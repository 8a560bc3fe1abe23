"""An InferenceService seen by the person who calls it: predict (OIP v2 tensors from numpy), generate, stream,
and an OpenAI client pointed at it, from inside the cluster or outside (see access.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import httpx

from loom.operator.api import InferenceService

if TYPE_CHECKING:
    import numpy as np
    import openai

    from .client import Client

TIMEOUT = httpx.Timeout(120.0, connect=10.0)


class ServiceError(RuntimeError):
    """The model server refused or failed a request; `status` is its HTTP status, the text its own error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def _error_text(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error") or response.text)
    except ValueError:
        return response.text


class Service:
    """Helpers for one InferenceService (Client.service(name))."""

    def __init__(self, client: Client, name: str, namespace: str, *, api_key: str | None = None) -> None:
        self.client = client
        self.name = name
        self.namespace = namespace
        self._api_key = api_key
        self._object: InferenceService | None = None

    def object(self) -> InferenceService:
        self._object = self.client.get(InferenceService, self.name, self.namespace)
        return self._object

    @property
    def model_name(self) -> str:
        obj = self._object or self.object()
        return obj.spec.model.name or self.name

    def url(self) -> str:
        """The in-cluster URL the service reports (status.url)."""
        obj = self.object()
        if obj.status is None or not obj.status.url:
            raise LookupError(f"InferenceService {self.name} has no URL yet (status.url): is it reconciled?")
        return obj.status.url

    def api_key(self) -> str | None:
        """The key to send: the one given, else the first of the service's API-keys Secret (spec.auth), read with
        the caller's own permissions; None for a service without auth."""
        if self._api_key is not None:
            return self._api_key
        auth = (self._object or self.object()).spec.auth
        if auth is None:
            return None
        ref = auth.api_keys_secret_ref
        secret = self.client.connection.call("GET", f"/api/v1/namespaces/{self.namespace}/secrets/{ref.name}")
        import base64

        raw = (secret.get("data") or {}).get(ref.key)
        if raw is None:
            raise LookupError(f"Secret {ref.name} has no key {ref.key} (spec.auth.apiKeysSecretRef)")
        keys = [line.strip() for line in base64.b64decode(raw).decode().splitlines() if line.strip()]
        if not keys:
            raise LookupError(f"Secret {ref.name} key {ref.key} holds no API key")
        self._api_key = keys[0]
        return self._api_key

    def _headers(self) -> dict[str, str]:
        key = self.api_key()
        return {"authorization": f"Bearer {key}"} if key else {}

    @contextlib.contextmanager
    def connect(self) -> Iterator[httpx.Client]:
        """An HTTP client on the service's base URL, reachable from here, for the `with` block (a port-forward
        outside the cluster is opened once for every call inside)."""
        with self.client.access.open(self.url()) as base, httpx.Client(
            base_url=base, headers=self._headers(), timeout=TIMEOUT, trust_env=False
        ) as http:
            yield http

    def _post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        with self.connect() as http:
            response = http.post(path, json=dict(body))
        if response.status_code != 200:
            raise ServiceError(response.status_code, _error_text(response))
        return dict(response.json())

    def predict(
        self,
        inputs: Mapping[str, Any],
        *,
        outputs: list[str] | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Call the model with named tensors (numpy arrays, lists or scalars; shape and datatype from the array) and
        return its outputs as arrays."""
        from .tensors import decode_outputs, encode_request

        answer = self._post(f"/v2/models/{self.model_name}/infer", encode_request(inputs, outputs, parameters))
        return decode_outputs(answer)

    def generate(self, text: str, **parameters: Any) -> str:
        """The model's whole answer to `text` (parameters such as max_tokens, temperature)."""
        answer = self._post(
            f"/v2/models/{self.model_name}/generate", {"text_input": text, "parameters": parameters}
        )
        return str(answer.get("text_output", ""))

    def stream(self, text: str, **parameters: Any) -> Iterator[str]:
        """The answer piece by piece as the server sends it (server-sent events)."""
        body = {"text_input": text, "parameters": parameters}
        with self.connect() as http, http.stream(
            "POST", f"/v2/models/{self.model_name}/generate_stream", json=body
        ) as response:
            if response.status_code != 200:
                response.read()
                raise ServiceError(response.status_code, _error_text(response))
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line.removeprefix("data:").strip())
                if "error" in event:
                    raise ServiceError(500, str(event["error"]))
                yield str(event.get("text_output", ""))

    @contextlib.contextmanager
    def openai(self) -> Iterator[openai.OpenAI]:
        """An `openai.OpenAI` client on the service's OpenAI-compatible API (`/v1`), with its API key, for the
        `with` block (LLM services; needs the `openai` package, extra `loom[client]`)."""
        import openai

        with self.client.access.open(self.url()) as base:
            api = openai.OpenAI(base_url=f"{base}/v1", api_key=self.api_key() or "none", max_retries=0)
            try:
                yield api
            finally:
                api.close()
