"""The MLflow model registry over its REST API (the operator stays without the mlflow package).

What the kinds need and nothing more: register a version once per training run (found again by its run and the
job's UID tag, so an operator killed between creating a version and recording it in status finds the same one),
read and move aliases, tag a version. Errors become RegistryError, reported in status and retried by later passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from .model import JOB_UID_TAG

TIMEOUT = httpx.Timeout(10.0)


class RegistryError(Exception):
    """MLflow could not be reached or refused the request."""


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: str
    source: str | None = None
    run_id: str | None = None
    tags: Mapping[str, str] | None = None


def _version(raw: Mapping[str, Any]) -> ModelVersion:
    tags = {str(t.get("key")): str(t.get("value")) for t in raw.get("tags") or []}
    return ModelVersion(name=str(raw["name"]), version=str(raw["version"]), source=raw.get("source"),
                        run_id=raw.get("run_id"), tags=tags)  # fmt: skip


class Registry:
    """One tracking server. Use as `async with Registry(uri) as registry:`."""

    def __init__(self, tracking_uri: str, *, client: httpx.AsyncClient | None = None) -> None:
        self.tracking_uri = tracking_uri.rstrip("/")
        self._client = client or httpx.AsyncClient(base_url=self.tracking_uri, timeout=TIMEOUT)

    async def __aenter__(self) -> Registry:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        missing_ok: bool = False,
    ) -> dict[str, Any] | None:
        try:
            response = await self._client.request(method, f"/api/2.0/mlflow/{path}", json=body, params=params)
        except httpx.HTTPError as exc:
            raise RegistryError(f"MLflow at {self.tracking_uri} is unreachable: {exc}") from exc
        if missing_ok and _missing(response):
            return None
        if response.status_code >= 400:
            raise RegistryError(f"MLflow {path}: HTTP {response.status_code}: {response.text[:300]}")
        result: dict[str, Any] = response.json() if response.content else {}
        return result

    async def ensure_model(self, name: str) -> None:
        found = await self._call("GET", "registered-models/get", params={"name": name}, missing_ok=True)
        if found is not None:
            return
        try:
            await self._call("POST", "registered-models/create", body={"name": name})
        except RegistryError:
            # Created concurrently by another job: fine once it exists.
            if await self._call("GET", "registered-models/get", params={"name": name}, missing_ok=True) is None:
                raise

    async def find_run_version(self, name: str, run_id: str, job_uid: str) -> ModelVersion | None:
        """The version this job's run already registered (one job, one version)."""
        result = await self._call(
            "GET",
            "model-versions/search",
            params={"filter": f"name = '{_quote(name)}' and run_id = '{_quote(run_id)}'"},
        )
        for raw in (result or {}).get("model_versions") or []:
            version = _version(raw)
            if (version.tags or {}).get(JOB_UID_TAG) == job_uid:
                return version
        return None

    async def create_version(
        self, name: str, *, source: str, run_id: str, tags: Mapping[str, str], description: str = ""
    ) -> ModelVersion:
        body = {"name": name, "source": source, "run_id": run_id, "description": description,
                "tags": [{"key": k, "value": v} for k, v in tags.items()]}  # fmt: skip
        result = await self._call("POST", "model-versions/create", body=body)
        assert result is not None
        return _version(result["model_version"])

    async def set_alias(self, name: str, alias: str, version: str) -> None:
        await self._call("POST", "registered-models/alias", body={"name": name, "alias": alias, "version": version})

    async def by_alias(self, name: str, alias: str) -> ModelVersion | None:
        """The version an alias names now; None when the model or the alias does not exist."""
        result = await self._call("GET", "registered-models/alias", params={"name": name, "alias": alias},
                                  missing_ok=True)  # fmt: skip
        return None if result is None else _version(result["model_version"])

    async def set_version_tag(self, name: str, version: str, key: str, value: str) -> None:
        await self._call("POST", "model-versions/set-tag",
                         body={"name": name, "version": version, "key": key, "value": value[:5000]})  # fmt: skip

    async def run_metrics(self, run_id: str) -> dict[str, float]:
        """The run's latest metrics (what a version is tagged with)."""
        result = await self._call("GET", "runs/get", params={"run_id": run_id})
        metrics = ((result or {}).get("run") or {}).get("data", {}).get("metrics") or []
        return {str(m["key"]): float(m["value"]) for m in metrics}


def _missing(response: httpx.Response) -> bool:
    """MLflow says "does not exist" as 404 RESOURCE_DOES_NOT_EXIST, and a missing alias as 400 "... not found"."""
    if response.status_code == 404:
        return True
    if response.status_code != 400:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    return body.get("error_code") == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(body.get("message", ""))


def _quote(value: str) -> str:
    return value.replace("'", "\\'")
