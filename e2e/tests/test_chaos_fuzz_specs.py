"""Chaos: fuzzed specs against the real API server and the real operator (issue 15).

Objects are drawn by hypothesis from the CRD schemas generated from the pydantic models (loom.e2e.chaos.specs),
most of them mutated once to be invalid. Every one is sent to kube-apiserver as a server-side dry run: it is
either rejected with a 4xx naming the spec field (always, for a mutation the schema alone forbids), or accepted.
A sample of the accepted ones is then created for real in a namespace the session's operator watches (pods only
on kwok nodes): each must be reported through a Ready condition with a reason for its generation, the operator
must stay up, and a valid TrainingJob created in the middle of the storm must still become Ready.
`make chaos` runs the same at a larger scale (bench/chaos.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
from kubernetes import client

from loom.e2e.chaos.admission import Outcome, Tally, submit_all
from loom.e2e.chaos.specs import cases
from loom.e2e.chaos.storm import sample, storm
from loom.e2e.pytest_operator import OperatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]

KINDS = ("TrainingJob", "InferenceService", "InferenceGraph", "FeatureView")
DRY_RUN_PER_KIND = 500
CREATED_PER_KIND = 8
SEED = 15


@pytest.fixture(scope="module")
def dry_run_outcomes(loom_operator: OperatorProcess, kube_api: client.ApiClient) -> Iterator[dict[str, list[Outcome]]]:
    """Every kind's cases sent as dry runs (the CRDs come with the session's operator) in a throwaway namespace."""
    core = client.CoreV1Api(kube_api)
    name = f"{loom_operator.namespace_prefix}-dry{int(time.time()) % 100000}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        outcomes = {}
        for kind in KINDS:
            drawn = cases(kind, DRY_RUN_PER_KIND, seed=SEED)
            names = (f"{kind.lower()}-{i}" for i in itertools.count())
            outcomes[kind] = submit_all(kube_api, name, zip(names, drawn, strict=False), dry_run=True)
        yield outcomes
    finally:
        core.delete_namespace(name)


def test_every_fuzzed_object_is_rejected_with_a_field_path_or_accepted(
    dry_run_outcomes: dict[str, list[Outcome]],
) -> None:
    tallies = []
    for kind, outcomes in dry_run_outcomes.items():
        tally = Tally(kind)
        for outcome in outcomes:
            tally.add(outcome)
        print(f"[chaos fuzz] {tally.line()}")
        tallies.append(tally)
    problems = [p for t in tallies for p in t.problems]
    assert not problems, "\n".join(problems[:40])
    for tally in tallies:
        assert tally.total >= DRY_RUN_PER_KIND
        # Both paths were exercised: plenty of objects accepted (the valid ones all of them), plenty refused.
        assert tally.accepted["valid"] >= 50
        assert sum(tally.rejected.values()) >= 150


def test_the_operator_reports_every_accepted_object_and_keeps_reconciling(
    kube_api: client.ApiClient,
    loom_operator: OperatorProcess,
    operator_namespace: str,
    dry_run_outcomes: dict[str, list[Outcome]],
) -> None:
    objects = sample(dry_run_outcomes, CREATED_PER_KIND)
    assert len(objects) == CREATED_PER_KIND * len(KINDS)
    log_start = loom_operator.log.stat().st_size
    result = storm(kube_api, operator_namespace, objects, timeout_s=120)
    assert not result.refused, result.refused  # the tamed objects stay valid (a 409 would mean a name clash)
    print(
        f"[chaos fuzz] {len(result.created)} fuzzed objects created for real: all reported after "
        f"{result.reported_s}s, the valid TrainingJob Ready after {result.sentinel_ready_s}s; reasons {result.reasons}"
    )
    if result.pending:
        waiting = set(result.pending)
        specs = {f"{o.case.kind}/{o.name}": o.case.spec for o in result.created if (o.case.kind, o.name) in waiting}
        lines = [ln for ln in loom_operator.log_tail(3000).splitlines() if any(n in ln for _, n in result.pending)]
        raise AssertionError(f"not reported: {result.pending}\nspecs {specs}\nlog:\n" + "\n".join(lines[-40:]))
    assert result.sentinel_ready_s is not None, "the valid TrainingJob created mid-storm never became Ready"
    assert loom_operator.process.poll() is None, loom_operator.log_tail()
    with open(loom_operator.log, "rb") as log:
        log.seek(log_start)
        window = log.read().decode(errors="replace")
    # A refused child is reported (ChildRejected) but still logged with its traceback; anything else is a crash.
    crashes = [block for block in window.split("Traceback")[1:] if "ApiException: (422)" not in block]
    assert not crashes, "Traceback" + crashes[0][:4000]
