"""The operator installed with `helm install charts/loom` and running in the cluster (a pod on the node agent),
acting under the chart's ServiceAccount and RBAC instead of the admin kubeconfig.

The module installs one release watching one namespace (a RoleBinding there: the least-privilege path) and
runs, in order: the install itself, a TrainingJob on kwok nodes, an InferenceService served on the node agent,
the endpoint defaults (an upgrade that adds defaults.mlflow.trackingUri to the release's values), the RBAC
proof (a rule removed by hand makes the matching scenario fail with a clear log line; `helm upgrade` repairs it
and the job proceeds), and last the uninstall, which must leave nothing the operator created.
A second, short-lived release checks the namespace-pattern mode (cluster-wide binding); a third is installed,
upgraded and uninstalled by the very commands README.md's "Install on a real cluster" shows.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.nodes import kwok_placement
from loom.devstack.cluster.pki import AGENT_NODE_NAME
from loom.devstack.images import WORKLOADS
from loom.devstack.servers import MLflowEndpoint, S3Endpoint
from loom.e2e.helm_operator import (
    CHART,
    TEST_VALUES,
    InClusterOperator,
    helm,
    operator_in_cluster,
    wait_default_service_account,
)
from loom.e2e.helm_operator import loom_operator_in_cluster as loom_operator_in_cluster  # the fixture
from loom.e2e.pytest_operator import crd_names
from loom.e2e.pytest_services import apply_s3_secret
from loom.e2e.readme_install import adapt, environment, readme_commands
from loom.e2e.stack_images import CHART_VALUES, build_stand_ins
from loom.e2e.tests.test_image_registry import manifest as registry_manifest
from loom.e2e.tests.test_inferenceservice import manifest, upload_placeholder_model, wait_rolled_out

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]

# Where the images are: the chart names none (tests/unit/test_chart.py; e2e/tests/test_image_registry.py).
REGISTRY = ("--set", "image.registry=registry.example/loom")


def kubectl_json(cluster: Cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def exists(cluster: Cluster, *args: str) -> bool:
    return cluster.kubectl("get", *args, check=False).returncode == 0


def training_job(name: str) -> dict[str, Any]:
    """Two workers on kwok's simulated GPU nodes: reconciled for real, never run (the cheapest job)."""
    return {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "engine": "fsdp",
            "entrypoint": {"module": "loom.workloads.trainer.examples.chargpt:task"},
            "maxSteps": 100,
            "workers": {
                "replicas": 2,
                "gpusPerWorker": 1,
                **kwok_placement(),
            },
        },
    }


def job_phase(cluster: Cluster, namespace: str, name: str) -> str | None:
    result = cluster.kubectl("get", "trainingjob", name, "-n", namespace, "-o", "json", check=False)
    return ((json.loads(result.stdout).get("status") or {}).get("phase")) if result.returncode == 0 else None


def wait_running(cluster: Cluster, op: InClusterOperator, namespace: str, name: str) -> None:
    try:
        wait_until(lambda: job_phase(cluster, namespace, name) == "Running", timeout=90, what=f"{name} Running")
    except TimeoutError as error:
        raise AssertionError(f"{error}; phase {job_phase(cluster, namespace, name)}\n{op.log_tail()}") from None


def worker_pods(cluster: Cluster, namespace: str, job: str) -> list[dict[str, Any]]:
    return list(kubectl_json(cluster, "get", "pods", "-n", namespace, "-l", f"loom.dev/trainingjob={job}")["items"])


