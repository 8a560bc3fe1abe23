"""The retrieval step's network edge: the question embedded on an OpenAI ``/v1/embeddings`` endpoint and the
nearest documents asked of a Feast feature server's ``POST /search`` (api_version 2). Implements
:class:`retrieval.Retriever`.

One aiohttp session for both, pooled and kept for the router's life (opened on first use, on the serving loop).
The embedding service gets the caller's forwarded headers (its API key, trace context), as every step does; the
feature server gets only the trace context: it is not the caller's service and needs no credential of theirs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from .retrieval import RetrievalUnavailable
from .retrieval_config import VectorStoreConfig
from .upstream import child_traceparent

_TRACE = ("traceparent", "tracestate")


def _message(body: bytes) -> str:
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body[:300].decode("utf-8", "replace").strip() or "(empty body)"
    error = doc.get("error", doc.get("detail")) if isinstance(doc, dict) else None
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(error if error is not None else doc)[:300]


def embedding_of(answer: Any) -> list[float]:
    """data[0].embedding of an OpenAI embeddings answer."""
    try:
        vector = answer["data"][0]["embedding"]
    except (KeyError, IndexError, TypeError) as exc:
        raise RetrievalUnavailable("the embedding service answered no data[0].embedding") from exc
    if not isinstance(vector, list) or not vector or not all(isinstance(v, (int, float)) for v in vector):
        raise RetrievalUnavailable("the embedding service answered an embedding that is not a list of numbers")
    return [float(v) for v in vector]


class HttpRetriever:
    def __init__(self, max_connections: int = 100):
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=4.0),
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
            )
        return self._session

    async def _post(self, what: str, url: str, doc: Any, headers: Mapping[str, str]) -> Any:
        sent = {**headers, "content-type": "application/json"}
        sent["traceparent"] = child_traceparent(headers.get("traceparent"))
        try:
            async with self._client().post(url, data=json.dumps(doc).encode(), headers=sent) as response:
                body = await response.read()
                status = response.status
        except aiohttp.ClientError as exc:
            raise RetrievalUnavailable(f"cannot reach the {what} at {url}: {type(exc).__name__}: {exc}") from exc
        if status != 200:
            raise RetrievalUnavailable(f"the {what} at {url} answered {status}: {_message(body)}")
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RetrievalUnavailable(f"the {what} at {url} answered no JSON") from exc

    async def embed(self, store: VectorStoreConfig, text: str, headers: Mapping[str, str]) -> list[float]:
        doc = {"model": store.embedding.model_name, "input": text}
        answer = await self._post("embedding service", store.embedding.url, doc, headers)
        return embedding_of(answer)

    async def search(
        self, store: VectorStoreConfig, vector: list[float], top_k: int, headers: Mapping[str, str]
    ) -> Any:
        doc = {"features": store.feature_refs, "query": vector, "top_k": top_k, "api_version": 2}
        trace = {name: headers[name] for name in _TRACE if name in headers}
        return await self._post("vector store", store.search_url, doc, trace)

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
