"""The operator's metrics (reconcile duration and errors per kind, objects per phase, watch restarts) and its
structured logs (JSON or text, the object named on every line about one)."""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import kopf
import pytest
from kopf._cogs.clients import watching
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from loom.operator.core import observability
from loom.operator.core.observability import (
    ObjectsCollector,
    WatchRestarts,
    configure_logging,
    count_watch_restarts,
    object_context,
    phase_of,
)
from loom.operator.core.runner import Runner

pytestmark = pytest.mark.timeout(30)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def captured() -> Iterator[tuple[io.StringIO, logging.Handler]]:
    """The operator's log configuration, writing into a buffer; the root logger restored afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    handler = configure_logging("INFO", "json")
    buffer = io.StringIO()
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(buffer)
    try:
        yield buffer, handler
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def lines(buffer: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buffer.getvalue().splitlines() if line.strip()]


async def test_every_pass_is_timed_and_its_errors_counted_per_kind() -> None:
    outcomes: dict[str, BaseException | None] = {"ok": None, "bad": RuntimeError("boom")}

    async def reconcile(namespace: str, name: str) -> None:
        if name == "slow":
            await asyncio.sleep(5)
        error = outcomes.get(name)
        if error is not None:
            raise error

    runner = Runner("ObsKind", reconcile, interval_s=3600, timeout_s=0.05)
    other = Runner("ObsOther", reconcile, interval_s=3600, timeout_s=30)
    for name in ("ok", "bad", "slow", "ok"):
        await runner.trigger("ns", name)
    await other.trigger("ns", "ok")

    assert sample("loom_reconcile_duration_seconds_count", kind="ObsKind") == 4
    assert sample("loom_reconcile_duration_seconds_count", kind="ObsOther") == 1
    # The abandoned pass took at least the timeout; the sum holds it.
    assert sample("loom_reconcile_duration_seconds_sum", kind="ObsKind") >= 0.05
    assert sample("loom_reconcile_errors_total", kind="ObsKind", reason="exception") == 1
    assert sample("loom_reconcile_errors_total", kind="ObsKind", reason="timeout") == 1
    assert sample("loom_reconcile_errors_total", kind="ObsOther", reason="exception") == 0


async def test_json_lines_of_a_pass_name_the_object(captured: tuple[io.StringIO, logging.Handler]) -> None:
    buffer, _ = captured
    controller_log = logging.getLogger("loom.operator.some_controller")

    async def reconcile(namespace: str, name: str) -> None:
        controller_log.info("applied %d children", 3)
        # A task the pass starts inherits the object too (asyncio copies the context).
        await asyncio.create_task(asyncio.sleep(0, result=None))
        await asyncio.create_task(_log_in_task(controller_log))
        raise ValueError("bad spec")

    await Runner("TrainingJob", reconcile, interval_s=3600, timeout_s=30).trigger("team-a", "gpt")
    logging.getLogger("loom.operator").info("not about an object")

    records = lines(buffer)
    ref = {"apiVersion": "loom.dev/v1alpha1", "kind": "TrainingJob", "namespace": "team-a", "name": "gpt"}
    applied, in_task, failed, other = records
    assert applied["message"] == "applied 3 children" and applied["object"] == ref
    assert applied["level"] == "INFO" and applied["logger"] == "loom.operator.some_controller" and applied["time"]
    assert in_task["message"] == "from a task" and in_task["object"] == ref
    assert failed["level"] == "ERROR" and failed["object"] == ref and "ValueError: bad spec" in failed["exc_info"]
    assert "object" not in other and other["message"] == "not about an object"


async def _log_in_task(log: logging.Logger) -> None:
    log.info("from a task")


def test_kopf_object_loggers_keep_their_reference_in_json(captured: tuple[io.StringIO, logging.Handler]) -> None:
    buffer, _ = captured
    body = kopf.Body(
        {
            "apiVersion": "loom.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "echo", "namespace": "team-b", "uid": "u-1"},
        }
    )
    logger = kopf._core.actions.loggers.LocalObjectLogger(body=body, settings=kopf.OperatorSettings())  # type: ignore[attr-defined]
    with object_context("TrainingJob", "elsewhere", "not-this-one"):  # Kopf's own reference wins
        logger.info("Handler 'changed' succeeded.")
    (record,) = lines(buffer)
    assert record["object"] == {
        "apiVersion": "loom.dev/v1alpha1",
        "kind": "InferenceService",
        "name": "echo",
        "namespace": "team-b",
        "uid": "u-1",
    }
    # Kopf's internals (its settings object, the event-posting flag) stay out of the line.
    assert "settings" not in record and "k8s_skip" not in record and "k8s_ref" not in record


def test_text_lines_about_an_object_are_prefixed(captured: tuple[io.StringIO, logging.Handler]) -> None:
    buffer, handler = captured
    handler.setFormatter(observability.formatter("text"))
    log = logging.getLogger("loom.operator.x")
    with object_context("FeatureView", "ns", "drivers"):
        log.warning("registry %s unreachable", "s3://r")
    log.info("started")
    first, second = buffer.getvalue().splitlines()
    assert first.endswith("WARNING loom.operator.x: [FeatureView ns/drivers] registry s3://r unreachable")
    assert second.endswith("INFO loom.operator.x: started")


def test_an_unknown_log_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        observability.formatter("xml")


def test_objects_per_phase_are_counted_from_the_kopf_indices() -> None:
    collector = ObjectsCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    jobs: dict[str, list[tuple[str, str]]] = {"Running": [("a", "x"), ("b", "y")], "Succeeded": [("a", "z")]}
    collector.track("TrainingJob", jobs)
    collector.track("TrainingJob", {"Running": []})  # the first index of a kind stays
    collector.track("InferenceService", {phase_of({}): [("a", "s")], phase_of({"phase": "Ready"}): [("a", "t")]})
    collector.track("FeatureView", None)  # not handed over yet

    def value(kind: str, phase: str) -> float | None:
        return registry.get_sample_value("loom_objects", {"kind": kind, "phase": phase})

    assert (value("TrainingJob", "Running"), value("TrainingJob", "Succeeded")) == (2, 1)
    assert (value("InferenceService", "Unknown"), value("InferenceService", "Ready")) == (1, 1)
    jobs["Running"].pop()  # Kopf updates the index in place: the next scrape sees it
    jobs["Failed"] = [("b", "y")]
    assert (value("TrainingJob", "Running"), value("TrainingJob", "Failed")) == (1, 1)


def test_watch_restarts_count_relists_and_reconnects_per_resource() -> None:
    counter = Counter("test_watch_restarts", "test", ["resource", "reason"], registry=CollectorRegistry())
    restarts = WatchRestarts(counter)
    jobs, pods = kopf.Resource("loom.dev", "v1alpha1", "trainingjobs"), kopf.Resource("", "v1", "pods")

    restarts.listing(jobs, "a")
    restarts.watching(jobs, "a")  # the first watch of a list: no restart
    restarts.listing(jobs, "b")  # another namespace is another stream
    restarts.watching(jobs, "b")
    restarts.watching(jobs, "a")  # the stream ended (server timeout): reconnect
    restarts.watching(jobs, "a")
    restarts.listing(jobs, "a")  # 410 Gone, or resumed after a pause: a relist
    restarts.watching(jobs, "a")  # ... whose first watch is no reconnect
    restarts.listing(pods, None)
    restarts.watching(pods, None)

    def value(resource: str, reason: str) -> float:
        return counter.labels(resource=resource, reason=reason)._value.get()

    assert value("trainingjobs.loom.dev", "reconnect") == 2
    assert value("trainingjobs.loom.dev", "relist") == 1
    assert (value("pods", "reconnect"), value("pods", "relist")) == (0, 0)


async def test_kopf_watching_is_wrapped_without_changing_it() -> None:
    originals = (watching.continuous_watch, watching.watch_objs)
    counter = Counter("test_wrapped_restarts", "test", ["resource", "reason"], registry=CollectorRegistry())
    try:
        restarts = count_watch_restarts(WatchRestarts(counter))
        count_watch_restarts(restarts)  # twice: still one layer
        assert watching.continuous_watch.__wrapped__ is originals[0]  # type: ignore[attr-defined]
        assert watching.watch_objs.__wrapped__ is originals[1]  # type: ignore[attr-defined]
        # Kopf looks both names up in its module at call time, so the wrappers see every list and watch.
        assert "continuous_watch(" in inspect.getsource(watching.infinite_watch)
        assert "watch_objs(" in inspect.getsource(originals[0])
        resource = kopf.Resource("loom.dev", "v1alpha1", "inferenceservices")
        settings, waiter = kopf.OperatorSettings(), asyncio.get_running_loop().create_future()
        for _ in range(2):
            stream = watching.continuous_watch(
                settings=settings, resource=resource, namespace="n", operator_pause_waiter=waiter
            )
            assert inspect.isasyncgen(stream)  # Kopf's own generator, untouched (never iterated here)
            await stream.aclose()
        assert counter.labels(resource="inferenceservices.loom.dev", reason="relist")._value.get() == 1
    finally:
        watching.continuous_watch, watching.watch_objs = originals
