"""The reconcile runner every controller uses: serialisation, coalescing, bounded passes, resync, forgetting.

The reconcile passed in is a fake that records calls and can be held at a gate, so each test controls exactly
when a pass is in flight. Nothing here asserts a timing: waits are on events, bounded by pytest-timeout.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from loom.operator.core.runner import LastSeen, Runner, own_kind_handlers, resync_order, trigger_fields

pytestmark = pytest.mark.timeout(30)


class Recorder:
    """A reconcile that records (namespace, name) and, while `gate` is set up, waits for it to open."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.running = 0
        self.most_at_once = 0
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self.fail_with: BaseException | None = None

    async def __call__(self, namespace: str, name: str) -> None:
        self.calls.append((namespace, name))
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        self.entered.set()
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.fail_with is not None:
                raise self.fail_with
        finally:
            self.running -= 1


def runner_for(recorder: Recorder, *, timeout_s: float = 30.0, interval_s: float = 3600.0) -> Runner:
    return Runner("Thing", recorder, interval_s=interval_s, timeout_s=timeout_s)


async def held_pass(recorder: Recorder, runner: Runner) -> asyncio.Task[None]:
    """A pass for ns/a that is running and held at the recorder's gate until the test opens it."""
    recorder.gate = asyncio.Event()
    first = asyncio.create_task(runner.trigger("ns", "a"))
    await recorder.entered.wait()
    return first


async def test_one_pass_per_trigger_when_idle() -> None:
    recorder = Recorder()
    runner = runner_for(recorder)
    await runner.trigger("ns", "a")
    await runner.trigger("ns", "a")
    assert recorder.calls == [("ns", "a"), ("ns", "a")]
    assert runner.tracked == frozenset()


async def test_passes_for_one_object_never_overlap_and_triggers_coalesce_into_one_more() -> None:
    recorder = Recorder()
    runner = runner_for(recorder)
    first = await held_pass(recorder, runner)
    # Three triggers while the first pass runs: each returns at once, together they ask for ONE more pass.
    for _ in range(3):
        await runner.trigger("ns", "a")
    assert recorder.calls == [("ns", "a")]
    assert runner.tracked == frozenset({("ns", "a")})
    assert recorder.gate is not None
    recorder.gate.set()
    await first
    assert recorder.calls == [("ns", "a"), ("ns", "a")]
    assert recorder.most_at_once == 1
    assert runner.tracked == frozenset()  # nothing per object outlives the passes


async def test_different_objects_run_side_by_side() -> None:
    recorder = Recorder()
    recorder.gate = asyncio.Event()
    runner = runner_for(recorder)
    tasks = [asyncio.create_task(runner.trigger("ns", name)) for name in ("a", "b")]
    while recorder.running < 2:
        await asyncio.sleep(0)
    recorder.gate.set()
    await asyncio.gather(*tasks)
    assert sorted(recorder.calls) == [("ns", "a"), ("ns", "b")]
    assert recorder.most_at_once == 2


