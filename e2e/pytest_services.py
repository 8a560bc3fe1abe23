"""Pytest plugin (registered with `-p loom.e2e.pytest_services`): session-wide real S3 and MLflow servers.

Servers start lazily, only for sessions whose tests ask for the fixtures, and stop at session end.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from loom.devstack.servers import MLflowEndpoint, S3Endpoint, mlflow_server, s3_server


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    with s3_server(tmp_path_factory.mktemp("s3-server")) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def mlflow(tmp_path_factory: pytest.TempPathFactory, s3: S3Endpoint) -> Iterator[MLflowEndpoint]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server"), s3=s3) as endpoint:
        yield endpoint


@pytest.fixture
def bucket(s3: S3Endpoint) -> str:
    """A fresh bucket in the session's S3 server."""
    name = f"b-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=name)
    return name


def apply_s3_secret(cluster: Any, namespace: str, s3: S3Endpoint, name: str = "s3-credentials") -> None:
    """The Secret pods read the S3 credentials from (by reference: Loom never reads it)."""
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name},
        "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key},
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(secret))
