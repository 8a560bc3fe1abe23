"""Fixtures for end-to-end tests on the local real control plane (see loom.devstack.cluster).

Fixtures (names are stable; other e2e modules rely on them):

- ``cluster`` (session): a ``loom.devstack.cluster.Cluster`` for the running stack, with
  ``kubeconfig`` (admin, Path), ``server`` (https URL), ``bin_dir`` (kubectl, helm, kwok, etcd,
  kube-*), ``ca_cert``, ``env`` (os.environ plus KUBECONFIG, PATH and PYTHONSAFEPATH, for
  subprocesses), ``kubectl(*args, stdin=None, check=True)`` and ``api_client()``.
  The stack is built if needed and started once per session; a stack that is already up (say from
  ``loom dev up``) is reused and left running. A stack this session started is stopped at the end,
  unless another test session still uses it (the last one out stops it). The shape of a stack it
  starts comes from LOOM_STACK_NODES (4), LOOM_STACK_GPUS_PER_NODE (8), LOOM_STACK_AGENT_GPUS (0).
- ``kube_api`` (session): an admin ``kubernetes.client.ApiClient``.
- ``namespace`` (function): a fresh namespace whose ``default`` ServiceAccount exists (so pods can
  be created at once); deleted after the test.
- ``prometheus`` (module): a Prometheus of the module's own scraping the stack (loom.e2e.exporter.local_prometheus).
- ``autoscaling_operator`` (module): an operator reading that Prometheus (the builtin autoscaler's source), its
  intervals at their defaults.

Pods land on the simulated kwok nodes (``type=kwok``, 8 ``nvidia.com/gpu`` each by default) only
with ``loom.devstack.cluster.nodes.KWOK_TOLERATION``; ``loom.devstack.cluster.handle.wait_until`` polls for
state that controllers converge to. Every test in this folder is marked ``e2e``.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from loom.devstack.cluster import Cluster, StackConfig, current, down, up
from loom.devstack.cluster.build import build, is_built
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.lifecycle import join_session, leave_session
from loom.devstack.cluster.paths import AGENT_STATE_DIR, LOG_DIR
from loom.devstack.prometheus import PrometheusEndpoint
from loom.e2e.exporter import local_prometheus
from loom.e2e.failure_evidence import gather
from loom.e2e.pytest_operator import OperatorProcess, apply_crds, operator_process
from loom.e2e.secrets_scan import finish_session, record_namespace

HERE = Path(__file__).resolve().parent
_STARTED = pytest.StashKey[float]()


def _in_this_tier(item: pytest.Item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _in_this_tier(item):
            item.add_marker(pytest.mark.e2e)
    # The secrets scan looks at what every other test left behind: it runs last (a stable sort keeps the rest).
    items.sort(key=lambda item: Path(str(item.path)).name == "test_secrets_scan.py")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed e2e test's report carries the evidence that names the cause (loom.e2e.failure_evidence): the
    objects, pods, events and logs of the namespaces it touched, whatever in it failed (a wait, an assertion)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not report.failed or call.when == "teardown" or not _in_this_tier(item):
        return
    fixtures = getattr(item, "funcargs", {})
    cluster = fixtures.get("cluster")
    if cluster is None:
        return
    started = item.stash.get(_STARTED, time.time())
    report.sections.append(("evidence (e2e/failure_evidence.py)", gather(cluster, fixtures, started)))


def _progress(line: str) -> None:
    # A cold build takes many minutes: show progress even while pytest captures output.
    print(f"[loom stack] {line}", file=sys.__stderr__, flush=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the stack before the first test starts, so no test's timeout includes a cold build."""
    if session.config.option.collectonly or not any(_in_this_tier(item) for item in session.items):
        return
    if not is_built():
        build(progress=_progress)


def _up_with_one_retry() -> Cluster:
    """Start the stack; once more if a component died while starting (seen here: kube-apiserver lost at start
    right after a `down` of the same state folder). The retry is another `up`, never a `down` first: `up` starts
    whatever is not running and checks all of it, and another test session (an xdist worker) may already be
    using the components that did start; a `down` here once stopped the API server under the other worker."""
    try:
        return up(StackConfig.from_env(), progress=_progress, started_by="pytest")
    except RuntimeError as error:
        _progress(f"stack start failed ({error}); starting what is not running once more")
        return up(StackConfig.from_env(), progress=_progress, started_by="pytest")


@pytest.fixture(scope="session", autouse=True)
def _secrets_scan_of_this_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """When the session ends: its operators' logs and the stack's, scanned with the secrets its namespaces held
    (the final test, e2e/tests/test_secrets_scan.py, may run in a later session: see loom.e2e.secrets_scan)."""
    yield
    finish_session([tmp_path_factory.getbasetemp(), LOG_DIR, AGENT_STATE_DIR / "logs"])


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    join_session()
    try:
        running = current()
        yield running if running is not None else _up_with_one_retry()
    finally:
        if leave_session():
            down(progress=_progress)


@pytest.fixture(scope="session")
def kube_api(cluster: Cluster) -> Iterator[client.ApiClient]:
    with cluster.api_client() as api:
        yield api


@pytest.fixture
def namespace(kube_api: client.ApiClient) -> Iterator[str]:
    core = client.CoreV1Api(kube_api)
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"loom.dev/e2e": "true"})))

    def default_service_account() -> bool:
        try:
            core.read_namespaced_service_account("default", name)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return True

    # The service-account controller creates it asynchronously; pods are refused until it exists.
    wait_until(default_service_account, timeout=30, what=f"ServiceAccount default in {name}")
    yield name
    record_namespace(kube_api, name, AGENT_STATE_DIR / "logs")  # its events and pod logs go with it
    try:
        core.delete_namespace(name)
    except ApiException as err:
        if err.status != 404:
            raise


@pytest.fixture(scope="module")
def prometheus(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusEndpoint]:
    with local_prometheus(cluster, tmp_path_factory.mktemp("prometheus")) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def autoscaling_operator(
    cluster: Cluster, prometheus: PrometheusEndpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    apply_crds(cluster)
    log = tmp_path_factory.mktemp("loom-operator") / "loom_operator.log"
    # The autoscaler's interval stays at its default: the reaction measured is the one users get.
    with operator_process(cluster, log, {"LOOM_PROMETHEUS_URL": prometheus.url}) as handle:
        yield handle
    print(f"[loom operator] log: {log}", file=sys.__stderr__)
