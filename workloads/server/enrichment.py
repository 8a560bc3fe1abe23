"""Feature enrichment: each infer request gets its entity's online features from Feast before the model sees it.

Configured by ``ServerConfig.features`` (the operator resolves an InferenceService's ``spec.features`` against
its FeatureView). For one request:

1. Entity keys: each name in ``entityKeys`` (a join key of the view, e.g. ``driver_id``) is read from the input
   tensor of that name (shape ``[N]`` or ``[N, 1]``: one entity per row, so a request may carry several), or else
   from ``parameters[<key>]`` (a scalar, or a list for several rows). Every key must give the same N.
2. One ``POST {url}/get-online-features`` to Feast's feature server (its real HTTP API) over a pooled client,
   with ``timeoutMs`` per call; only a failure to connect is retried (``connectRetries``), since a request that
   reached the server may be in progress there.
3. Each feature becomes one more input tensor, named ``<featureView>__<feature>`` (Feast's own full feature
   name), e.g. ``driver_stats__conv_rate``: shape ``[N]`` (``[N, L]`` for ``Array(...)`` dtypes), datatype from
   the feature's Feast dtype (Float32 FP32, Float64 FP64, Int32 INT32, Int64 and UnixTimestamp INT64, Bool BOOL,
   String and Bytes BYTES), row i for entity i. The request's own inputs stay as they were.

Never a silent empty feature: a key missing from the request, or an entity whose features Feast does not have
(status NOT_FOUND, NULL_VALUE or OUTSIDE_MAX_AGE for any feature) is refused with 400 naming the entity; a
feature server that cannot be reached, times out or answers with an error is 503. A request input that already
uses a feature tensor's name is refused (400) rather than silently replaced.

Metrics (on the server's registry): ``loom_server_enrichment_duration_seconds{model,feature_view}`` (every call,
success or not) and ``loom_server_enrichment_errors_total{model,feature_view,reason}`` with reason one of
``missing_entity_key``, ``entity_not_found``, ``unavailable``, ``bad_response``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import httpx
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from .config import EnrichmentConfig
from .errors import InvalidInputError, UnavailableError
from .metrics import LATENCY_BUCKETS
from .model import InferRequest, Tensor

log = logging.getLogger(__name__)

SEPARATOR = "__"
PRESENT = "PRESENT"
# Feast dtype (scalar part) -> (OIP datatype, numpy dtype).
DATATYPES: dict[str, tuple[str, Any]] = {
    "Int32": ("INT32", np.int32),
    "Int64": ("INT64", np.int64),
    "UnixTimestamp": ("INT64", np.int64),
    "Float32": ("FP32", np.float32),
    "Float64": ("FP64", np.float64),
    "Bool": ("BOOL", np.bool_),
    "String": ("BYTES", object),
    "Bytes": ("BYTES", object),
}
# Error reasons (the errors counter's label).
MISSING_KEY = "missing_entity_key"
NOT_FOUND = "entity_not_found"
UNAVAILABLE = "unavailable"


class EntityKeyMissingError(InvalidInputError):
    """The request names no value for an entity key (400)."""


class EntityNotFoundError(InvalidInputError):
    """Feast has no online value for an entity (unknown, expired or null) (400, the entity named)."""


class FeatureServerError(UnavailableError):
    """The feature server cannot be reached, timed out or answered with an error (503); ``reason`` is the
    errors counter's label: unavailable (no answer) or bad_response (an error status or an unusable document)."""

    def __init__(self, message: str, reason: str = "bad_response"):
        super().__init__(message)
        self.reason = reason


def tensor_name(view: str, feature: str) -> str:
    """The input tensor a feature is added as: Feast's full feature name, ``<view>__<feature>``."""
    return f"{view}{SEPARATOR}{feature}"


# ------------------------------------------------------------------------------------------- request side


