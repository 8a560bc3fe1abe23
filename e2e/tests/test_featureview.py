"""FeatureView on the real local stack: the operator (a subprocess) renders the Feast project's ConfigMap, the apply
Job, the materialize CronJob and the feature server; the real Job and CronJob controllers run them and the node
agent runs Feast for real, reading the example data from the real S3 server. The host queries Feast's HTTP API
through the Service's proxy, as a client in the cluster would.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loom.devstack.agent.proxies import service_address
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.devstack.cluster.paths import AGENT_STATE_DIR
from loom.devstack.servers import S3Endpoint
from loom.e2e.pytest_operator import OperatorProcess
from loom.e2e.pytest_services import apply_s3_secret
from loom.e2e.readme_install import feature_lookup
from loom.operator.kinds.featureview.config import cronjob_name, delete_job_name
from loom.workloads.features import example_data

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "featureview-driver-stats.yaml"
TIMEOUT_S = 360.0
FEATURES = ["conv_rate", "acc_rate", "avg_daily_trips"]


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype), {})


def wait_view(
    cluster: Cluster, op: OperatorProcess, namespace: str, name: str, what: str, check: Any
) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        obj = get(cluster, namespace, "featureview", name)
        return obj if obj is not None and check(obj) else None

    try:
        return dict(wait_until(done, timeout=TIMEOUT_S, what=f"{name}: {what}", interval=1))
    except TimeoutError as error:
        obj = get(cluster, namespace, "featureview", name)
        pods = cluster.kubectl("get", "jobs,pods", "-n", namespace, "-o", "wide", check=False).stdout
        raise AssertionError(
            f"{error}\nstatus: {json.dumps((obj or {}).get('status'), indent=1)}\n{pods}\n{op.log_tail()}"
        ) from None


def example_view(s3: S3Endpoint, bucket: str) -> dict[str, Any]:
    """The shipped example, pointed at this session's S3 server and bucket (the only edits)."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["source"]["path"] = f"s3://{bucket}/driver_stats.parquet"
    doc["spec"]["source"]["endpoint"] = s3.url
    return dict(doc)


def newest_values(end: datetime) -> dict[int, dict[str, float]]:
    """What the online store must hold per driver: the newest event, the later-created row of a tie."""
    frame = example_data.driver_stats(end)
    frame = frame.sort_values(["driver_id", "event_timestamp", "created"])
    newest = frame.groupby("driver_id").tail(1)
    return {int(row.driver_id): {f: float(getattr(row, f)) for f in FEATURES} for row in newest.itertuples()}


def online_features(url: str, drivers: list[int]) -> dict[int, dict[str, Any]]:
    body = {"features": [f"driver_stats:{f}" for f in FEATURES], "entities": {"driver_id": drivers}}
    with httpx.Client(trust_env=False, timeout=30) as client:
        response = client.post(f"{url}/get-online-features", json=body)
    assert response.status_code == 200, response.text
    doc = response.json()
    names = doc["metadata"]["feature_names"]
    columns = {name: result["values"] for name, result in zip(names, doc["results"], strict=True)}
    statuses = {name: result["statuses"] for name, result in zip(names, doc["results"], strict=True)}
    return {
        driver: {f: (columns[f][i], statuses[f][i]) for f in FEATURES} for i, driver in enumerate(columns["driver_id"])
    }