def can_i(cluster: Cluster, op: InClusterOperator, *args: str) -> bool:
    result = cluster.kubectl("auth", "can-i", *args, f"--as={op.user}", check=False)
    return result.stdout.strip() == "yes"


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_chart_lints_and_renders_what_the_api_server_accepts(cluster: Cluster, tmp_path: Path) -> None:
    lint = helm(cluster, "lint", "--strict", str(CHART), *REGISTRY)
    assert "0 chart(s) failed" in lint.stdout
    # values.schema.json refuses what the operator would refuse at start-up.
    bad = helm(cluster, "template", "x", str(CHART), *REGISTRY, "--set", "logLevel=LOUD", check=False)
    assert bad.returncode != 0 and "logLevel" in bad.stderr
    # The default values (plus where the images are: the chart has no default) and a maximal values file render
    # objects the real API server accepts.
    maximal = {
        "watchNamespaces": ["default", "kube-public"],
        "logLevel": "DEBUG",
        "settings": {"resync_interval_s": 60, "training_poll_s": 2},
        "extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
        "image": {"repository": "registry.example/loom/operator", "tag": "1.2.3", "pullPolicy": "Always"},
        "workloadImages": {
            "trainer": {"repository": "registry.example/loom/trainer", "tag": "1.2.3"},
            "server": {"repository": "registry.example/loom/server", "tag": "1.2.3"},
            "router": {"repository": "registry.example/loom/server", "tag": "1.2.3"},
            "features": {"repository": "registry.example/loom/features", "tag": "1.2.3"},
            "vllm": {"repository": "registry.example/loom/vllm", "tag": "1.2.3"},
        },
        "podAnnotations": {"team": "ml"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "nodeSelector": {"kubernetes.io/os": "linux"},
    }
    (tmp_path / "max.yaml").write_text(yaml.safe_dump(maximal))
    for extra in (list(REGISTRY), ["-f", str(tmp_path / "max.yaml")]):
        rendered = helm(cluster, "template", "dry", str(CHART), "-n", "default", "--include-crds", *extra).stdout
        cluster.kubectl("apply", "--dry-run=server", "--server-side", "-f", "-", stdin=rendered)
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    env = {e["name"]: e.get("value") for e in next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"][
        "spec"]["containers"][0]["env"]}  # fmt: skip
    assert env["LOOM_NAMESPACES"] == "default,kube-public" and env["LOOM_RESYNC_INTERVAL_S"] == "60"
    assert env["LOOM_SERVER_IMAGE"] == "registry.example/loom/server:1.2.3" and env["HTTPS_PROXY"]
    assert env["LOOM_VLLM_IMAGE"] == "registry.example/loom/vllm:1.2.3"
    # Exact namespaces: a RoleBinding in each, no cluster-wide grant of the namespaced rules.
    bindings = {(d["kind"], d["metadata"].get("namespace"), d["roleRef"]["name"]) for d in docs if "roleRef" in d}
    assert bindings == {
        ("ClusterRoleBinding", None, "dry-operator-cluster"),
        ("RoleBinding", "default", "dry-operator"),
        ("RoleBinding", "kube-public", "dry-operator"),
    }


def test_operator_runs_in_cluster_under_the_charts_service_account(
    cluster: Cluster, loom_operator_in_cluster: InClusterOperator
) -> None:
    op = loom_operator_in_cluster
    watched = op.watch[0]
    pod = op.pod()
    assert pod is not None
    assert pod["spec"]["nodeName"] == AGENT_NODE_NAME and pod["spec"]["serviceAccountName"] == op.name
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["loom", "operator"]
    # Recorded, not enforced, by the node agent (it has no cgroups and runs every process as root).
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    # The CRDs came with the chart (or were there already, identical: tests/unit/test_chart.py).
    cluster.wait_crds_established(crd_names(CHART / "crds"), timeout_s=30)
    # In-cluster login, and Kopf has every permission it asks for (it warns when a list/watch is refused).
    logs = op.logs()
    assert "Activity 'login_via_client' succeeded" in logs and "loom operator started" in logs, logs
    assert "Not enough permissions" not in logs and "Forbidden" not in logs, logs
    # Least privilege, as the API server decides it for the operator's identity.
    assert can_i(cluster, op, "patch", "pods", "-n", watched)
    assert can_i(cluster, op, "watch", "nodes")
    assert not can_i(cluster, op, "create", "pods", "-n", "default")  # only the watched namespace
    for verb in ("get", "list", "watch"):
        assert not can_i(cluster, op, verb, "secrets", "-n", watched)
    assert not can_i(cluster, op, "update", "trainingjobs.loom.dev", "-n", watched)  # patch only
    assert not can_i(cluster, op, "create", "nodes")


