"""A TrainingJob on point-in-time features, on the real local stack: examples/trainingjob-tabular-features.yaml and
examples/featureview-driver-stats.yaml applied unchanged, next to what `loom dev up` provides (S3 as
minio.storage.svc with the example data set and its entity dataframe, seeded again here as `loom dev up` does,
the Secret s3-credentials).

The operator (a subprocess) holds the workers back while the FeatureView does not exist (TrainingDataReady=False,
FeatureViewNotFound), registers the view once it is applied, runs Feast's historical retrieval in one Job, and
starts the worker only once the training set is in S3; the tabular task trains on it and the job succeeds. The
training set is then checked against a point-in-time join computed here from the source data: every feature
value is the newest one at or before its row's timestamp (within the view's 24h ttl), never a later one.
"""

from __future__ import annotations

import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from loom.devstack import backing
from loom.devstack.cluster import Cluster
from loom.devstack.cluster.handle import wait_until
from loom.e2e.pytest_operator import OperatorProcess
from loom.workloads.features import example_data

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
JOB_FILE = EXAMPLES / "trainingjob-tabular-features.yaml"
VIEW_FILE = EXAMPLES / "featureview-driver-stats.yaml"
FEATURES = ["conv_rate", "acc_rate", "avg_daily_trips"]
TTL = pd.Timedelta(hours=24)  # the example view's ttl
TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def services(cluster: Cluster) -> backing.BackingServices:
    return backing.ensure(cluster, progress=lambda line: print(f"[features] {line}"))


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return dict(json.loads(result.stdout)) if result.returncode == 0 else {}


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype), {})


def wait_job(cluster: Cluster, op: OperatorProcess, ns: str, name: str, what: str, check: Any) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        obj = get(cluster, ns, "trainingjob", name)
        return obj if obj and check(obj) else None

    try:
        return dict(wait_until(done, timeout=TIMEOUT_S, what=f"{name}: {what}", interval=1))
    except TimeoutError as error:
        status = json.dumps(get(cluster, ns, "trainingjob", name).get("status"), indent=1)
        pods = cluster.kubectl("get", "featureviews,jobs,pods", "-n", ns, "-o", "wide", check=False).stdout
        raise AssertionError(f"{error}\nstatus: {status}\n{pods}\n{op.log_tail()}") from None


def s3_parquet(services: backing.BackingServices, uri: str) -> pd.DataFrame:
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    body = services.s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
    return pd.read_parquet(io.BytesIO(body))


def point_in_time(stats: pd.DataFrame, entities: pd.DataFrame) -> pd.DataFrame:
    """The expected training set, computed without Feast: per entity row, the source row with the newest event
    time at or before the row's time and within the ttl; of two rows with one event time, the later created."""
    ordered = stats.sort_values(["event_timestamp", "created"])
    rows = []
    for row in entities.itertuples(index=False):
        at = row.event_timestamp
        mine = ordered[ordered.driver_id == row.driver_id]
        candidates = mine[(mine.event_timestamp <= at) & (mine.event_timestamp >= at - TTL)]
        newest = candidates.iloc[-1] if len(candidates) else None
        rows.append({
            "driver_id": row.driver_id,
            "event_timestamp": at,
            "source_time": None if newest is None else newest.event_timestamp,
            **{f: (None if newest is None else float(newest[f])) for f in FEATURES},
        })  # fmt: skip
    return pd.DataFrame(rows)


def test_trainingjob_trains_on_a_point_in_time_training_set(
    cluster: Cluster, services: backing.BackingServices, loom_operator: OperatorProcess, operator_namespace: str
) -> None:
    ns = operator_namespace
    doc = yaml.safe_load(JOB_FILE.read_text())
    name, data = doc["metadata"]["name"], doc["spec"]["trainingData"]
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(backing.credentials_secret(ns)))
    # As on a fresh `loom dev up`: nothing under the example's checkpoint prefix that another run left there.
    bucket, prefix = doc["spec"]["checkpoint"]["uri"].removeprefix("s3://").split("/", 1)
    s3 = services.s3_client()
    for item in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
        s3.delete_object(Bucket=bucket, Key=item["Key"])
    # The example data set as `loom dev up` seeds it, written again together (another test may have rewritten
    # the statistics alone with a newer end, and the entity rows must lie within their range).
    end = example_data.parse_end("now")
    with tempfile.TemporaryDirectory() as folder:
        written = example_data.write(Path(folder), end)
        for key, what in backing.FEATURES_OBJECTS.items():
            s3.upload_file(written[what], backing.FEATURES_BUCKET, key)
    seeded = s3.head_object(Bucket=backing.FEATURES_BUCKET, Key="driver_stats.parquet")["ETag"]

    # The job first: without its FeatureView it waits, says why, and starts nothing.
    cluster.kubectl("apply", "-n", ns, "-f", str(JOB_FILE))
    waiting = wait_job(
        cluster, loom_operator, ns, name, "waiting for its FeatureView",
        lambda o: condition(o, "TrainingDataReady").get("reason") == "FeatureViewNotFound",
    )  # fmt: skip
    assert waiting["status"]["phase"] == "Pending"
    assert condition(waiting, "TrainingDataReady")["status"] == "False"
    assert "driver-stats" in condition(waiting, "Ready")["message"]
    pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "name").stdout.split()
    assert pods == [], pods

    cluster.kubectl("apply", "-n", ns, "-f", str(VIEW_FILE))
    started = time.monotonic()
    done = wait_job(
        cluster, loom_operator, ns, name, "finished", lambda o: o["status"].get("phase") in ("Succeeded", "Failed")
    )
    status = done["status"]
    print(f"[features] {name} {status['phase']} {time.monotonic() - started:.0f}s after its FeatureView was applied")
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert condition(done, "TrainingDataReady")["status"] == "True"
    training = status["trainingData"]
    output = f"s3://loom-features/loom-training-data/{ns}/{name}.parquet"
    assert (training["phase"], training["output"], training["job"]) == ("Succeeded", output, f"{name}-training-data")
    # The trained model is where the checkpoint URI says (the trainer's final export).
    assert s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("KeyCount", 0) > 0
    # One retrieval for the job (not one per worker), and it ran before the worker.
    retrievals = json.loads(
        cluster.kubectl("get", "pods", "-n", ns, "-l", f"batch.kubernetes.io/job-name={name}-training-data",
                        "-o", "json").stdout
    )["items"]  # fmt: skip
    assert len(retrievals) == 1
    finished = retrievals[0]["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"]
    worker = get(cluster, ns, "pod", f"{name}-worker-0")
    assert worker["metadata"]["creationTimestamp"] >= finished

    # Point-in-time correct: exactly the entity rows, in order, each with the value it would have had then.
    got = s3_parquet(services, output)
    entities = s3_parquet(services, data["entityDataframe"])
    stats = example_data.driver_stats(end)
    rewritten = s3.head_object(Bucket=backing.FEATURES_BUCKET, Key="driver_stats.parquet")["ETag"] != seeded
    assert not rewritten, "another test rewrote s3://loom-features/driver_stats.parquet while this one ran"
    pd.testing.assert_frame_equal(entities, example_data.entity_rows(end), check_dtype=False)
    assert training["rows"] == len(got) == len(entities)
    assert got["driver_id"].tolist() == entities["driver_id"].tolist()
    assert (got["event_timestamp"] == entities["event_timestamp"]).all()
    assert got["trip_completed"].tolist() == entities["trip_completed"].tolist()
    expected = point_in_time(stats, entities)
    assert expected["source_time"].notna().all() and training["rowsWithoutFeatures"] == 0
    assert (expected["source_time"] <= expected["event_timestamp"]).all()
    for feature in FEATURES:
        assert got[feature].astype(float).round(4).tolist() == expected[feature].round(4).tolist(), feature
    # What a join that ignored time would give (each driver's newest value) differs: the check can tell.
    latest = stats.sort_values(["event_timestamp", "created"]).groupby("driver_id").tail(1).set_index("driver_id")
    naive = got["driver_id"].map(latest["conv_rate"].astype(float)).round(4)
    assert (naive != got["conv_rate"].astype(float).round(4)).sum() > len(got) // 2