@pytest.mark.core
def test_example_feature_view_is_registered_materialized_and_served(
    cluster: Cluster,
    loom_operator: OperatorProcess,
    operator_namespace: str,
    s3: S3Endpoint,
    bucket: str,
    tmp_path: Path,
) -> None:
    ns = operator_namespace
    apply_s3_secret(cluster, ns, s3)
    end = example_data.parse_end("now")  # fresh data: the online store serves only what is within the 24h ttl
    files = example_data.write(tmp_path, end)
    s3.client().upload_file(str(files["driverStats"]), bucket, "driver_stats.parquet")
    view = example_view(s3, bucket)
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(view))

    registered = wait_view(
        cluster,
        loom_operator,
        ns,
        "driver-stats",
        "Registered",
        lambda o: condition(o, "Registered").get("status") == "True",
    )
    status = registered["status"]
    assert (status["project"], status["onlineStore"]) == ("rides", "sqlite")
    assert status["registry"] == "/var/lib/loom/features/registry.db"
    assert status["url"] == f"http://rides-features.{ns}.svc"
    assert status["nextMaterialization"].endswith(":00:00Z")
    config = get(cluster, ns, "configmap", "rides-features")
    assert config is not None and "AWS_SECRET" not in json.dumps(config["data"])

    # Materialize now, by annotation.
    cluster.kubectl("annotate", "featureview", "driver-stats", "-n", ns, f"loom.dev/materialize-now={time.time_ns()}")
    materialized = wait_view(
        cluster,
        loom_operator,
        ns,
        "driver-stats",
        "materialized",
        lambda o: condition(o, "Materialized").get("status") in ("True", "False"),
    )
    last = materialized["status"]["lastMaterialization"]
    assert condition(materialized, "Materialized")["status"] == "True", last
    assert last["outcome"] == "Succeeded" and last["rowsWritten"] > 0
    assert last["end"] and last["start"] < last["end"]

    ready = wait_view(
        cluster, loom_operator, ns, "driver-stats", "Ready", lambda o: condition(o, "Ready").get("status") == "True"
    )
    assert ready["status"]["phase"] == "Ready"

    url = f"http://{service_address('rides-features', ns, AGENT_STATE_DIR)}:80"
    expected = newest_values(end)
    got = online_features(url, [1001, 1002, 9999])
    for driver in (1001, 1002):
        for feature in FEATURES:
            value, state = got[driver][feature]
            assert state == "PRESENT", (driver, feature, state)
            assert value == pytest.approx(expected[driver][feature], rel=1e-5), (driver, feature)
    assert got[1001]["conv_rate"][0] == pytest.approx(0.999, rel=1e-5)  # the later-created row won
    assert {state for _, state in got[9999].values()} == {"NOT_FOUND"}

    # The names to look features up by are in status (Feast has `_` where the Kubernetes name has `-`), and the
    # README's lookup works as written: its request, to status.url (this namespace's), from this machine through
    # the Service's local address (the README's curl runs in a pod; the request is the same).
    assert ready["status"]["feastView"] == "driver_stats"
    assert ready["status"]["featureRefs"] == [f"driver_stats:{f}" for f in FEATURES]
    readme_url, body = feature_lookup()
    assert readme_url.replace(".default.svc", f".{ns}.svc") == f"{ready['status']['url']}/get-online-features"
    with httpx.Client(trust_env=False, timeout=30) as client:
        answer = client.post(f"{url}/get-online-features", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 200, answer.text
    looked_up = answer.json()
    asked = json.loads(body)
    names = looked_up["metadata"]["feature_names"]  # the join key, then the features (in Feast's order)
    assert names[0] == "driver_id" and sorted(names[1:]) == sorted(r.split(":")[1] for r in asked["features"])
    for result in looked_up["results"][1:]:
        assert result["statuses"] == ["PRESENT"] * len(asked["entities"]["driver_id"]), looked_up
    # The Kubernetes name instead answers 404, as the README's Troubleshooting table says.
    with httpx.Client(trust_env=False, timeout=30) as client:
        kubernetes_name = {"features": ["driver-stats:conv_rate"], "entities": {"driver_id": [1001]}}
        wrong = client.post(f"{url}/get-online-features", json=kubernetes_name)
    assert wrong.status_code == 404, wrong.text

    # A view Feast refuses (its timestamp column is not in the source) becomes a condition with Feast's message;
    # the project's first view keeps being served.
    bad = example_view(s3, bucket)
    bad["metadata"]["name"] = "driver-stats-bad"
    bad["spec"]["source"]["timestampField"] = "no_such_column"
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(bad))
    refused = wait_view(
        cluster,
        loom_operator,
        ns,
        "driver-stats-bad",
        "refused",
        lambda o: condition(o, "Registered").get("status") == "False",
    )
    registered_cond = condition(refused, "Registered")
    assert registered_cond["reason"] == "InvalidSource", registered_cond
    assert "no_such_column" in registered_cond["message"]
    assert refused["status"]["phase"] == "Failed"
    assert condition(get(cluster, ns, "featureview", "driver-stats") or {}, "Ready")["status"] == "True"

    # Deleting a registered view removes it from the registry: no finalizer, a delete Job run by the pass of a
    # view that remains in the project; the feature server stops knowing the view.
    extra = example_view(s3, bucket)
    extra["metadata"]["name"] = "driver-trips"
    extra["spec"]["features"] = [{"name": "avg_daily_trips", "dtype": "Int64"}]
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(extra))
    wait_view(
        cluster,
        loom_operator,
        ns,
        "driver-trips",
        "Registered",
        lambda o: condition(o, "Registered").get("status") == "True",
    )
    trips = {"features": ["driver_trips:avg_daily_trips"], "entities": {"driver_id": [1001]}}
    with httpx.Client(trust_env=False, timeout=30) as client:
        wait_until(
            lambda: client.post(f"{url}/get-online-features", json=trips).status_code == 200,
            timeout=TIMEOUT_S,
            what="the server knows driver_trips",
            interval=2,
        )
        cluster.kubectl("delete", "featureview", "driver-trips", "-n", ns, "--wait=true")
        job_name = delete_job_name("rides", "driver-trips")

        def deleted() -> dict[str, Any] | None:
            pods = cluster.kubectl(
                "get", "pods", "-n", ns, "-l", f"batch.kubernetes.io/job-name={job_name}", "-o", "json"
            )
            for pod in json.loads(pods.stdout)["items"]:
                for status in pod["status"].get("containerStatuses") or []:
                    terminated = (status.get("state") or {}).get("terminated") or {}
                    if terminated.get("exitCode") == 0:
                        return dict(json.loads(terminated["message"]))
            return None

        try:
            result = wait_until(deleted, timeout=TIMEOUT_S, what=f"delete Job {job_name} succeeded", interval=2)
        except TimeoutError as error:
            jobs = cluster.kubectl("get", "jobs,pods", "-n", ns, "-o", "wide", check=False).stdout
            raise AssertionError(f"{error}\n{jobs}\n{loom_operator.log_tail()}") from None
        assert (result["outcome"], result["deleted"]) == ("Deleted", ["driver_trips"])
        wait_until(
            lambda: (
                "driver-trips"
                not in (get(cluster, ns, "configmap", "rides-features") or {})
                .get("metadata", {})
                .get("annotations", {})
                .get("loom.dev/registered-views", "")
            ),
            timeout=60,
            what="the project forgets driver-trips",
            interval=1,
        )
        wait_until(
            lambda: client.post(f"{url}/get-online-features", json=trips).status_code != 200,
            timeout=60,
            what="the server no longer serves driver_trips",
            interval=2,
        )
        assert online_features(url, [1001])[1001]["conv_rate"][1] == "PRESENT"  # the other view is untouched