def test_trainingjob_reconciles_under_the_chart_service_account(
    cluster: Cluster, loom_operator_in_cluster: InClusterOperator
) -> None:
    op, ns = loom_operator_in_cluster, loom_operator_in_cluster.watch[0]
    cluster.kubectl("apply", "--server-side", "-n", ns, "-f", "-", stdin=yaml.safe_dump(training_job("gpt")))
    wait_running(cluster, op, ns, "gpt")
    job = kubectl_json(cluster, "get", "trainingjob", "gpt", "-n", ns)
    assert job["status"]["workers"] == {"desired": 2, "ready": 2}
    for kind, name in (("service", "gpt-workers"), ("configmap", "gpt-trainer")):
        child = kubectl_json(cluster, "get", kind, name, "-n", ns)
        assert child["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    pods = worker_pods(cluster, ns, "gpt")
    assert sorted(p["metadata"]["name"] for p in pods) == ["gpt-worker-0", "gpt-worker-1"]
    assert all(p["spec"]["nodeName"].startswith("kwok-node-") for p in pods)


def test_inferenceservice_reconciles_under_the_chart_service_account(
    cluster: Cluster, loom_operator_in_cluster: InClusterOperator, s3: S3Endpoint, bucket: str
) -> None:
    op, ns = loom_operator_in_cluster, loom_operator_in_cluster.watch[0]
    apply_s3_secret(cluster, ns, s3)
    body = manifest("echo", upload_placeholder_model(s3, bucket, "echo/v1"), s3, handler="noop", replicas=1)
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(body))
    isvc = wait_rolled_out(cluster, op, ns, "echo")  # type: ignore[arg-type]  # duck-typed: log_tail()
    assert isvc["status"]["phase"] == "Ready" and isvc["status"]["readyReplicas"] == 1
    deployment = kubectl_json(cluster, "get", "deployment", "echo", "-n", ns)
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    # The operator passed the S3 credentials by reference; its identity cannot read them.
    assert s3.secret_key not in json.dumps(deployment)

    # Its Events were posted under the chart's identity too.
    def reasons() -> set[str] | None:
        events = kubectl_json(
            cluster, "get", "events", "-n", ns, "--field-selector", "involvedObject.kind=InferenceService"
        )["items"]
        found = {e["reason"] for e in events}
        return found if "RolledOut" in found else None

    wait_until(reasons, timeout=30, what="the operator's events on the InferenceService")


