"""The multi-pod store combination on the real local stack: examples/featureview-driver-stats-redis.yaml applied
unchanged (registry in S3, the Redis online store, 2 feature server replicas) next to what `loom dev up` provides
(S3 as minio.storage.svc with the example data, a real redis-server as redis.storage.svc:6379, the Secrets).

The operator (a subprocess) registers the view in the S3 registry, a materialization Job writes into Redis, and
each of the two feature server pods, asked directly, answers Feast's HTTP API with the newest values: both read
one shared online store and one shared registry, which is what makes replicas on several nodes possible.
"""

from __future__ import annotations

import io
import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest
import yaml

from loom.devstack import backing
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.e2e.pytest_operator import OperatorProcess
from loom.operator.kinds.featureview.config import HTTP_PORT

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "featureview-driver-stats-redis.yaml"
FEATURES = ["conv_rate", "acc_rate", "avg_daily_trips"]
TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def services(cluster: Cluster) -> backing.BackingServices:
    return backing.ensure(cluster, progress=lambda line: print(f"[features] {line}"))


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype), {})


def wait_view(cluster: Cluster, op: OperatorProcess, ns: str, name: str, what: str, check: Any) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        obj = get(cluster, ns, "featureview", name)
        return obj if obj and check(obj) else None

    try:
        return dict(wait_until(done, timeout=TIMEOUT_S, what=f"{name}: {what}", interval=1))
    except TimeoutError as error:
        status = json.dumps(get(cluster, ns, "featureview", name).get("status"), indent=1)
        pods = cluster.kubectl("get", "jobs,pods", "-n", ns, "-o", "wide", check=False).stdout
        raise AssertionError(f"{error}\nstatus: {status}\n{pods}\n{op.log_tail()}") from None


def redis_keys(address: str) -> int:
    """DBSIZE of the local stack's Redis (its inline protocol: no client library needed)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(b"DBSIZE\r\n")
        reply = conn.recv(64).decode()
    assert reply.startswith(":"), reply
    return int(reply[1:].strip())


def online(url: str, view: str, drivers: list[int]) -> dict[int, dict[str, tuple[Any, str]]]:
    body = {"features": [f"{view}:{f}" for f in FEATURES], "entities": {"driver_id": drivers}}
    response = httpx.post(f"{url}/get-online-features", json=body, timeout=30, trust_env=False)
    assert response.status_code == 200, response.text
    doc = response.json()
    columns = dict(zip(doc["metadata"]["feature_names"], doc["results"], strict=True))
    return {
        driver: {f: (columns[f]["values"][i], columns[f]["statuses"][i]) for f in FEATURES}
        for i, driver in enumerate(columns["driver_id"]["values"])
    }


def jobs(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    return list(json.loads(cluster.kubectl("get", "jobs", "-n", namespace, "-o", "json").stdout)["items"])


def owner_kinds(obj: dict[str, Any]) -> set[str]:
    return {owner["kind"] for owner in obj["metadata"].get("ownerReferences") or []}


def test_two_feature_server_replicas_serve_one_redis_online_store(
    cluster: Cluster, services: backing.BackingServices, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns = operator_namespace
    doc = yaml.safe_load(EXAMPLE.read_text())
    name, store = doc["metadata"]["name"], doc["spec"]["store"]
    for secret in (backing.credentials_secret(ns), backing.redis_secret(ns)):
        cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(secret))
    # As on a fresh `loom dev up`: no registry object that another run of the example left in S3.
    bucket, key = store["registry"]["path"].removeprefix("s3://").split("/", 1)
    s3 = services.s3_client()
    s3.delete_object(Bucket=bucket, Key=key)
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    # Asked for at once: the operator runs it right after the apply Job succeeded (one writer at a time).
    cluster.kubectl("annotate", "featureview", name, "-n", ns, f"loom.dev/materialize-now={time.time_ns()}")

    started = time.monotonic()
    registered = wait_view(
        cluster, loom_operator, ns, name, "Registered", lambda o: condition(o, "Registered").get("status") == "True"
    )
    status = registered["status"]
    assert (status["project"], status["onlineStore"]) == ("rides_redis", "redis")
    assert status["registry"] == store["registry"]["path"]
    assert s3.head_object(Bucket=bucket, Key=key)["ContentLength"] > 0
    config = get(cluster, ns, "configmap", "rides-redis-features")
    assert "redis.storage.svc" not in json.dumps(config["data"])  # the connection string stays in its Secret

    print(f"[redis] registered after {time.monotonic() - started:.0f}s")
    materialized = wait_view(
        cluster, loom_operator, ns, name, "materialized",
        lambda o: condition(o, "Materialized").get("status") in ("True", "False"),
    )  # fmt: skip
    last = materialized["status"]["lastMaterialization"]
    assert condition(materialized, "Materialized")["status"] == "True", last
    if last["rowsWritten"] == 0:
        # Only when the view's hourly CronJob ran first (the test crossed a full hour): that incremental run wrote
        # the rows and left the asked-for one nothing new. Any other empty first run is a defect.
        scheduled = [job for job in jobs(cluster, ns) if owner_kinds(job) == {"CronJob"}]
        assert scheduled, (last, [(job["metadata"]["name"], job.get("status")) for job in jobs(cluster, ns)])
    assert redis_keys(services.redis_address) > 0
    print(f"[redis] materialized after {time.monotonic() - started:.0f}s")

    ready = wait_view(
        cluster, loom_operator, ns, name, "Ready", lambda o: condition(o, "Ready").get("status") == "True"
    )
    assert ready["status"]["phase"] == "Ready"
    deployment = get(cluster, ns, "deployment", "rides-redis-features")
    wait_until(
        lambda: get(cluster, ns, "deployment", "rides-redis-features").get("status", {}).get("readyReplicas") == 2,
        timeout=TIMEOUT_S,
        what="2 feature server replicas ready",
        interval=1,
    )
    print(f"[redis] 2 replicas ready after {time.monotonic() - started:.0f}s")
    selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
    pods = json.loads(cluster.kubectl("get", "pods", "-n", ns, "-l", selector, "-o", "json").stdout)["items"]
    addresses = sorted(p["status"]["podIP"] for p in pods if p["status"].get("phase") == "Running")
    assert len(addresses) == 2 and addresses[0] != addresses[1], addresses

    # What each replica must serve: the newest value per driver in the seeded data (the later-created row of a tie).
    body = s3.get_object(Bucket="loom-features", Key="driver_stats.parquet")["Body"].read()
    stats = pd.read_parquet(io.BytesIO(body)).sort_values(["driver_id", "event_timestamp", "created"])
    newest = stats.groupby("driver_id").tail(1).set_index("driver_id")
    view = name.replace("-", "_")
    for address in addresses:
        got = online(f"http://{address}:{HTTP_PORT}", view, [1001, 1003, 4242])
        for driver in (1001, 1003):
            for feature in FEATURES:
                value, state = got[driver][feature]
                assert state == "PRESENT", (address, driver, feature, state)
                assert value == pytest.approx(float(newest.loc[driver, feature]), rel=1e-5), (address, driver, feature)
        # Feast's Redis store reports an unknown entity as PRESENT with null values (sqlite says NOT_FOUND).
        assert [value for value, _ in got[4242].values()] == [None, None, None]
