"""Pytest plugin (registered with `-p loom.e2e.pytest_services`): session-wide real S3 and MLflow servers.

Servers start lazily, only for sessions whose tests ask for the fixtures, and stop at session end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loom.e2e.services import MLflowEndpoint, S3Endpoint, mlflow_server, s3_server


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    with s3_server(tmp_path_factory.mktemp("s3-server")) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def mlflow(tmp_path_factory: pytest.TempPathFactory, s3: S3Endpoint) -> Iterator[MLflowEndpoint]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server"), s3=s3) as endpoint:
        yield endpoint
