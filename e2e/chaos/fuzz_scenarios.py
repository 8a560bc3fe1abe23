"""`make chaos` scenarios for fuzzed input (issue 15): specs against the API server and the operator, requests
against a model server and a router. The e2e and integration tests run the same at a smaller scale."""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
from hypothesis import HealthCheck, Phase, given, settings

from loom.devstack.servers import free_port
from loom.e2e.pytest_operator import apply_crds, operator_namespace_for, operator_process
from loom.workloads.server.testing import model_server, running

from .admission import Outcome, Tally, submit
from .bodies import ALL, Probe, good_infer, problem
from .registry import Figures, Run, scenario
from .specs import cases
from .storm import sample, storm

KINDS = ("TrainingJob", "InferenceService", "InferenceGraph", "FeatureView")


@scenario("fuzz-specs", "hypothesis-generated specs (most mutated to be invalid) against admission and the operator")
def fuzz_specs(run: Run) -> Figures:
    per_kind, created_per_kind = (500, 8) if run.scale == "test" else (2000, 25)
    figures: Figures = {}
    problems: list[str] = []
    latencies: list[float] = []
    apply_crds(run.cluster)
    with (
        run.cluster.api_client() as api,
        operator_process(run.cluster, run.workdir / "fuzz-specs-operator.log") as op,
        operator_namespace_for(run.cluster, op) as dry_ns,
    ):
        outcomes: dict[str, list[Outcome]] = {}
        for kind in KINDS:
            drawn = cases(kind, per_kind, seed=15)
            results = []
            for index, case in enumerate(drawn):
                started = time.perf_counter()
                results.append(submit(api, dry_ns, case, f"{kind.lower()}-{index}", dry_run=True))
                latencies.append((time.perf_counter() - started) * 1000)
            outcomes[kind] = results
            tally = Tally(kind)
            for outcome in results:
                tally.add(outcome)
            figures[f"{kind} sent / accepted (valid) / rejected"] = (
                f"{tally.total} / {sum(tally.accepted.values())} ({tally.accepted['valid']}) / "
                f"{sum(tally.rejected.values())}"
            )
            problems += tally.problems
        figures["admission_ms"] = latencies
        with operator_namespace_for(run.cluster, op) as ns:
            result = storm(api, ns, sample(outcomes, created_per_kind), timeout_s=300)
        figures["created for real"] = len(result.created)
        figures["all reported after (s)"] = None if result.reported_s is None else round(result.reported_s, 1)
        figures["valid TrainingJob Ready after (s)"] = (
            None if result.sentinel_ready_s is None else round(result.sentinel_ready_s, 1)
        )
        figures["Ready reasons"] = dict(sorted(result.reasons.items()))
        problems += [f"refused: {r}" for r in result.refused]
        problems += [f"never reported: {kind}/{name}" for kind, name in result.pending]
        if result.sentinel_ready_s is None:
            problems.append("the valid TrainingJob created mid-storm never became Ready")
        if op.process.poll() is not None:
            problems.append(f"the operator exited with {op.process.returncode}")
    figures["problems"] = problems
    return figures


def _pid_of(config: Path) -> int:
    for child in psutil.Process().children(recursive=True):
        if str(config) in " ".join(child.cmdline()):
            return int(child.pid)
    raise LookupError(config)


