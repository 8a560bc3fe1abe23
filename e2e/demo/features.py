"""Part 2: examples/featureview-driver-stats.yaml registered with Feast, materialized on demand, served online."""

from __future__ import annotations

import time

import httpx

from .stage import Demo, Outcome, is_true, wait_obj

FILE = "featureview-driver-stats.yaml"
DRIVERS = [1001, 1002]


def run(demo: Demo) -> Outcome:
    (view,) = demo.apply_file(FILE)
    name = view["metadata"]["name"]
    features = [f["name"] for f in view["spec"]["features"]]
    demo.ui.info(f"kubectl apply -f examples/{FILE}: FeatureView {name} ({', '.join(features)})")
    registered = wait_obj(demo, "featureview", name, lambda o: is_true(o, "Registered"), 300, "Registered")
    demo.ui.info(f"registered in Feast project {registered['status'].get('project')}; materializing now")
    demo.kubectl(
        "annotate",
        "featureview",
        name,
        "-n",
        demo.namespace,
        f"loom.dev/materialize-now={time.time_ns()}",
        "--overwrite",
    )
    ready = wait_obj(
        demo,
        "featureview",
        name,
        lambda o: is_true(o, "Materialized") and is_true(o, "Ready"),
        300,
        "materialized and Ready",
    )
    rows = (ready["status"].get("lastMaterialization") or {}).get("rowsWritten", 0)
    url = f"http://{demo.address(ready['status']['url'].removeprefix('http://').split('.')[0])}:80"
    body = {"features": [f"{name.replace('-', '_')}:{f}" for f in features], "entities": {"driver_id": DRIVERS}}
    started = time.monotonic()
    response = httpx.post(f"{url}/get-online-features", json=body, timeout=30, trust_env=False)
    latency_ms = (time.monotonic() - started) * 1000
    response.raise_for_status()
    doc = response.json()
    names = doc["metadata"]["feature_names"]
    columns = {n: r["values"] for n, r in zip(names, doc["results"], strict=True)}
    for i, driver in enumerate(columns["driver_id"]):
        values = ", ".join(f"{f}={columns[f][i]:.3g}" for f in features)
        demo.ui.info(f"driver {driver}: {values}")
    return Outcome(
        f"FeatureView {name}: {rows} rows materialized, online features served by {ready['status']['url']}",
        f"{rows} rows, lookup {latency_ms:.0f} ms",
    )