def _key_value(value: Any) -> Any:
    """A key as JSON for Feast: Python ints for integer keys, text for strings and bytes."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


def entity_rows(config: EnrichmentConfig, request: InferRequest) -> dict[str, list[Any]]:
    """Each entity key's values, one per row (see the module docstring for where they are read)."""
    rows: dict[str, list[Any]] = {}
    for key in config.entity_keys:
        tensor = request.inputs.get(key)
        if tensor is not None:
            data = np.asarray(tensor.data)
            if data.ndim == 2 and data.shape[1] == 1:
                data = data[:, 0]
            if data.ndim != 1:
                raise EntityKeyMissingError(
                    f"entity key input {key!r} must have shape [N] or [N, 1] (one entity per row), "
                    f"got {list(data.shape)}"
                )
            values = [_key_value(v) for v in data.tolist()]
        elif key in request.parameters:
            raw = request.parameters[key]
            values = [_key_value(v) for v in (raw if isinstance(raw, list) else [raw])]
        else:
            raise EntityKeyMissingError(
                f"request has no entity key {key!r} for feature view {config.feature_view}: send an input tensor "
                f"or a parameter named {key!r}"
            )
        if not values:
            raise EntityKeyMissingError(f"entity key {key!r} has no values")
        if any(v is None for v in values):
            raise EntityKeyMissingError(f"entity key {key!r} has a null value")
        rows[key] = values
    counts = {len(v) for v in rows.values()}
    if len(counts) != 1:
        raise EntityKeyMissingError(
            "entity keys have different row counts: " + ", ".join(f"{k}={len(v)}" for k, v in rows.items())
        )
    for name in (tensor_name(config.feature_view, f.name) for f in config.features):
        if name in request.inputs:
            raise InvalidInputError(f"input {name!r} is the name of a feature the server adds; rename it")
    return rows


def feast_request(config: EnrichmentConfig, rows: Mapping[str, list[Any]]) -> dict[str, Any]:
    """The body of Feast's ``POST /get-online-features``."""
    return {
        "features": [f"{config.feature_view}:{f.name}" for f in config.features],
        "entities": {key: list(values) for key, values in rows.items()},
    }


# ------------------------------------------------------------------------------------------- response side


def _describe(rows: Mapping[str, list[Any]], index: int) -> str:
    return ", ".join(f"{key}={values[index]!r}" for key, values in rows.items())


def _array(dtype: str, values: list[Any], name: str) -> np.ndarray[Any, Any]:
    scalar = dtype[len("Array(") : -1] if dtype.startswith("Array(") else dtype
    np_type = DATATYPES[scalar][1]
    if np_type is object:
        def text(v: Any) -> bytes:
            return v if isinstance(v, bytes) else str(v).encode()

        if scalar != dtype:
            lengths = {len(v) for v in values}
            if len(lengths) != 1:
                raise FeatureServerError(
                    f"feature {name}: arrays of different lengths {sorted(lengths)} cannot form one tensor"
                )
            return np.array([[text(x) for x in v] for v in values], dtype=object).reshape(len(values), -1)
        return np.array([text(v) for v in values], dtype=object)
    try:
        array = np.asarray(values, dtype=np_type)
    except (TypeError, ValueError) as exc:
        raise FeatureServerError(f"feature {name}: values do not form a {dtype} tensor: {exc}") from exc
    if scalar != dtype and array.ndim != 2:
        raise FeatureServerError(f"feature {name}: arrays of different lengths cannot form one tensor")
    return array


def feature_tensors(config: EnrichmentConfig, rows: Mapping[str, list[Any]], body: Any) -> list[Tensor]:
    """The feature tensors from Feast's answer; EntityNotFoundError when any entity lacks any feature."""
    count = len(next(iter(rows.values())))
    try:
        names = list(body["metadata"]["feature_names"])
        results = list(body["results"])
        columns = {name: results[i] for i, name in enumerate(names)}
    except (KeyError, TypeError, IndexError) as exc:
        raise FeatureServerError(f"feature server answered an unexpected document: {str(body)[:200]}") from exc
    missing: dict[int, list[str]] = {}
    found: dict[str, list[Any]] = {}
    for feature in config.features:
        column = columns.get(feature.name)
        if column is None:
            raise FeatureServerError(f"feature server did not return {config.feature_view}:{feature.name}")
        values, statuses = list(column.get("values") or []), list(column.get("statuses") or [])
        if len(values) != count or len(statuses) != count:
            raise FeatureServerError(
                f"feature server returned {len(values)} values for {count} entities ({feature.name})"
            )
        for i, status in enumerate(statuses):
            if status != PRESENT or values[i] is None:
                missing.setdefault(i, []).append(f"{feature.name} {status}")
        found[feature.name] = values
    if missing:
        unknown = [i for i, gaps in missing.items() if all(g.endswith(" NOT_FOUND") for g in gaps)]
        parts = []
        for i, gaps in sorted(missing.items()):
            what = "unknown entity" if i in unknown and len(gaps) == len(config.features) else "no value for"
            parts.append(f"{_describe(rows, i)}: {what} ({', '.join(gaps)})")
        raise EntityNotFoundError(
            f"feature view {config.feature_view} has no online features for " + "; ".join(parts)
        )
    tensors = []
    for feature in config.features:
        name = tensor_name(config.feature_view, feature.name)
        scalar = feature.dtype[len("Array(") : -1] if feature.dtype.startswith("Array(") else feature.dtype
        tensors.append(Tensor(name, DATATYPES[scalar][0], _array(feature.dtype, found[feature.name], name)))
    return tensors


