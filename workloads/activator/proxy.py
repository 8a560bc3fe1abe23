"""Forwarding one request to a model-server pod and streaming its answer back, unbuffered.

aiohttp as the client, as the graph router uses (one pooled session for the activator's life). Bodies pass as
bytes: no decompression (`auto_decompress=False`), so Content-Encoding and Content-Length stay true; the answer is
relayed chunk by chunk as it arrives (an SSE stream's events reach the client one by one).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import aiohttp
from yarl import URL

# RFC 9110 7.6.1: connection-specific headers are not forwarded; Host is the pod's; Content-Length is recomputed
# by the client for the request.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def end_to_end(headers: Iterable[tuple[str, str]], *, drop: Iterable[str] = ()) -> list[tuple[str, str]]:
    """Headers without the hop-by-hop ones, those the Connection header names, and `drop` (names any case)."""
    pairs = [(k, v) for k, v in headers]
    named = {t.strip().lower() for k, v in pairs if k.lower() == "connection" for t in v.split(",")}
    skip = HOP_BY_HOP | named | {d.lower() for d in drop}
    return [(k, v) for k, v in pairs if k.lower() not in skip]


def raw_response_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """A replica's end-to-end response headers as Starlette sends them, as the replica sent them: repeated ones
    (Set-Cookie) included."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in end_to_end(headers)]


def request_headers(headers: Iterable[tuple[str, str]], client: str | None) -> list[tuple[str, str]]:
    """What the model server gets: the caller's end-to-end headers plus X-Forwarded-For."""
    out = end_to_end(headers, drop=("host", "content-length"))
    if client:
        previous = [v for k, v in out if k.lower() == "x-forwarded-for"]
        out = [(k, v) for k, v in out if k.lower() != "x-forwarded-for"]
        out.append(("x-forwarded-for", ", ".join([*previous, client])))
    return out


class Unreachable(Exception):
    """No connection to the endpoint: nothing was sent, so the request can go to another replica."""


class Upstream:
    """One pooled aiohttp session to the service's pods (opened on the loop that serves requests)."""

    KEEPALIVE_S = 4.0  # below uvicorn's 5 s: a connection the server is closing is not reused

    def __init__(self, connect_timeout_s: float = 5.0, max_connections: int = 1000) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self._max_connections = max_connections

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections, keepalive_timeout=self.KEEPALIVE_S
                ),
                timeout=self._timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            )
        return self._session

    async def send(
        self, endpoint: str, method: str, path_qs: str, headers: list[tuple[str, str]], body: bytes
    ) -> aiohttp.ClientResponse:
        """The response, headers read, body not yet. Raises Unreachable when no connection could be made."""
        url = URL(f"http://{endpoint}{path_qs}", encoded=True)  # the caller's path, byte for byte
        try:
            return await self._client().request(
                method, url, headers=headers, data=body if body else None, allow_redirects=False
            )
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
            raise Unreachable(f"{endpoint}: {exc}") from exc

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


async def relay(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The body as it arrives; the connection goes back to the pool when it was read to the end."""
    try:
        async for chunk in response.content.iter_any():
            yield chunk
    finally:
        response.release()
