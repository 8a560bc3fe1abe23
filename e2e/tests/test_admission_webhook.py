"""The validating webhook (operator/admission) on the real API server, served by the operator installed from the
chart and running in the cluster: the API server reaches it through its Service, with the chart's TLS.

One release (`webhook.missingReferences: Reject`) watches one namespace. In order: a cyclic graph, a graph the
router's structural rules refuse and references to missing objects are refused with the field path and a
readable message; valid objects are admitted; a TrainingJob's frozen fields cannot change once it runs while its
run policy can; with the chart's default `missingReferences: Warn` (an upgrade), a reference to a missing object
is applied and kubectl prints the webhook's warning; last, with the operator scaled to zero, writes to anything
else still succeed and (failurePolicy Ignore, the default) Loom writes too, unchecked.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.e2e.helm_operator import CHART, InClusterOperator, operator_in_cluster, wait_default_service_account
from loom.e2e.tests.test_helm_install import training_job, wait_running

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

API = "loom.dev/v1alpha1"


def graph(name: str, nodes: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "InferenceGraph",
        "metadata": {"name": name},
        "spec": {"nodes": {node: {"routerType": "Sequence", "steps": steps} for node, steps in nodes.items()}},
    }


CYCLIC = graph("loop", {"root": [{"nodeName": "a"}], "a": [{"nodeName": "b"}], "b": [{"nodeName": "root"}]})


def service(name: str, model: dict[str, Any]) -> dict[str, Any]:
    """Zero replicas: reconciled (Deployment, Service, ConfigMap) but nothing runs."""
    return {
        "apiVersion": API,
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {"model": model, "handler": "noop", "replicas": 0},
    }


def apply(cluster: Cluster, namespace: str, body: dict[str, Any], *extra: str) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(
        "apply", "--server-side", "-n", namespace, *extra, "-f", "-", stdin=yaml.safe_dump(body), check=False
    )


def denied(result: subprocess.CompletedProcess[str], webhook: str) -> str:
    """The webhook's message of a refused write (fails if the write went through or failed otherwise)."""
    assert result.returncode != 0, f"admitted: {result.stdout}"
    prefix = f'admission webhook "{webhook}" denied the request: '
    assert prefix in result.stderr, result.stderr
    return result.stderr.split(prefix, 1)[1].strip()


@pytest.fixture(scope="module")
def webhook_operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InClusterOperator]:
    watched = f"lw{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", watched)
    wait_default_service_account(cluster, watched)
    values = {"webhook": {"missingReferences": "Reject"}}
    try:
        with operator_in_cluster(cluster, [watched], values=values, workdir=tmp_path_factory.mktemp("helm")) as op:
            # Ready is not yet serving: the Service proxy picks the pod up on its next sync, and until then
            # failurePolicy Ignore would admit anything. Wait until a cyclic graph is refused (a dry run).
            try:
                wait_until(
                    lambda: apply(cluster, watched, CYCLIC, "--dry-run=server").returncode != 0,
                    timeout=60,
                    what="the webhook refusing a cyclic graph",
                    interval=1,
                )
            except TimeoutError as error:
                raise AssertionError(f"{error}\n{op.log_tail()}") from None
            yield op
    finally:
        cluster.kubectl("delete", "namespace", watched, "--wait=false", check=False)


def test_the_chart_installs_the_webhook_with_tls_scoped_to_loom_kinds(
    cluster: Cluster, webhook_operator: InClusterOperator
) -> None:
    op = webhook_operator
    config = json.loads(
        cluster.kubectl("get", "validatingwebhookconfiguration", f"{op.name}-{op.namespace}", "-o", "json").stdout
    )
    hooks = {h["name"]: h for h in config["webhooks"]}
    assert set(hooks) == {f"{p}.validate.loom.dev" for p in ("inferencegraphs", "inferenceservices", "trainingjobs")}
    for hook in hooks.values():
        assert hook["failurePolicy"] == "Ignore" and hook["timeoutSeconds"] == 5
        assert hook["sideEffects"] == "None" and hook["clientConfig"]["caBundle"]
        assert hook["clientConfig"]["service"]["name"] == f"{op.name}-webhook"
        [rule] = hook["rules"]
        assert rule["apiGroups"] == ["loom.dev"] and rule["operations"] == ["CREATE", "UPDATE"]
        assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == list(op.watch)