# ------------------------------------------------------------------------------------------- the enricher


class EnrichmentMetrics:
    """Enrichment latency and errors, registered next to the server's other metrics."""

    def __init__(self, model: str, view: str, registry: CollectorRegistry):
        self.model, self.view = model, view
        self.latency = Histogram(
            "loom_server_enrichment_duration_seconds",
            "Time to fetch a request's online features from the feature server (every call, success or not).",
            ["model", "feature_view"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.errors = Counter(
            "loom_server_enrichment_errors",
            "Requests refused or failed by feature enrichment, by reason.",
            ["model", "feature_view", "reason"],
            registry=registry,
        )

    def failed(self, reason: str) -> None:
        self.errors.labels(self.model, self.view, reason).inc()


class Enricher:
    """Adds a request's online features to it (one feature server call per request, pooled connections)."""

    def __init__(
        self,
        config: EnrichmentConfig,
        model: str,
        registry: CollectorRegistry,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.config = config
        self.url = f"{config.url.rstrip('/')}/get-online-features"
        self.metrics = EnrichmentMetrics(model, config.feature_view, registry)
        # trust_env=False: a proxy from the pod's environment must not sit between the server and Feast.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout_ms / 1000.0),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            transport=transport,
            trust_env=False,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _post(self, body: dict[str, Any]) -> httpx.Response:
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(httpx.ConnectError),
            stop=stop_after_attempt(1 + self.config.connect_retries),
            wait=wait_exponential(multiplier=0.05, max=0.5),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._client.post(self.url, json=body)
        raise AssertionError("unreachable")  # AsyncRetrying either returns above or re-raises

    async def fetch(self, rows: Mapping[str, list[Any]]) -> list[Tensor]:
        """The feature tensors for these entity rows (typed errors as the module docstring says)."""
        view = self.config.feature_view
        started = time.perf_counter()
        try:
            try:
                response = await self._post(feast_request(self.config, rows))
            except httpx.TimeoutException as exc:
                raise FeatureServerError(
                    f"feature server {self.config.url} did not answer within {self.config.timeout_ms:g} ms "
                    f"({type(exc).__name__})",
                    UNAVAILABLE,
                ) from exc
            except httpx.HTTPError as exc:
                raise FeatureServerError(
                    f"feature server {self.config.url} unreachable: {type(exc).__name__}: {exc}", UNAVAILABLE
                ) from exc
            if response.status_code != 200:
                raise FeatureServerError(
                    f"feature server {self.config.url} answered {response.status_code} for view {view}: "
                    f"{response.text[:300]}"
                )
            try:
                body = response.json()
            except ValueError as exc:
                raise FeatureServerError(f"feature server {self.config.url} answered no JSON: {exc}") from exc
            return feature_tensors(self.config, rows, body)
        except EntityNotFoundError:
            self.metrics.failed(NOT_FOUND)
            raise
        except FeatureServerError as exc:
            self.metrics.failed(exc.reason)
            log.warning("enrichment failed: %s", exc)
            raise
        finally:
            self.metrics.latency.labels(self.metrics.model, view).observe(time.perf_counter() - started)

    async def enrich(self, request: InferRequest) -> InferRequest:
        """The request with its features added as input tensors."""
        try:
            rows = entity_rows(self.config, request)
        except EntityKeyMissingError:
            self.metrics.failed(MISSING_KEY)
            raise
        tensors = await self.fetch(rows)
        return InferRequest(
            inputs={**request.inputs, **{t.name: t for t in tensors}},
            parameters=request.parameters,
            requested_outputs=request.requested_outputs,
            id=request.id,
        )
