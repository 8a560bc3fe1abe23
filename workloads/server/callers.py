"""Who calls a model endpoint, for the ASGI guards in front of the model server (guard.py) and the OpenAI front
(loom.workloads.llm.guard): which requests are guarded, the caller a request's API key names, and the JSON reply a
guard sends when it refuses one. The refusals' wording and shape stay each front's own (OIP vs OpenAI errors).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from starlette.types import Scope, Send

from .flow import ANONYMOUS, ApiKeys, presented_key

log = logging.getLogger(__name__)

# Probes and metrics are exempt: the kubelet and Prometheus carry no API key, and a rate-limited readiness probe
# would take a healthy replica out of its Service.
EXEMPT_PREFIXES = ("/v2/health/", "/metrics")


def guarded(scope: Scope) -> bool:
    """An HTTP request to a model endpoint (not a probe, not /metrics)."""
    return bool(scope["type"] == "http" and not scope["path"].startswith(EXEMPT_PREFIXES))


def caller_of(scope: Scope, keys: ApiKeys) -> str | None:
    """The caller the rate limits count against: the id of the API key presented (keys on), else the client's
    address; None when keys are on and the request carries no valid key (logged, never the key itself)."""
    if not keys.enabled:
        return f"client-{scope['client'][0]}" if scope.get("client") else ANONYMOUS
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    key = presented_key(headers.get("authorization"), headers.get("x-api-key"))
    caller = keys.check(key)
    if caller is None:
        log.info("refused request to %s: %s", scope["path"], "no API key" if key is None else "bad API key")
    return caller


async def send_json(send: Send, status: int, body: object, headers: Mapping[str, str]) -> None:
    """A complete JSON response, sent straight from the middleware (the app never sees the request)."""
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})
