"""Part 2: examples/featureview-driver-stats.yaml registered with Feast, materialized on demand, served online.

Feast's registration and materialization Jobs and its feature server spend most of their time starting Python
and importing Feast, so this part runs on in the background while the TrainingJob trains (part 3): it applies the
view and asks for a materialization at once, and its outcome (the online lookup) is collected after part 3."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from .stage import Demo, Later, Outcome, is_true, wait_obj

FILE = "featureview-driver-stats.yaml"
DRIVERS = [1001, 1002]


@dataclass
class _Progress:
    """What the background thread saw, printed when the outcome is collected (never from the thread: the
    training bar owns the terminal meanwhile)."""

    lines: list[str] = field(default_factory=list)
    outcome: Outcome | None = None
    error: BaseException | None = None


def _finish(demo: Demo, name: str, features: list[str], started: float, seen: _Progress) -> None:
    registered = wait_obj(demo, "featureview", name, lambda o: is_true(o, "Registered"), 420, "Registered")
    seen.lines.append(
        f"registered in Feast project {registered['status'].get('project')} after {time.monotonic() - started:.0f}s"
    )
    ready = wait_obj(
        demo,
        "featureview",
        name,
        lambda o: is_true(o, "Materialized") and is_true(o, "Ready"),
        420,
        "materialized and Ready",
    )
    last = ready["status"].get("lastMaterialization") or {}
    rows = last.get("rowsWritten") or 0
    took = time.monotonic() - started
    seen.lines.append(f"materialized ({rows} rows) and its feature server Ready after {took:.0f}s")
    if not rows:
        # Incremental: the view's registry (a hostPath folder) outlives the object, so a second demo run finds
        # the rows already in the online store; the lookup below reads them.
        seen.lines.append(f"nothing new since {last.get('start')}: an earlier run materialized these rows")
    url = f"http://{demo.address(ready['status']['url'].removeprefix('http://').split('.')[0])}:80"
    body = {"features": [f"{name.replace('-', '_')}:{f}" for f in features], "entities": {"driver_id": DRIVERS}}
    asked = time.monotonic()
    response = httpx.post(f"{url}/get-online-features", json=body, timeout=30, trust_env=False)
    latency_ms = (time.monotonic() - asked) * 1000
    response.raise_for_status()
    doc = response.json()
    names = doc["metadata"]["feature_names"]
    columns = {n: r["values"] for n, r in zip(names, doc["results"], strict=True)}
    for i, driver in enumerate(columns["driver_id"]):
        values = ", ".join(f"{f}={columns[f][i]:.3g}" for f in features)
        seen.lines.append(f"POST {ready['status']['url']}/get-online-features driver {driver}: {values}")
    written = f"{rows} rows materialized" if rows else "materialized (no new rows)"
    seen.outcome = Outcome(
        f"FeatureView {name}: {written}, online features served by {ready['status']['url']}",
        f"{rows} new rows, lookup {latency_ms:.0f} ms",
        seconds=time.monotonic() - started,
    )


def run(demo: Demo) -> Later:
    started = time.monotonic()
    (view,) = demo.apply_file(FILE)
    name = view["metadata"]["name"]
    features = [f["name"] for f in view["spec"]["features"]]
    demo.ui.info(f"kubectl apply -f examples/{FILE}: FeatureView {name} ({', '.join(features)})")
    # Asked for now, as the example's comment shows; Loom runs it once the view is registered.
    demo.kubectl(
        "annotate",
        "featureview",
        name,
        "-n",
        demo.namespace,
        f"loom.dev/materialize-now={time.time_ns()}",
        "--overwrite",
    )
    demo.ui.info(f"kubectl annotate featureview {name} loom.dev/materialize-now=<now>: materialize once registered")
    seen = _Progress()

    def work() -> None:
        try:
            _finish(demo, name, features, started, seen)
        except BaseException as error:  # handed to collect(), which raises it in the demo's thread
            seen.error = error

    thread = threading.Thread(target=work, name="demo-featureview", daemon=True)
    thread.start()

    def collect() -> Outcome:
        thread.join()
        for line in seen.lines:
            demo.ui.info(line)
        if seen.error is not None:
            raise seen.error
        assert seen.outcome is not None
        return seen.outcome

    return Later(
        "Feast registers the view, materializes it and starts its feature server in the background while the "
        "TrainingJob trains; the lookup follows part 3",
        collect,
    )