def test_endpoint_defaults_come_from_chart_values(
    cluster: Cluster, loom_operator_in_cluster: InClusterOperator, mlflow: MLflowEndpoint
) -> None:
    """A TrainingJob tracking to MLflow without trackingUri waits, Ready=False EndpointNotConfigured naming the
    chart value, while the release has none; `helm upgrade` with defaults.mlflow.trackingUri in its values gives
    the operator one, and the job's run, rendered config and status.endpointDefaults use it."""
    op, ns = loom_operator_in_cluster, loom_operator_in_cluster.watch[0]
    body = training_job("tracked")
    body["spec"]["tracking"] = {"mlflow": {"experiment": "chart-defaults"}}
    cluster.kubectl("apply", "--server-side", "-n", ns, "-f", "-", stdin=yaml.safe_dump(body))

    def not_configured() -> str | None:
        status = kubectl_json(cluster, "get", "trainingjob", "tracked", "-n", ns).get("status") or {}
        ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), None)
        return str(ready["message"]) if ready and ready["reason"] == "EndpointNotConfigured" else None

    message = wait_until(not_configured, timeout=60, what="tracked: Ready=False EndpointNotConfigured")
    assert "spec.tracking.mlflow.trackingUri" in message and "defaults.mlflow.trackingUri" in message
    assert worker_pods(cluster, ns, "tracked") == []

    # Into the release's values file, so later upgrades of this module keep it (and keep the operator pod).
    values = yaml.safe_load(op.values_file.read_text())
    op.values_file.write_text(yaml.safe_dump({**values, "defaults": {"mlflow": {"trackingUri": mlflow.url}}}))
    op.upgrade()

    def configured() -> dict[str, Any] | None:
        # The replaced operator pod created the run, then rendered the config the workers read.
        config = cluster.kubectl("get", "configmap", "tracked-trainer", "-n", ns, "-o", "json", check=False)
        return dict(json.loads(config.stdout)["data"]) if config.returncode == 0 else None

    try:
        data = wait_until(configured, timeout=90, what="tracked: the trainer config with the default")
    except TimeoutError as error:
        raise AssertionError(f"{error}\n{op.log_tail()}") from None
    assert json.loads(next(iter(data.values())))["tracking"]["mlflow"]["trackingUri"] == mlflow.url
    job = kubectl_json(cluster, "get", "trainingjob", "tracked", "-n", ns)
    assert job["status"]["endpointDefaults"] == {"spec.tracking.mlflow.trackingUri": mlflow.url}
    assert job["status"]["mlflow"]["url"].startswith(mlflow.url.rstrip("/"))
    assert "trackingUri" not in job["spec"]["tracking"]["mlflow"]  # the operator never writes to spec


def test_a_removed_rule_fails_clearly_and_helm_upgrade_repairs_it(
    cluster: Cluster, loom_operator_in_cluster: InClusterOperator
) -> None:
    op, ns = loom_operator_in_cluster, loom_operator_in_cluster.watch[0]
    role = kubectl_json(cluster, "get", "clusterrole", op.name)
    for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
        role["metadata"].pop(key, None)
    kept = [rule for rule in role["rules"] if rule["resources"] != ["services"]]
    assert len(kept) == len(role["rules"]) - 1
    # A hand edit (or an older chart) drops the rule TrainingJob needs for its rendezvous Service.
    cluster.kubectl("replace", "-f", "-", stdin=json.dumps({**role, "rules": kept}))
    assert not can_i(cluster, op, "patch", "services", "-n", ns)

    cluster.kubectl("apply", "--server-side", "-n", ns, "-f", "-", stdin=yaml.safe_dump(training_job("norbac")))
    # The log says what was refused, to whom, where; the pass is retried, never hangs the operator.
    refused = re.compile(
        r'services \\?"norbac-workers\\?" is forbidden: User \\?"' + re.escape(op.user)
        + r'\\?" cannot patch resource \\?"services\\?" in API group \\?"\\?" in the namespace \\?"' + ns
    )  # fmt: skip
    try:
        wait_until(lambda: refused.search(op.logs()), timeout=60, what="the refusal in the operator's log")
    except TimeoutError as error:
        raise AssertionError(f"{error}\n{op.log_tail()}") from None
    assert worker_pods(cluster, ns, "norbac") == [] and job_phase(cluster, ns, "norbac") != "Running"

    # `helm upgrade` puts the chart's rules back (forcing the field ownership the hand edit took).
    op.upgrade("--force-conflicts")
    assert can_i(cluster, op, "patch", "services", "-n", ns)
    wait_running(cluster, op, ns, "norbac")


