"""Runs the demo's parts in order, times them, prints the summary and where to look, then cleans up (or, with
LOOM_DEMO_KEEP=1, leaves everything running and says how to explore and stop it)."""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

from loom.devstack.cluster import down as stack_down
from loom.e2e.helm_operator import helm

from . import autoscale, features, graph, install, pictures, serving, training
from .stage import NAMESPACE, WORKDIR, Demo, Later, Outcome
from .ui import Ui

Part = tuple[str, str, Callable[[Demo], Outcome | Later]]
Row = tuple[str, str, float, str]
PARTS: list[Part] = [
    (
        "Loom, installed with Helm",
        "The local real stack, S3/MLflow/Redis/Prometheus as Services, the chart.",
        install.run,
    ),
    (
        "A FeatureView, materialized and served",
        "Feast registry, materialization Job, online feature server.",
        features.run,
    ),
    ("A TrainingJob on two workers, one killed", "FSDP on 2 workers; a SIGKILL mid-run; resume from S3.", training.run),
    ("An InferenceService, streaming", "The trained model served from the job's checkpoint.", serving.run),
    ("An InferenceGraph in front of it", "An 80/20 A/B split across two services.", graph.run),
    ("Autoscaling: up under load, to zero, back", "Queue depth from Prometheus; the activator at zero.", autoscale.run),
    ("Pictures from the MLflow run", "Loss curve with the restart, the run page in Chromium.", pictures.run),
]


def where_to_look(demo: Demo) -> list[tuple[str, str]]:
    exports = demo.cluster.shell_exports().replace("\n", "; ")
    lines = [
        ("MLflow run", demo.facts.get("run_url_host") or demo.facts.get("run_url") or "(no run)"),
        ("  in the cluster", demo.facts.get("run_url") or "-"),
        ("Prometheus", demo.facts.get("prometheus", "-")),
        ("  queue depth", f'loom_server_queue_depth{{namespace="{NAMESPACE}"}}'),
        (
            "  tokens/s per pod",
            f'sum by (pod) (rate(loom_server_generated_tokens_total{{namespace="{NAMESPACE}"}}[1m]))',
        ),
        ("  requests by status", f'sum by (code) (rate(loom_server_requests_total{{namespace="{NAMESPACE}"}}[1m]))'),
        ("kubectl", f"{exports}"),
        ("", f"kubectl get loom -n {NAMESPACE}"),
        ("", f"kubectl describe trainingjob chargpt -n {NAMESPACE}"),
        ("operator log", f"kubectl logs -n {install.RELEASE_NAMESPACE} deploy/{install.OPERATOR}"),
        ("pictures", f"{pictures.LOSS_PNG}, {pictures.RUN_PNG}"),
    ]
    return lines


def clean_up(demo: Demo) -> None:
    """Everything the demo made, the Loom objects first while the operator still runs (its finalizers)."""
    demo.ui.info(f"cleaning up: Loom objects in {NAMESPACE}, the Helm release, the demo's namespaces")
    kubectl = demo.kubectl
    kubectl("delete", "loom", "--all", "-n", NAMESPACE, "--timeout=180s", check=False)
    helm(
        demo.cluster,
        "uninstall",
        install.RELEASE,
        "-n",
        install.RELEASE_NAMESPACE,
        "--wait",
        "--ignore-not-found",
        check=False,
    )
    for namespace in (NAMESPACE, install.RELEASE_NAMESPACE):  # the stack's services (Prometheus too) stay
        kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=180s", check=False)


def attempt(ui: Ui, title: str, step: Callable[[], Outcome | Later]) -> Outcome | Later | None:
    """A part's result; None when it failed, after saying why (the demo stops at the first failure)."""
    try:
        return step()
    except Exception as error:
        ui.failed(f"{title}: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
        (WORKDIR / "failure.txt").write_text(traceback.format_exc())
        ui.info(f"details: {WORKDIR / 'failure.txt'}")
        return None


def finished(ui: Ui, title: str, state: str, started: float, result: Outcome | Later | None) -> Row:
    """A part's summary row, after printing its outcome line."""
    if not isinstance(result, Outcome):
        return (title, "FAILED", time.monotonic() - started, "-")
    ui.outcome(result.line)
    return (title, state, result.seconds or time.monotonic() - started, result.figure)


def main() -> int:
    # SIGTERM (a timeout, CI, a closed terminal) unwinds like Ctrl-C, so the clean-up below runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    keep = bool(os.environ.get("LOOM_DEMO_KEEP"))
    ui = Ui()
    WORKDIR.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    ui.info("starting the local real stack (a fresh clone builds Kubernetes from its Go modules first: many minutes)")
    cluster, started_here = install.stack(ui.info)
    demo = Demo(cluster, ui)
    rows: dict[int, Row] = {}
    failed = False
    try:
        waiting: tuple[int, str, float, Later] | None = None  # a part running on in the background
        for number, (title, what, part) in enumerate(PARTS, 1):
            ui.part(number, len(PARTS), title, what)
            started = time.monotonic()
            result = attempt(ui, title, functools.partial(part, demo))
            if isinstance(result, Later):
                ui.info(result.line)
                waiting = (number, title, started, result)
                continue
            rows[number] = finished(ui, title, "ok", started, result)
            if result is not None and waiting is not None:
                # Collected right after the part it ran beside, so the story keeps its order.
                earlier, earlier_title, earlier_started, later = waiting
                waiting = None
                ui.part(earlier, len(PARTS), f"{earlier_title}: the outcome", f"It ran beside part {number}.")
                result = attempt(ui, earlier_title, later.collect)
                rows[earlier] = finished(ui, earlier_title, f"ok (beside {number})", earlier_started, result)
            if result is None:
                failed = True
                break
        ui.summary([rows[n] for n in sorted(rows)])
        ui.info(f"demo wall time {time.monotonic() - began:.0f}s")
        ui.look(where_to_look(demo))
        if keep:
            ui.info(
                f"LOOM_DEMO_KEEP=1: everything keeps running. Explore with the commands above; the operator "
                f"watches {NAMESPACE} (kubectl apply -n {NAMESPACE} -f examples/...). "
                "Stop it all: .venv/bin/loom dev down"
            )
    finally:
        if not keep:
            clean_up(demo)
            if started_here:
                ui.info("stopping the stack the demo started (LOOM_DEMO_KEEP=1 keeps it)")
                stack_down(ui.info)
    return 1 if failed else 0