def test_the_cronjob_controller_materializes_on_schedule(
    cluster: Cluster,
    loom_operator: OperatorProcess,
    operator_namespace: str,
    s3: S3Endpoint,
    bucket: str,
    tmp_path: Path,
) -> None:
    ns = operator_namespace
    apply_s3_secret(cluster, ns, s3)
    files = example_data.write(tmp_path, example_data.parse_end("now"))
    s3.client().upload_file(str(files["driverStats"]), bucket, "driver_stats.parquet")
    view = example_view(s3, bucket)
    view["metadata"]["name"] = "trips-cron"
    view["spec"]["project"] = "rides-cron"
    view["spec"]["materialization"] = {"schedule": "* * * * *"}
    view["spec"]["server"] = {"replicas": 0}
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(view))
    prefix = cronjob_name("trips-cron") + "-"

    def scheduled_run_succeeded(obj: dict[str, Any]) -> bool:
        last = (obj.get("status") or {}).get("lastMaterialization") or {}
        return last.get("outcome") == "Succeeded" and str(last.get("job", "")).startswith(prefix)

    done = wait_view(cluster, loom_operator, ns, "trips-cron", "a scheduled run succeeded", scheduled_run_succeeded)
    status = done["status"]
    runs = [
        job["metadata"]["name"]
        for job in json.loads(cluster.kubectl("get", "jobs", "-n", ns, "-o", "json").stdout)["items"]
        if job["metadata"]["name"].startswith(prefix)
    ]
    assert runs
    # The first scheduled run writes the data set's rows; an incremental run a minute later has nothing new to
    # write, and a loaded machine can let the status show that second run first.
    if len(runs) == 1:
        assert status["lastMaterialization"]["rowsWritten"] > 0
    assert status["nextMaterialization"].endswith(":00Z")
    assert condition(done, "Materialized")["status"] == "True"
    assert condition(done, "ServerReady")["reason"] == "ScaledToZero"
    assert condition(done, "Ready")["status"] == "False"
    cron = get(cluster, ns, "cronjob", cronjob_name("trips-cron"))
    assert cron is not None and cron["spec"]["concurrencyPolicy"] == "Forbid"