def test_a_namespace_pattern_is_watched_cluster_wide_including_namespaces_created_later(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A Kopf pattern cannot be followed by RoleBindings: the namespaced rules are bound cluster-wide, and
    Kopf's namespace watch (granted by the cluster role) picks up a namespace created after the start."""
    prefix = f"lg{uuid.uuid4().hex[:6]}"
    with operator_in_cluster(cluster, [f"{prefix}-*"], workdir=tmp_path) as op:
        assert exists(cluster, "clusterrolebinding", op.name)
        ns = f"{op.namespace_prefix}-late"
        cluster.kubectl("create", "namespace", ns)
        try:
            wait_default_service_account(cluster, ns)
            cluster.kubectl("apply", "--server-side", "-n", ns, "-f", "-", stdin=yaml.safe_dump(training_job("g")))
            wait_running(cluster, op, ns, "g")
            cluster.kubectl("delete", "loom", "--all", "-n", ns, "--timeout=60s")
        finally:
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    assert not exists(cluster, "clusterrolebinding", op.name)


def test_the_readmes_install_upgrade_and_uninstall_commands_work(cluster: Cluster, tmp_path: Path) -> None:
    """README.md's "Install on a real cluster" commands, run as shown and in order (e2e/readme_install.py; the
    values they set are checked against the chart by tests/unit/test_readme_install.py, which also pins their
    order). Only the release, its namespace and the watched namespaces are renamed; the push goes to the local
    stack's registry with small stand-ins of the four images (the real build takes half an hour: `make images`),
    and the install gets one more values file: the node the pod must run on (the only node that runs pods here)
    and a small CPU request. The operator's images are then the pushed ones, pinned by digest, found in the
    registry by that digest (the node agent records the image and runs this checkout's code)."""
    release = f"loom{uuid.uuid4().hex[:6]}"
    namespace, watch = f"{release}-system", [f"{release}-a", f"{release}-b"]
    assert cluster.registry, "this stack runs no image registry (started before it existed): `loom dev up` again"
    registry = f"{cluster.registry}/{release}"
    images = tmp_path / "images"
    images.mkdir()
    build_stand_ins(images)
    for ns in watch:
        cluster.kubectl("create", "namespace", ns)
    stack_values = tmp_path / "stack.yaml"
    # Not the test installs' image values: the images are the ones the README's push names.
    stack_values.write_text(yaml.safe_dump({k: v for k, v in TEST_VALUES.items() if k not in CHART_VALUES}))
    op = InClusterOperator(cluster, release, namespace, tuple(watch), stack_values)

    def run(argv: list[str]) -> None:
        adapted = adapt(
            argv,
            release=release,
            namespace=namespace,
            watch=watch,
            extra_values=stack_values,
            registry=registry,
            images_state=images,
        )
        env, command = environment(adapted)
        if command[0] == "make":
            done = subprocess.run(command, env={**cluster.env, **env}, capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, done.stdout + done.stderr
        elif command[0] == "helm":
            helm(cluster, *command[1:])
        else:
            cluster.kubectl(*command[1:], timeout=150)

    def deployment() -> dict[str, Any]:
        return dict(kubectl_json(cluster, "get", "deployment", op.name, "-n", namespace))

    push, install, rollout, crds, upgrade, uninstall = readme_commands()
    try:
        run(push)
        run(install)
        container = deployment()["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["LOOM_NAMESPACES"] == ",".join(watch) and env["LOOM_PROMETHEUS_URL"], env
        # The images are the pushed ones, pinned by digest, and the registry has each under that digest.
        images_named = [container["image"]] + [env[f"LOOM_{key.upper()}_IMAGE"] for key in WORKLOADS]
        for reference, name in zip(images_named, ["operator", *WORKLOADS.values()], strict=True):
            assert reference.startswith(f"{registry}/{name}@sha256:"), reference
            assert registry_manifest(cluster.registry, reference)[0] == 200, reference
        run(rollout)  # returns once the operator pod is Ready
        op.wait_ready(timeout=10)
        pod = op.pod()
        assert pod is not None and pod["spec"]["containers"][0]["image"] == container["image"]
        run(crds)  # the same CRDs again: accepted, nothing to change
        generation = deployment()["metadata"]["generation"]
        run(upgrade)  # --reuse-values: the install's values kept, nothing rolled
        kept = yaml.safe_load(helm(cluster, "get", "values", release, "-n", namespace, "-o", "yaml").stdout)
        assert kept["watchNamespaces"] == watch and kept["prometheus"]["url"], kept
        assert kept["image"]["registry"] == registry and kept["image"]["digest"], kept
        assert deployment()["metadata"]["generation"] == generation
        assert all(exists(cluster, "rolebinding", op.name, "-n", ns) for ns in watch)
        run(uninstall)  # removes what the chart installed; the CRDs and the namespaces stay
        assert not exists(cluster, "deployment", op.name, "-n", namespace)
        assert not any(exists(cluster, "rolebinding", op.name, "-n", ns) for ns in watch)
        assert not exists(cluster, "clusterrole", op.name) and exists(cluster, "crd", "trainingjobs.loom.dev")
    finally:
        helm(cluster, "uninstall", release, "-n", namespace, "--ignore-not-found", check=False)
        for ns in (namespace, *watch):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_uninstall_leaves_nothing_the_operator_created(
    cluster: Cluster, loom_operator_in_cluster: InClusterOperator
) -> None:
    """Last in this module: it uninstalls the module's release."""
    op, ns = loom_operator_in_cluster, loom_operator_in_cluster.watch[0]
    cluster.kubectl("apply", "--server-side", "-n", ns, "-f", "-", stdin=yaml.safe_dump(training_job("left")))
    wait_running(cluster, op, ns, "left")
    # Across every scenario of this module, the only refusal was the one the RBAC proof caused.
    refusals = [line for line in op.logs(tail=-1).splitlines() if "is forbidden:" in line]
    assert refusals and all("norbac-workers" in line for line in refusals), refusals
    op.uninstall()

    # Everything the chart installed is gone (the CRDs stay: Helm never deletes a chart's crds/).
    assert not exists(cluster, "deployment", op.name, "-n", op.namespace)
    assert not exists(cluster, "serviceaccount", op.name, "-n", op.namespace)
    assert not exists(cluster, "service", f"{op.name}-metrics", "-n", op.namespace)
    assert not exists(cluster, "rolebinding", op.name, "-n", ns)
    for kind in ("clusterrole", "clusterrolebinding"):
        assert not exists(cluster, kind, op.name) and not exists(cluster, kind, f"{op.name}-cluster")
    assert wait_until(lambda: op.pod() is None, timeout=60, what="operator pod gone") is True
    assert exists(cluster, "crd", "trainingjobs.loom.dev")

    # The user's objects outlive the operator, carry no finalizer of it, and take every child with them.
    jobs = kubectl_json(cluster, "get", "trainingjobs", "-n", ns)["items"]
    assert jobs and all(not j["metadata"].get("finalizers") for j in jobs)
    cluster.kubectl("delete", "loom", "--all", "-n", ns, "--timeout=30s")

    def leftovers() -> list[str]:
        out = kubectl_json(cluster, "get", "pods,services,configmaps,deployments", "-n", ns)["items"]
        return [
            f"{o['kind']}/{o['metadata']['name']}"
            for o in out
            if o["metadata"].get("ownerReferences") or o["metadata"]["name"] in ("gpt-workers", "echo")
        ]

    try:
        wait_until(lambda: not leftovers(), timeout=60, what="children garbage-collected")
    except TimeoutError:
        raise AssertionError(f"left behind: {leftovers()}") from None
    # Only what the user made (the S3 Secret) or Kubernetes made (kube-root-ca.crt) is left.
    names = {o["metadata"]["name"] for o in kubectl_json(cluster, "get", "configmaps,secrets", "-n", ns)["items"]}
    assert names <= {"kube-root-ca.crt", "s3-credentials"}, names