def test_a_cyclic_graph_is_rejected_with_the_field_path(cluster: Cluster, webhook_operator: InClusterOperator) -> None:
    ns = webhook_operator.watch[0]
    message = denied(apply(cluster, ns, CYCLIC), "inferencegraphs.validate.loom.dev")
    assert message == (
        "spec.nodes[b].steps[0].nodeName: nodes form a cycle: root -> a -> b -> root; "
        "a step may not call a node that leads back to it"
    )
    bad_condition = graph("cond", {"root": [{"nodeName": "a"}], "a": [{"nodeName": "root", "condition": "request >"}]})
    message = denied(apply(cluster, ns, bad_condition), "inferencegraphs.validate.loom.dev")
    assert "spec.nodes[a].steps[0].nodeName: nodes form a cycle: root -> a -> root" in message
    assert "spec.nodes[a].steps[0].condition: does not compile" in message
    assert cluster.kubectl("get", "inferencegraph", "loop", "-n", ns, check=False).returncode != 0


def test_what_the_controller_would_report_as_an_invalid_graph_is_refused(
    cluster: Cluster, webhook_operator: InClusterOperator
) -> None:
    """Beyond the CRD's CEL: the router's own structural rules (here: Ensemble outputs are keyed by step name)."""
    ns = webhook_operator.watch[0]
    ensemble = graph("fanout", {"root": [{"serviceName": "left"}, {"serviceName": "right", "name": "left"}]})
    ensemble["spec"]["nodes"]["root"]["routerType"] = "Ensemble"
    message = denied(apply(cluster, ns, ensemble, "--dry-run=server"), "inferencegraphs.validate.loom.dev")
    assert (
        "spec.nodes[root].steps: Ensemble step names must be unique (they name the outputs), repeated: left; "
        "set `name` on the steps"
    ) in message


def test_helm_upgrade_keeps_the_certificate_the_api_server_trusts(
    cluster: Cluster, webhook_operator: InClusterOperator
) -> None:
    """A fresh certificate on upgrade would not match the one the running pod loaded (and Ignore would hide it)."""
    op, ns = webhook_operator, webhook_operator.watch[0]

    def tls() -> dict[str, str]:
        secret = json.loads(
            cluster.kubectl("get", "secret", f"{op.name}-webhook-tls", "-n", op.namespace, "-o", "json").stdout
        )
        return dict(secret["data"])

    before = tls()
    op.upgrade()
    assert tls() == before
    denied(apply(cluster, ns, CYCLIC), "inferencegraphs.validate.loom.dev")


def test_a_reference_to_a_missing_object_is_rejected(cluster: Cluster, webhook_operator: InClusterOperator) -> None:
    ns = webhook_operator.watch[0]
    dangling = graph("g", {"root": [{"serviceName": "ghost"}]})
    message = denied(apply(cluster, ns, dangling), "inferencegraphs.validate.loom.dev")
    assert message == f"spec.nodes[root].steps[0].serviceName: InferenceService 'ghost' not found in namespace '{ns}'"
    from_job = service("tuned", {"fromTrainingJob": {"name": "no-such-job"}})
    message = denied(apply(cluster, ns, from_job), "inferenceservices.validate.loom.dev")
    assert message == f"spec.model.fromTrainingJob.name: TrainingJob 'no-such-job' not found in namespace '{ns}'"


def test_valid_objects_are_admitted(cluster: Cluster, webhook_operator: InClusterOperator) -> None:
    ns = webhook_operator.watch[0]
    result = apply(cluster, ns, service("echo", {"uri": "s3://models/echo"}))
    assert result.returncode == 0, result.stderr
    wired = graph(
        "pipeline", {"root": [{"serviceName": "echo"}, {"nodeName": "post"}], "post": [{"serviceName": "echo"}]}
    )
    result = apply(cluster, ns, wired, "--dry-run=server")  # through admission, without starting a router
    assert result.returncode == 0 and "Warning" not in result.stderr, result.stderr


