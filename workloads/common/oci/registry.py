"""The registry's HTTP API (OCI distribution spec v1.1), as a runtime and a push tool use it: manifests by tag or
digest, blobs by digest (HEAD first: a blob the registry holds is never sent again), monolithic uploads
(POST, then PUT with the digest), manifests PUT last. Token auth (a 401 naming a Bearer realm) is answered with
the credentials given, or anonymously; basic auth directly.

Every answer that is not the expected one is a RegistryError naming the registry, the request and the cause
(not found, refused credentials, unreachable), which is what a condition or the CLI prints.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urljoin

import httpx

from .image import MANIFEST_TYPES
from .reference import ImageReference, registry_base_url

CHUNK = 4 << 20
_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')


class RegistryError(Exception):
    """`kind`: NotFound, Unauthorized (credentials missing or refused), Unavailable, Invalid (an answer this client
    cannot use)."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.status = kind, message, status


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str


@dataclass(frozen=True)
class Manifest:
    media_type: str
    digest: str
    data: bytes

    def json(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.data)
        return document


class Registry:
    """One registry (host[:port]); `plain_http` None: plain HTTP on loopback only (reference.registry_base_url)."""

    def __init__(
        self, registry: str, credentials: Credentials | None = None, *, plain_http: bool | None = None,
        timeout: float = 60.0, transport: httpx.BaseTransport | None = None,
    ) -> None:  # fmt: skip
        base = registry_base_url(registry)
        if plain_http is not None:
            base = ("http://" if plain_http else "https://") + registry
        self.registry, self.base, self.credentials = registry, base, credentials
        self.http = httpx.Client(timeout=timeout, transport=transport, follow_redirects=True)
        self._tokens: dict[str, str] = {}  # scope -> the Authorization header that answered its challenge
        self.bytes_sent = 0
        self.bytes_received = 0

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *_: object) -> None:
        self.http.close()

    @classmethod
    def for_image(cls, image: ImageReference, credentials: Credentials | None = None, **kw: Any) -> Registry:
        return cls(image.registry, credentials, **kw)

    # -------------------------------------------------------------------------------------------- HTTP and auth

    def _request(self, method: str, url: str, repository: str, push: bool = False, **kw: Any) -> httpx.Response:
        scope = f"repository:{repository}:{'pull,push' if push else 'pull'}"
        url = url if url.startswith("http") else urljoin(self.base + "/", url.lstrip("/"))
        headers = dict(kw.pop("headers", None) or {})
        for attempt in range(2):
            try:
                response = self.http.request(method, url, headers={**headers, **self._auth(scope)}, **kw)
            except httpx.HTTPError as error:
                raise RegistryError("Unavailable", f"registry {self.registry} cannot be reached: {error}") from error
            if response.status_code != 401 or attempt == 1 or not self._authorize(response, scope):
                return response
        raise AssertionError("unreachable")

    def _auth(self, scope: str) -> dict[str, str]:
        token = self._tokens.get(scope)
        return {"Authorization": token} if token else {}

    def _authorize(self, response: httpx.Response, scope: str) -> bool:
        """After a 401: what to send next time for this scope (a token asked of the realm the registry names, or
        the basic credentials); False when there is nothing to try."""
        challenge = response.headers.get("WWW-Authenticate", "")
        if challenge.lower().startswith("bearer"):
            self._tokens[scope] = "Bearer " + self._token(challenge, scope)
            return True
        if self.credentials is None:
            return False
        basic = httpx.BasicAuth(self.credentials.username, self.credentials.password)
        request = basic.sync_auth_flow(httpx.Request("GET", self.base)).__next__()
        self._tokens[scope] = request.headers["Authorization"]
        return True

    def _token(self, challenge: str, scope: str) -> str:
        fields = dict(_CHALLENGE.findall(challenge))
        if "realm" not in fields:
            raise RegistryError("Invalid", f"registry {self.registry} asked for a token without a realm")
        params = {"service": fields.get("service", ""), "scope": fields.get("scope", scope)}
        auth = (self.credentials.username, self.credentials.password) if self.credentials else None
        try:
            answer = self.http.get(fields["realm"], params=params, auth=auth)
        except httpx.HTTPError as error:
            unreachable = f"token service of {self.registry} cannot be reached: {error}"
            raise RegistryError("Unavailable", unreachable) from error
        if answer.status_code in (401, 403):
            raise self._refused(answer)
        if answer.status_code != 200:
            raise RegistryError("Invalid", f"token service of {self.registry} answered {answer.status_code}")
        body = answer.json()
        return str(body.get("token") or body.get("access_token") or "")

    def _refused(self, response: httpx.Response) -> RegistryError:
        who = "the credentials given" if self.credentials else "anonymous access"
        return RegistryError(
            "Unauthorized", f"registry {self.registry} refused {who} ({response.status_code})", response.status_code
        )

    def _check(self, response: httpx.Response, what: str, *expected: int) -> httpx.Response:
        if response.status_code in expected:
            return response
        if response.status_code in (401, 403):
            raise self._refused(response)
        if response.status_code == 404:
            raise RegistryError("NotFound", f"{what} not found in registry {self.registry}", 404)
        detail = response.text[:300].strip()
        raise RegistryError(
            "Unavailable" if response.status_code >= 500 else "Invalid",
            f"registry {self.registry}: {what}: {response.status_code} {detail}", response.status_code,
        )  # fmt: skip

    # -------------------------------------------------------------------------------------------- manifests

    def manifest(self, repository: str, reference: str) -> Manifest:
        """GET a manifest or index by tag or digest, checked against the digest it is addressed by."""
        pinned = reference.startswith("sha256:")
        what = f"manifest {repository}@{reference}" if pinned else f"manifest {repository}:{reference}"
        response = self._check(self._request(
            "GET", f"/v2/{repository}/manifests/{reference}", repository, headers={"Accept": ", ".join(MANIFEST_TYPES)}
        ), what, 200)  # fmt: skip
        digest = "sha256:" + hashlib.sha256(response.content).hexdigest()
        if pinned and digest != reference:
            raise RegistryError("Invalid", f"registry {self.registry} served {what} with digest {digest}")
        self.bytes_received += len(response.content)
        media_type = response.headers.get("Content-Type", "").split(";")[0].strip()
        return Manifest(media_type, digest, response.content)

    def put_manifest(self, repository: str, reference: str, media_type: str, data: bytes) -> str:
        response = self._check(self._request(
            "PUT", f"/v2/{repository}/manifests/{reference}", repository, push=True,
            content=data, headers={"Content-Type": media_type},
        ), f"manifest upload to {repository}:{reference}", 201)  # fmt: skip
        self.bytes_sent += len(data)
        return response.headers.get("Docker-Content-Digest") or "sha256:" + hashlib.sha256(data).hexdigest()

    # -------------------------------------------------------------------------------------------- blobs

    def has_blob(self, repository: str, digest: str) -> bool:
        response = self._request("HEAD", f"/v2/{repository}/blobs/{digest}", repository, push=True)
        if response.status_code == 404:
            return False
        self._check(response, f"blob {digest}", 200)
        return True

    def upload_blob(self, repository: str, digest: str, content: bytes | Path) -> None:
        """POST an upload session, then PUT the whole blob with its digest (the registry checks it)."""
        started = self._check(self._request(
            "POST", f"/v2/{repository}/blobs/uploads/", repository, push=True
        ), f"upload of {digest} to {repository}", 202)  # fmt: skip
        location = started.headers.get("Location")
        if not location:
            raise RegistryError("Invalid", f"registry {self.registry} started an upload without a Location")
        url = urljoin(self.base + "/", location)
        url += ("&" if "?" in url else "?") + f"digest={digest}"
        size = len(content) if isinstance(content, bytes) else content.stat().st_size
        body: bytes | Iterator[bytes] = content if isinstance(content, bytes) else _chunks(content)
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        self._check(self._request("PUT", url, repository, push=True, content=body, headers=headers),
                    f"upload of {digest} to {repository}", 201)  # fmt: skip
        self.bytes_sent += size

    def blob(self, repository: str, digest: str, out: IO[bytes]) -> int:
        """Stream a blob into `out`, checking its digest; its size."""
        url = urljoin(self.base + "/", f"v2/{repository}/blobs/{digest}")
        scope = f"repository:{repository}:pull"
        sha, size = hashlib.sha256(), 0
        try:
            for attempt in range(2):
                with self.http.stream("GET", url, headers=self._auth(scope)) as response:
                    if response.status_code == 401 and attempt == 0 and self._authorize(response, scope):
                        continue
                    self._check(response, f"blob {repository}@{digest}", 200)
                    for chunk in response.iter_bytes(CHUNK):
                        sha.update(chunk)
                        size += len(chunk)
                        out.write(chunk)
                    break
        except httpx.HTTPError as error:
            raise RegistryError("Unavailable", f"registry {self.registry} cannot be reached: {error}") from error
        if "sha256:" + sha.hexdigest() != digest:
            raise RegistryError("Invalid", f"blob {repository}@{digest} arrived with another digest")
        self.bytes_received += size
        return size


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk
