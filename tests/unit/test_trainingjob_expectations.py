"""Worker pods created and not yet in the pod index are not created again (kinds/trainingjob/expectations.py)."""

from __future__ import annotations

from loom.operator.kinds.trainingjob.expectations import CreatedWorkers


def test_a_created_pod_is_expected_until_the_index_shows_it() -> None:
    created, job = CreatedWorkers(expect_s=30.0), ("ml", "gpt")
    created.created(job, [("gpt-worker-0", 0), ("gpt-worker-1", 0)], now=100.0)
    # The first worker's ADDED event is in the index, the second's is still on its way.
    assert created.expected(job, [("gpt-worker-0", 0)], now=100.2) == {("gpt-worker-1", 0)}
    # Once shown, a pod is the index's to report: gone from the index later means gone.
    assert created.expected(job, [("gpt-worker-1", 0)], now=100.4) == frozenset()
    assert created.expected(job, [], now=100.5) == frozenset()
    assert len(created) == 0


def test_the_same_name_in_another_attempt_is_another_pod() -> None:
    created, job = CreatedWorkers(), ("ml", "gpt")
    created.created(job, [("gpt-worker-0", 1)], now=0.0)
    assert created.expected(job, [("gpt-worker-0", 0)], now=1.0) == {("gpt-worker-0", 1)}  # the old attempt's pod


def test_a_pod_never_shown_is_created_again_after_expect_s_and_jobs_are_kept_apart() -> None:
    created = CreatedWorkers(expect_s=30.0)
    created.created(("ml", "a"), [("a-worker-0", 0)], now=0.0)
    created.created(("ml", "b"), [("b-worker-0", 0)], now=0.0)
    assert created.expected(("ml", "a"), [], now=30.0) == {("a-worker-0", 0)}
    assert created.expected(("ml", "a"), [], now=30.1) == frozenset()  # deleted before the watch showed it
    assert created.expected(("ml", "b"), [], now=10.0) == {("b-worker-0", 0)}
    created.forget(("ml", "b"))  # the job was deleted
    assert len(created) == 0