def _fuzz_target(url: str, model: str, pid: int, examples: int, figures: Figures, label: str) -> list[str]:
    problems: list[str] = []
    good_ms: list[float] = []
    good_failures: list[str] = []
    stop = threading.Event()

    def good_traffic() -> None:
        with httpx.Client(timeout=30) as client:
            for n in itertools.count(1):
                if stop.is_set():
                    return
                started = time.perf_counter()
                try:
                    answer = client.post(f"{url}/v2/models/{model}/infer", json=good_infer(n))
                    if answer.status_code != 200 or answer.json()["outputs"][0]["data"] != [n]:
                        good_failures.append(f"{answer.status_code} {answer.text[:100]}")
                except httpx.HTTPError as error:
                    good_failures.append(repr(error))
                good_ms.append((time.perf_counter() - started) * 1000)
                time.sleep(0.005)

    rss_before = psutil.Process(pid).memory_info().rss
    thread = threading.Thread(target=good_traffic, daemon=True)
    thread.start()
    families: dict[str, int] = {}
    try:
        with httpx.Client(timeout=30) as client:

            @settings(max_examples=examples, database=None, phases=[Phase.generate], deadline=None,
                      suppress_health_check=list(HealthCheck))
            @given(probe=ALL)
            def probe_once(probe: Probe) -> None:
                families[probe.family] = families.get(probe.family, 0) + 1
                answer = client.post(f"{url}/v2/models/{model}/{probe.endpoint}", content=probe.body,
                                     headers={"content-type": "application/json", **probe.headers})
                issue = problem(probe, answer.status_code, answer.content)
                if issue:
                    problems.append(issue)

            probe_once()
            for _ in range(5):  # huge bodies: 256 MiB declared, and 96 MiB streamed without a length
                declared = client.post(f"{url}/v2/models/{model}/infer", content=b"x" * (256 * 2**20))
                streamed = client.post(f"{url}/v2/models/{model}/infer",
                                       content=(b"7" * 2**20 for _ in range(96)))
                for answer in (declared, streamed):
                    families["huge-body"] = families.get("huge-body", 0) + 1
                    if answer.status_code != 413:
                        problems.append(f"huge body: {answer.status_code}")
    finally:
        stop.set()
        thread.join(timeout=30)
    grown = psutil.Process(pid).memory_info().rss - rss_before
    figures[f"{label} fuzzed requests"] = dict(sorted(families.items()))
    figures[f"{label} bad answers"] = len(problems)
    figures[f"{label} memory growth (MiB)"] = round(grown / 2**20, 1)
    figures[f"{label} good requests / failed"] = f"{len(good_ms)} / {len(good_failures)}"
    figures[f"{label}_good_ms"] = good_ms
    if grown > 256 * 2**20:
        problems.append(f"{label} memory grew by {grown / 2**20:.0f} MiB")
    return problems + [f"good request failed: {f}" for f in good_failures[:20]]


@scenario("fuzz-requests", "malformed, mistyped, lying, huge bodies to a model server and a router; good traffic too")
def fuzz_requests(run: Run) -> Figures:
    examples = 150 if run.scale == "test" else 2000
    figures: Figures = {}
    problems: list[str] = []
    folder = run.workdir / "fuzz-requests"
    folder.mkdir(parents=True, exist_ok=True)
    server_config, router_config, router_port = folder / "server.json", folder / "router.json", free_port()
    server_config.write_text(json.dumps({"modelName": "echo", "handler": "noop", "storageUri": str(folder),
                                         "host": "127.0.0.1", "port": free_port()}))
    with model_server(server_config, folder / "server.log") as server_url:
        router_config.write_text(json.dumps({
            "graphName": "g", "host": "127.0.0.1", "port": router_port,
            "services": {"echo": {"url": server_url, "modelName": "echo"}},
            "nodes": {"root": {"routerType": "Switch", "steps": [
                {"serviceName": "echo", "condition": 'has(request.parameters) && request.parameters.route == "a"'},
                {"serviceName": "echo"},
            ]}},
        }))
        argv = [sys.executable, "-m", "loom.workloads.router", "--config", str(router_config)]
        router_url = f"http://127.0.0.1:{router_port}"
        with running(argv, router_url, folder / "router.log"):
            problems += _fuzz_target(server_url, "echo", _pid_of(server_config), examples, figures, "server")
            problems += _fuzz_target(router_url, "g", _pid_of(router_config), examples, figures, "router")
    for log in ("server.log", "router.log"):
        if "Traceback" in (folder / log).read_text():
            problems.append(f"a traceback in {log}")
    figures["problems"] = problems
    return figures