def test_a_running_jobs_frozen_fields_are_refused_and_its_run_policy_is_not(
    cluster: Cluster, webhook_operator: InClusterOperator
) -> None:
    op, ns = webhook_operator, webhook_operator.watch[0]
    job = training_job("frozen")
    assert apply(cluster, ns, job).returncode == 0
    wait_running(cluster, op, ns, "frozen")
    wider = json.dumps({"spec": {"workers": {"replicas": 4}}})
    result = cluster.kubectl("patch", "trainingjob", "frozen", "-n", ns, "--type=merge", "-p", wider, check=False)
    message = denied(result, "trainingjobs.validate.loom.dev")
    assert message.startswith("spec.workers.replicas: cannot change once the job has started (phase Running)")
    patience = json.dumps({"spec": {"runPolicy": {"backoffLimit": 9}}})
    cluster.kubectl("patch", "trainingjob", "frozen", "-n", ns, "--type=merge", "-p", patience)


def test_by_default_a_missing_reference_is_applied_with_the_webhooks_warning(
    cluster: Cluster, webhook_operator: InClusterOperator
) -> None:
    """`webhook.missingReferences: Warn`, the chart's default (GitOps applies in its own order): kubectl applies
    the object and prints the webhook's warning on stderr. The release switches to it with `helm upgrade`."""
    op, ns = webhook_operator, webhook_operator.watch[0]
    assert yaml.safe_load((CHART / "values.yaml").read_text())["webhook"]["missingReferences"] == "Warn"
    op.upgrade("--set", "webhook.missingReferences=Warn")
    cluster.kubectl("rollout", "status", f"deployment/{op.name}", "-n", op.namespace, "--timeout=120s", timeout=130)

    def pods() -> int:
        selector = f"app.kubernetes.io/instance={op.release}"
        return len(json.loads(cluster.kubectl("get", "pods", "-n", op.namespace, "-l", selector, "-o", "json").stdout)[
            "items"])  # fmt: skip

    # The Reject-mode pod gone (terminating pods count), so only the new one can answer.
    wait_until(lambda: pods() == 1, timeout=60, what="the previous operator pod gone", interval=1)
    later = graph("early", {"root": [{"serviceName": "later"}]})
    warning = f"Warning: spec.nodes[root].steps[0].serviceName: InferenceService 'later' not found in namespace '{ns}'"
    # Until the Service proxy routes to the new pod, failurePolicy Ignore admits without a word: a dry run.
    try:
        wait_until(
            lambda: warning in apply(cluster, ns, later, "--dry-run=server").stderr,
            timeout=60,
            what="the webhook's warning",
            interval=1,
        )
    except TimeoutError as error:
        raise AssertionError(f"{error}\n{apply(cluster, ns, later, '--dry-run=server').stderr}") from None
    result = apply(cluster, ns, later)
    assert result.returncode == 0 and warning in result.stderr, result.stderr
    assert "inferencegraph.loom.dev/early serverside-applied" in result.stdout
    assert cluster.kubectl("get", "inferencegraph", "early", "-n", ns, check=False).returncode == 0


def test_with_the_operator_down_unrelated_writes_succeed(cluster: Cluster, webhook_operator: InClusterOperator) -> None:
    """Last in this module: it scales the operator to zero."""
    op, ns = webhook_operator, webhook_operator.watch[0]
    cluster.kubectl("delete", "loom", "--all", "-n", ns, "--timeout=60s")  # while the operator still runs
    cluster.kubectl("scale", f"deployment/{op.name}", "-n", op.namespace, "--replicas=0")
    wait_until(lambda: op.pod() is None, timeout=60, what="the operator pod gone", interval=1)
    # Anything outside loom.dev never reaches the webhook.
    cluster.kubectl("create", "configmap", "unrelated", "-n", ns, "--from-literal=k=v")
    assert json.loads(cluster.kubectl("get", "configmap", "unrelated", "-n", ns, "-o", "json").stdout)["data"] == {
        "k": "v"
    }
    # failurePolicy Ignore: Loom writes go on too, unchecked (the trade-off: the controller reports the cycle).
    result = apply(cluster, ns, CYCLIC)
    assert result.returncode == 0, result.stderr
    cluster.kubectl("delete", "inferencegraph", "loop", "-n", ns)