async def test_a_hung_pass_is_abandoned_and_the_object_reconciled_again(caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder()
    recorder.gate = asyncio.Event()  # never opened: the pass hangs like a stuck API call
    runner = runner_for(recorder, timeout_s=0.05)
    with caplog.at_level(logging.ERROR, logger="loom.operator.runner"):
        await runner.trigger("ns", "a")
    assert "Thing ns/a took over" in caplog.text
    assert runner.tracked == frozenset()
    assert recorder.running == 0  # the hung pass was cancelled, not left behind
    recorder.gate.set()
    await runner.trigger("ns", "a")
    assert recorder.calls == [("ns", "a"), ("ns", "a")]


async def test_a_failing_pass_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder()
    recorder.fail_with = RuntimeError("API server said no")
    runner = runner_for(recorder)
    with caplog.at_level(logging.ERROR, logger="loom.operator.runner"):
        await runner.trigger("ns", "a")
    assert "reconciling Thing ns/a failed" in caplog.text and "API server said no" in caplog.text
    assert runner.tracked == frozenset()


async def test_forget_drops_the_pass_queued_behind_the_running_one() -> None:
    recorder = Recorder()
    runner = runner_for(recorder)
    first = await held_pass(recorder, runner)
    await runner.trigger("ns", "a")  # queued
    runner.forget("ns", "a")  # ... then the object is deleted
    assert recorder.gate is not None
    recorder.gate.set()
    await first
    assert recorder.calls == [("ns", "a")]
    assert runner.tracked == frozenset()


async def test_resync_visits_due_objects_of_the_index_and_skips_idle_ones() -> None:
    recorder = Recorder()
    runner = runner_for(recorder, interval_s=0.01)
    index: dict[tuple[str, str], list[bool]] = {("ns", "due"): [True], ("ns", "idle"): [False]}
    runner.resync(index)
    runner.resync({("ns", "other"): [True]})  # a second start is a no-op: one resync task per runner
    try:
        while recorder.calls.count(("ns", "due")) < 3:
            await asyncio.sleep(0.01)
        index[("ns", "late")] = [True]  # the index is read afresh every round (Kopf keeps it current)
        while ("ns", "late") not in recorder.calls:
            await asyncio.sleep(0.01)
    finally:
        await runner.stop()
    assert set(recorder.calls) == {("ns", "due"), ("ns", "late")}


async def test_resync_starts_only_once_an_index_is_known() -> None:
    recorder = Recorder()
    runner = runner_for(recorder, interval_s=0.01)
    runner.resync(None)  # a handler called before Kopf handed over the index
    runner.resync({("ns", "a"): [True]})
    try:
        while not recorder.calls:
            await asyncio.sleep(0.01)
    finally:
        await runner.stop()
    assert recorder.calls[0] == ("ns", "a")


def test_last_seen_reports_changes_and_forgets_deleted_objects() -> None:
    seen: LastSeen[tuple[str | None, str | None]] = LastSeen()
    assert seen.changed(("ns", "job"), ("s3://c/step-10", "Running"))
    assert not seen.changed(("ns", "job"), ("s3://c/step-10", "Running"))
    assert seen.changed(("ns", "job"), ("s3://c/step-20", "Running"))
    assert seen.changed(("ns", "other"), (None, "Pending"))
    assert len(seen) == 2 and ("ns", "job") in seen and ("ns", "never-seen") not in seen
    seen.forget(("ns", "job"))
    seen.forget(("ns", "never-seen"))
    assert len(seen) == 1
    assert seen.changed(("ns", "job"), ("s3://c/step-20", "Running"))  # a re-created namesake starts afresh


async def test_own_kind_events_pass_on_first_sight_a_spec_change_and_an_also_on_field_only() -> None:
    """The own-kind handler: a pass when an object is first seen (created, or listed when the operator starts), when
    its generation moves (a spec change) or a field in `also_on` changes; none for a status write (the operator's
    own) or a label; a deletion forgets the object, calls `deleted`, and a namesake created later is new again."""
    import kopf

    recorder, removed = Recorder(), []
    runner = Runner("Thing", recorder, interval_s=60, timeout_s=5)

    async def deleted(namespace: str, name: str, spec: Any) -> None:
        removed.append((namespace, name, dict(spec)))

    previous, registry = kopf.get_default_registry(), kopf.OperatorRegistry()
    kopf.set_default_registry(registry)
    try:
        also_on = [("metadata", "annotations", "now")]
        own_kind_handlers(runner, "things", "things_index", also_on=also_on, deleted=deleted)
    finally:
        kopf.set_default_registry(previous)
    [handler] = [h for h in registry._watching.get_all_handlers() if h.id == "changed"]

    def thing(generation: int, **meta: Any) -> dict[str, Any]:
        metadata = {"name": "a", "namespace": "ns", "generation": generation, **meta}
        return {"metadata": metadata, "spec": {"n": generation}}

    async def event(kind: str | None, body: dict[str, Any], passes: int) -> None:
        await handler.fn(type=kind, body=body, namespace="ns", name="a", spec=body["spec"])
        assert len(recorder.calls) == passes, (kind, body)

    await event(None, thing(1), passes=1)  # listed at start-up (or created while the operator was down)
    await event("MODIFIED", {**thing(1), "status": {"phase": "Running"}}, passes=1)  # a status write
    await event("MODIFIED", thing(1, labels={"team": "x"}), passes=1)
    await event("MODIFIED", thing(2), passes=2)  # spec changed
    await event("MODIFIED", thing(2, annotations={"now": "t1"}), passes=3)
    await event("MODIFIED", thing(2, annotations={"now": "t1", "other": "y"}), passes=3)
    await event("DELETED", thing(2, annotations={"now": "t1"}), passes=3)
    assert removed == [("ns", "a", {"n": 2})]
    await event("ADDED", thing(1), passes=4)  # a namesake
    assert trigger_fields(thing(3, annotations={"now": "t2"}), [("metadata", "annotations", "now")]) == (3, "t2")
    assert trigger_fields({"metadata": {}}, [("metadata", "annotations", "now")]) == (None, None)


def _registered() -> Any:
    """A fresh Kopf registry holding every handler the operator's controllers register."""
    import kopf

    from loom.devstack.images import IMAGE_SETTINGS
    from loom.operator import controllers
    from loom.operator.settings import OperatorSettings

    previous = kopf.get_default_registry()
    registry = kopf.OperatorRegistry()
    kopf.set_default_registry(registry)
    try:
        controllers.register(OperatorSettings(**IMAGE_SETTINGS))
    finally:
        kopf.set_default_registry(previous)
    return registry


def test_no_controller_puts_a_finalizer_or_an_annotation_on_its_objects() -> None:
    """Resync through the runner, no kopf.timer/daemon, no delete handler: deleting an object (or its namespace)
    never waits for the operator, even while it is down. And no create/update/resume handler either: Kopf keeps
    those handlers' last spec in an annotation, a PATCH of every new object (own_kind_handlers says why)."""
    registry = _registered()
    assert [str(h.id) for h in registry._changing.get_all_handlers()] == []
    assert list(registry._spawning.get_all_handlers()) == []
    own = [h for h in registry._watching.get_all_handlers() if h.id == "changed"]
    assert len(own) == 4, "one own-kind handler per kind"


def test_every_handler_runs_on_the_event_loop() -> None:
    """Kopf runs a sync handler in a worker thread of asyncio's default pool, per event: a thread hop and a context
    copy for each pod event of each job (thousands in a burst of jobs, on an operator that is CPU-bound there), and
    a sync handler that touches the event loop raises in that thread, so the object silently dropped out of an
    index once. Every handler the controllers register is a coroutine function."""
    import inspect

    registry = _registered()
    handlers = [
        handler
        for kind in (registry._indexing, registry._watching, registry._changing, registry._spawning)
        for handler in kind.get_all_handlers()
    ] + list(registry._activities.get_all_handlers())
    assert len([h for h in handlers if h in registry._indexing.get_all_handlers()]) >= 8, "indexes not registered"
    assert [str(h.id) for h in handlers if not inspect.iscoroutinefunction(h.fn)] == []


async def test_later_runs_one_pass_and_the_earliest_request_wins() -> None:
    recorder = Recorder()
    runner = Runner("Thing", recorder, interval_s=3600, timeout_s=5)
    runner.later("ns", "a", 3600)  # replaced by the sooner one below
    runner.later("ns", "a", 0.01)
    runner.later("ns", "a", 1800)  # later than the one pending: ignored
    await asyncio.wait_for(recorder.entered.wait(), 10)
    await asyncio.sleep(0)
    assert recorder.calls == [("ns", "a")]
    assert not runner._timers  # nothing else pending
    runner.later("ns", "b", 3600)
    runner.forget("ns", "b")  # a deleted object's pass is dropped with it
    assert not runner._timers


async def test_a_resync_round_runs_a_bounded_number_of_passes_and_event_passes_take_no_slot() -> None:
    """A thousand busy objects must not starve a new object's first pass: the round's passes queue for a few
    slots, a pass an event asks for runs at once beside them."""
    recorder = Recorder()
    recorder.gate = asyncio.Event()
    runner = Runner("Thing", recorder, interval_s=0.01, timeout_s=30, resync_concurrency=3)
    index = {("ns", f"busy-{i}"): [True] for i in range(20)}
    runner.resync(index)
    try:
        while recorder.running < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # more rounds came and went: still three at once
        assert recorder.running == 3
        new = asyncio.create_task(runner.trigger("ns", "new"))  # a watch event for a new object
        while ("ns", "new") not in recorder.calls:
            await asyncio.sleep(0.01)
        assert recorder.running == 4
        recorder.gate.set()
        await new
    finally:
        await runner.stop()
    assert recorder.most_at_once == 4


def test_a_round_visits_the_longest_unvisited_first_and_skips_objects_passed_lately() -> None:
    last = {("ns", "old"): 100.0, ("ns", "older"): 50.0, ("ns", "fresh"): 108.0}
    flagged = [("ns", "fresh"), ("ns", "old"), ("ns", "never"), ("ns", "older")]
    # At 110 with a 10 s interval: "fresh" ended its pass 2 s ago (under half an interval), the rest are due.
    assert resync_order(flagged, last, now=110.0, interval_s=10.0) == [("ns", "never"), ("ns", "older"), ("ns", "old")]


def test_a_round_leaves_objects_marked_quiet_until_their_mark_runs_out() -> None:
    flagged = [("ns", "quiet"), ("ns", "busy"), ("ns", "woken")]
    quiet = {("ns", "quiet"): 140.0, ("ns", "woken"): 110.0}
    assert resync_order(flagged, {}, now=110.0, interval_s=10.0, quiet_until=quiet) == [("ns", "busy"), ("ns", "woken")]


async def test_a_pass_that_says_quiet_keeps_its_object_out_of_the_resync_until_another_pass_starts() -> None:
    runner: Runner

    class Steady:
        """A reconcile that says its object is steady, until told otherwise."""

        def __init__(self) -> None:
            self.calls = 0
            self.steady = True

        async def __call__(self, namespace: str, name: str) -> None:
            self.calls += 1
            if self.steady:
                runner.quiet(namespace, name, 3600.0)

    reconcile = Steady()
    runner = Runner("Thing", reconcile, interval_s=0.01, timeout_s=30.0)
    index = {("ns", "a"): [True]}
    runner.resync(index)
    try:
        while reconcile.calls < 1:  # the first round's pass says steady
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # ten rounds: none visits it
        assert reconcile.calls == 1
        reconcile.steady = False
        await runner.trigger("ns", "a")  # a watch event's pass: it drops the mark and does not say it again
        calls = reconcile.calls  # (a round may have queued one more behind it: the mark was gone)
        while reconcile.calls < calls + 2:  # so the rounds visit it again
            await asyncio.sleep(0.01)
        runner.quiet("ns", "a", 3600.0)
        runner.forget("ns", "a")  # deleted: the mark goes with it
        assert runner.tracked == frozenset() and not runner._quiet_until
    finally:
        await runner.stop()
