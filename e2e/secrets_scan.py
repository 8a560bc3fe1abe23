"""Secrets scan: no S3 key or API key a test used may appear in a log the stack wrote, an event, an object's status
or a ConfigMap (issue 15; Loom passes credentials to pods by reference only).

Pure parts: `secret_values` (the credential values of Secret manifests) and `scan` (which secrets occur in which
texts). Collection: `cluster_texts` (events, ConfigMaps, statuses of Loom's kinds and of pods, Deployments, Jobs)
and `log_texts` (every log file under the given folders). A namespace is gone, with its events and pod logs, once
a test ends: `record_namespace` scans one just before it is deleted (the e2e namespace fixtures call it) and keeps
the findings and the secrets it saw for the session-final test (e2e/tests/test_secrets_scan.py).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Keys whose values are credentials: secret keys, passwords, tokens and API-key files. Access key *ids* are not
# secrets (they travel in every S3 request's Authorization header) and one of ours is also a node's name.
_CREDENTIAL_KEY = re.compile(r"(secret|password|token|keys?$|api[_-]?key|credential)", re.IGNORECASE)
_NOT_SECRET_KEY = re.compile(r"(_ID$|^ca\.crt$|^namespace$)", re.IGNORECASE)
MIN_SECRET_LENGTH = 8  # shorter values would match by accident

# Credentials the local stack and the test servers use (devstack/backing.py, devstack/servers.py).
KNOWN_SECRETS = frozenset({"loom-local-secret", "loom-test-secret"})

LOOM_PLURALS = ("trainingjobs", "inferenceservices", "inferencegraphs", "featureviews")


@dataclass(frozen=True)
class Finding:
    where: str
    hint: str  # the secret's first characters only: a report must not leak it either

    def __str__(self) -> str:
        return f"{self.hint} in {self.where}"


def hint(secret: str) -> str:
    return f"{secret[:3]}...({len(secret)} chars)"


def _decoded(value: str) -> str | None:
    try:
        return base64.b64decode(value, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None


def secret_values(secrets: Iterable[dict[str, Any]]) -> set[str]:
    """Credential values of Secret manifests (`data` base64, `stringData` plain); an API-key file gives one value
    per line ('#' comments skipped). Service-account tokens are left out: the API server itself writes those."""
    found: set[str] = set()
    for secret in secrets:
        if str(secret.get("type", "Opaque")).startswith("kubernetes.io/service-account"):
            continue
        entries = {k: _decoded(v) for k, v in (secret.get("data") or {}).items()}
        entries |= dict((secret.get("stringData") or {}).items())
        for key, value in entries.items():
            if value is None or not _CREDENTIAL_KEY.search(key) or _NOT_SECRET_KEY.search(key):
                continue
            for line in value.splitlines():
                line = line.strip()
                if len(line) >= MIN_SECRET_LENGTH and not line.startswith("#"):
                    found.add(line)
    return found


def scan(texts: Iterable[tuple[str, str]], secrets: Iterable[str]) -> list[Finding]:
    """Every (where, secret) pair where a secret occurs in a text."""
    wanted = sorted({s for s in secrets if len(s) >= MIN_SECRET_LENGTH})
    return [Finding(where, hint(secret)) for where, text in texts for secret in wanted if secret in text]


def log_texts(*roots: Path) -> Iterator[tuple[str, str]]:
    """Every regular file under the folders whose name ends in .log (the stack's and agent's logs, operators')."""
    for root in roots:
        try:
            paths = sorted(root.rglob("*.log"))
        except OSError:
            continue  # the node agent reaped a deleted pod's log folder while we listed it
        for path in paths:
            try:
                if path.is_file():
                    yield str(path), path.read_text(errors="replace")
            except OSError:
                continue  # a pod's log folder removed while walking


def _items(result: Any) -> list[dict[str, Any]]:
    return list(result.get("items", [])) if isinstance(result, dict) else []


def cluster_texts(api: Any, namespace: str | None = None) -> Iterator[tuple[str, str]]:
    """Events, ConfigMaps, and the status of Loom's kinds, pods, Deployments and Jobs (one namespace, or all)."""
    from kubernetes import client

    def listed(path: str) -> list[dict[str, Any]]:
        scope = f"/namespaces/{namespace}" if namespace else ""
        prefix, rest = path.split("|")
        response = api.call_api(
            f"{prefix}{scope}/{rest}",
            "GET",
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
            _return_http_data_only=True,
        )
        return _items(json.loads(response.data))

    sources = {
        "event": "/api/v1|events",
        "configmap": "/api/v1|configmaps",
        "pod": "/api/v1|pods",
        "deployment": "/apis/apps/v1|deployments",
        "job": "/apis/batch/v1|jobs",
        **{plural: f"/apis/loom.dev/v1alpha1|{plural}" for plural in LOOM_PLURALS},
    }
    for kind, path in sources.items():
        try:
            objects = listed(path)
        except client.ApiException as error:
            if error.status == 404:  # the CRDs are not installed (yet)
                continue
            raise
        for obj in objects:
            meta = obj.get("metadata") or {}
            where = f"{kind} {meta.get('namespace')}/{meta.get('name')}"
            if kind == "event":
                text = json.dumps({k: obj.get(k) for k in ("reason", "message", "note", "action")})
            elif kind == "configmap":
                text = json.dumps({"data": obj.get("data"), "binaryData": obj.get("binaryData")})
            else:
                text = json.dumps(obj.get("status"))
            yield where, text


@dataclass
class SessionRecord:
    """What `record_namespace` saw during the session: the secrets of each namespace and any findings."""

    secrets: set[str] = field(default_factory=set)
    findings: list[Finding] = field(default_factory=list)
    namespaces: int = 0
    texts: int = 0
    errors: list[str] = field(default_factory=list)


SESSION = SessionRecord()


def namespace_secrets(api: Any, namespace: str | None = None) -> set[str]:
    from kubernetes import client

    core = client.CoreV1Api(api)
    listed = core.list_namespaced_secret(namespace) if namespace else core.list_secret_for_all_namespaces()
    return secret_values(api.sanitize_for_serialization(s) for s in listed.items)


def record_namespace(api: Any, namespace: str, agent_logs: Path | None = None) -> None:
    """Scan one namespace before it is deleted; never raises (a teardown must not fail on the scan)."""
    try:
        secrets = namespace_secrets(api, namespace) | KNOWN_SECRETS
        SESSION.secrets |= secrets
        texts = list(cluster_texts(api, namespace))
        if agent_logs is not None and agent_logs.exists():
            texts += list(log_texts(*agent_logs.glob(f"{namespace}_*")))
        SESSION.findings += scan(texts, secrets)
        SESSION.namespaces += 1
        SESSION.texts += len(texts)
    except Exception as error:  # recorded, and reported by the final test
        SESSION.errors.append(f"{namespace}: {type(error).__name__}: {error}"[:300])


# Several test sessions can share one stack (`make test` runs the e2e tier in pytest-xdist workers, then the
# `serial` tests): each session, when it ends, scans its own logs with the secrets it saw and leaves its findings
# (hints only, never a secret) here; the final test reads and clears them.
def shared_dir() -> Path:
    from loom.devstack.cluster.paths import STATE_DIR

    return STATE_DIR / "secrets-scan"


def finish_session(own_logs: Iterable[Path]) -> None:
    """At the end of a session that recorded namespaces: scan its own logs (operators' logs under its temp dir,
    the stack's) with every secret it saw, and leave the session's findings for the final test."""
    if not SESSION.namespaces:
        return
    try:
        SESSION.findings += scan(log_texts(*own_logs), SESSION.secrets | KNOWN_SECRETS)
    except Exception as error:
        SESSION.errors.append(f"session logs: {type(error).__name__}: {error}"[:300])
    import os

    folder = shared_dir()
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "findings": [str(f) for f in SESSION.findings],
        "namespaces": SESSION.namespaces,
        "texts": SESSION.texts,
        "errors": SESSION.errors,
    }
    (folder / f"session-{os.getpid()}.json").write_text(json.dumps(record))


def take_shared_records() -> tuple[list[str], int, list[str]]:
    """Findings, namespaces scanned and errors that other (finished) sessions left; the files are removed."""
    findings: list[str] = []
    errors: list[str] = []
    namespaces = 0
    folder = shared_dir()
    for path in sorted(folder.glob("session-*.json")) if folder.exists() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        findings += record.get("findings", [])
        errors += record.get("errors", [])
        namespaces += int(record.get("namespaces", 0))
        path.unlink(missing_ok=True)
    return findings, namespaces, errors
