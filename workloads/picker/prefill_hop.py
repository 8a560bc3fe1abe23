"""The prefill hop of a disaggregated service (the HTTP proxy's edge around disaggregation.py): between choosing
a client's decode replica and forwarding the request to it, the same request with one token to generate goes to a
prefill replica of the decode's kv-version, whose engine stores the prompt's KV for the decode's engine to load.

Its answer is read and dropped: only its success matters. The client's headers go with it as they go to the
decode replica (the Authorization included: each replica's front checks API keys as without a picker). Whatever
goes wrong (no prefill replica of that version ready, a refused connection, an error status, no answer within
`prefillTimeoutSeconds`) leaves the decode replica to prefill by itself: the request is never lost to the split,
only its speed-up, which loom_picker_disaggregation_total{path="decode-only"} counts with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import aiohttp

from loom.workloads.activator.proxy import Unreachable, Upstream

from .disaggregation import choose_prefill, prefill_body
from .state import PickerState

log = logging.getLogger("loom.workloads.picker.prefill")

PREFILLED = "prefill+decode"
DECODE_ONLY = "decode-only"


class PrefillHop:
    def __init__(self, state: PickerState, upstream: Upstream, timeout_s: float) -> None:
        self.state = state
        self.upstream = upstream
        self.timeout_s = timeout_s

    async def before_decode(self, path: str, path_qs: str, body: bytes, headers: list[tuple[str, str]],
                            request_headers: Mapping[str, str], decode_endpoint: str) -> str | None:
        """Prefill the request bound for `decode_endpoint`; the path it took (PREFILLED or DECODE_ONLY), or None
        for a request that is no generation (nothing to prefill). `path`: the request's URL path; `path_qs`: as
        forwarded; `headers`: as forwarded; `request_headers`: the client's (the picker's choice reads them)."""
        prefill = prefill_body(path, body)
        if prefill is None:
            return None
        pick = choose_prefill(self.state, path, body, request_headers, decode_endpoint)
        if pick is None:
            return self._count(DECODE_ONLY, "no_prefill_replica")
        endpoint = pick.decision.endpoint
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self.upstream.send(endpoint, "POST", path_qs, headers, prefill)
                try:
                    answer = await response.read()
                finally:
                    response.release()
        except Unreachable as exc:
            log.info("prefill replica unreachable (%s); the decode replica prefills", exc)
            self.state.forget(endpoint)
            return self._count(DECODE_ONLY, "prefill_failed")
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("prefill on %s failed (%s); the decode replica prefills", endpoint, type(exc).__name__)
            return self._count(DECODE_ONLY, "prefill_failed")
        finally:
            self.state.done(endpoint)
        if response.status >= 400:
            # The decode replica's front gives the client the same refusal (a bad request, a wrong key) if it is one.
            log.info("prefill on %s answered %d: %s", endpoint, response.status,
                     answer[:300].decode("utf-8", "replace"))
            return self._count(DECODE_ONLY, "prefill_failed")
        return self._count(PREFILLED, "prefilled")

    def _count(self, path: str, reason: str) -> str:
        metrics = self.state.metrics
        metrics.disaggregation.labels(metrics.service, path, reason).inc()
        return path
