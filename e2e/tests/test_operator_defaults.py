"""`loom operator` exactly as the README runs it: every setting at its default, next to a model server.

Node-agent pods share the host network (each binds its own 127.x address through the agent's shim), so an
operator endpoint bound to 0.0.0.0:8080 took the model servers' port: every server died with EADDRINUSE
and the InferenceService ended Failed/LoadFailed (issue 17, defect 1). The session's operator fixture sets
free ports, which is why no other test saw it. Only the watched namespaces are set here, so this operator
never reconciles another test session's objects.
"""

from __future__ import annotations

import urllib.request

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.images import IMAGE_SETTINGS
from loom.devstack.servers import S3Endpoint
from loom.e2e.pytest_operator import apply_crds, operator_namespace_for, operator_process
from loom.e2e.pytest_services import apply_s3_secret
from loom.e2e.tests.test_inferenceservice import (
    fresh_client,
    infer_body,
    manifest,
    service_url,
    upload_placeholder_model,
    wait_rolled_out,
)
from loom.operator.settings import OperatorSettings

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def test_operator_with_default_settings_serves_a_model_on_the_local_stack(
    cluster: Cluster, s3: S3Endpoint, bucket: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    defaults = OperatorSettings(**IMAGE_SETTINGS)
    apply_crds(cluster)
    log = tmp_path_factory.mktemp("loom-operator-defaults") / "loom_operator.log"
    with (
        operator_process(cluster, log, defaults=True) as op,
        operator_namespace_for(cluster, op) as ns,
    ):
        assert (op.health_port, op.metrics_port) == (defaults.health_port, defaults.metrics_port)
        apply_s3_secret(cluster, ns, s3)
        uri = upload_placeholder_model(s3, bucket, "defaults/v1")
        body = manifest("echo", uri, s3, handler="noop", replicas=1)
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(body))

        isvc = wait_rolled_out(cluster, op, ns, "echo")
        assert isvc["status"]["phase"] == "Ready"
        with fresh_client() as client:
            response = client.post(f"{service_url(ns, 'echo')}/v2/models/echo/infer", json=infer_body([[1.0, 2.0]]))
        assert response.status_code == 200, response.text
        assert response.json()["model_version"] == "v1"

        # The operator's own endpoints still answer, on loopback.
        for port, path in ((defaults.health_port, "/healthz"), (defaults.metrics_port, "/metrics")):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
                assert reply.status == 200
