"""Graph execution over a scripted caller: node types, Soft/Hard, timeouts, deadline and error shapes."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from typing import Any

import pytest

from loom.workloads.router.engine import GraphEngine
from loom.workloads.router.errors import GraphError
from loom.workloads.router.payload import Payload
from loom.workloads.router.testing import (
    FakeCaller,
    answers,
    echo_text,
    fails,
    graph,
    hangs,
    infer_request,
    scale,
)
from loom.workloads.router.upstream import Stream


def outputs(payload: Any) -> dict[str, list[Any]]:
    assert isinstance(payload, Payload)
    return {o["name"]: o["data"] for o in payload.doc()["outputs"]}


async def run(engine: GraphEngine, request: Payload | None = None, **kwargs: Any) -> Any:
    return await engine.run(request or infer_request(1.0, 2.0), "infer", {}, **kwargs)


async def failure(engine: GraphEngine, request: Payload | None = None, **kwargs: Any) -> GraphError:
    with pytest.raises(GraphError) as caught:
        await run(engine, request, **kwargs)
    return caught.value


# --- Sequence -----------------------------------------------------------------------------------


async def test_sequence_chains_responses_and_passes_the_request_unchanged() -> None:
    caller = FakeCaller({"a": scale(2), "b": scale(10), "c": scale(3)})
    config = graph({"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "a"},
        {"serviceName": "b", "data": "$response"},
        {"serviceName": "c", "data": "$request"},
    ]}}, ["a", "b", "c"])
    request = infer_request(1.0, 2.0, id="req-1")
    outcome = await GraphEngine(config, caller).run(request, "infer", {})

    assert caller.services() == ["a", "b", "c"]
    assert caller.calls[0].payload is request  # the caller's bytes, untouched
    # b got a's response as an OIP request: outputs became inputs.
    assert caller.calls[1].doc == {"inputs": [{"name": "y", "datatype": "FP64", "shape": [2], "data": [2.0, 4.0]}]}
    assert caller.calls[2].payload is request
    assert outputs(outcome.value) == {"y": [3.0, 6.0]}
    assert [(s.step, s.outcome) for s in outcome.steps] == [("a", "ok"), ("b", "ok"), ("c", "ok")]


async def test_sequence_step_with_false_condition_is_not_taken() -> None:
    caller = FakeCaller({"a": scale(2), "b": scale(10)})
    config = graph({"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "a"},
        {"serviceName": "b", "data": "$response", "condition": "response.outputs[0].data[0] > 100.0"},
    ]}}, ["a", "b"])
    outcome = await run(GraphEngine(config, caller))
    assert caller.services() == ["a"]
    assert outputs(outcome.value) == {"y": [2.0, 4.0]}
    assert [(s.step, s.outcome) for s in outcome.steps] == [("a", "ok"), ("b", "not_taken")]


async def test_soft_failure_is_recorded_and_skipped_hard_failure_aborts() -> None:
    config = graph({"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "a"},
        {"serviceName": "flaky", "data": "$response", "dependency": "Soft"},
        {"serviceName": "b", "data": "$response"},
    ]}}, ["a", "flaky", "b"])
    caller = FakeCaller({"a": scale(2), "flaky": fails(500), "b": scale(10)})
    outcome = await run(GraphEngine(config, caller))
    # b got a's response: the failed Soft step is as if it had not run.
    assert caller.calls[2].doc["inputs"][0]["data"] == [2.0, 4.0]
    assert outputs(outcome.value) == {"y": [20.0, 40.0]}
    assert [(s.step, s.outcome) for s in outcome.steps] == [("a", "ok"), ("flaky", "skipped"), ("b", "ok")]
    assert [e.step for e in outcome.skipped] == ["flaky"]

    hard = graph({"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "a"},
        {"serviceName": "flaky", "data": "$response", "dependency": "Hard"},
        {"serviceName": "b", "data": "$response"},
    ]}}, ["a", "flaky", "b"])
    caller = FakeCaller({"a": scale(2), "flaky": fails(500, "CUDA out of memory"), "b": scale(10)})
    error = await failure(GraphEngine(hard, caller))
    assert caller.services() == ["a", "flaky"]
    doc = error.to_json("g")
    assert doc["code"] == "upstream_error" and error.status == 502
    assert (doc["node"], doc["step"], doc["service"]) == ("root", "flaky", "flaky")
    assert (doc["upstream_status"], doc["upstream_message"]) == (500, "CUDA out of memory")
    assert "CUDA out of memory" in doc["error"] and "'flaky'" in doc["error"]
    assert [(s["step"], s["outcome"]) for s in doc["steps"]] == [("a", "ok"), ("flaky", "failed")]


async def test_soft_failure_never_turns_into_an_echo_of_the_request() -> None:
    config = graph({"root": {"routerType": "Sequence", "steps": [{"serviceName": "a", "dependency": "Soft"}]}}, ["a"])
    error = await failure(GraphEngine(config, FakeCaller({"a": fails(500)})))
    assert (error.code, error.status, error.step) == ("upstream_error", 502, "a")


async def test_sequence_where_no_condition_holds_is_no_route() -> None:
    config = graph({"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "a", "condition": "false"}]}}, ["a"])
    error = await failure(GraphEngine(config, FakeCaller({"a": scale(2)})))
    assert (error.code, error.status) == ("no_route", 404)


# --- Switch -------------------------------------------------------------------------------------

SWITCH = {"root": {"routerType": "Switch", "steps": [
    {"serviceName": "small", "condition": "request.inputs[0].data[0] < 10.0"},
    {"serviceName": "large", "condition": "request.inputs[0].data[0] >= 10.0 && request.inputs[0].data[0] < 100.0"},
]}}


async def test_switch_takes_the_first_step_whose_condition_holds() -> None:
    config = graph(SWITCH, ["small", "large"])
    caller = FakeCaller({"small": scale(1, "small"), "large": scale(1, "large")})
    engine = GraphEngine(config, caller)
    assert outputs((await run(engine, infer_request(5.0))).value) == {"small": [5.0]}
    outcome = await run(engine, infer_request(50.0))
    assert outputs(outcome.value) == {"large": [50.0]}
    assert [(s.step, s.outcome) for s in outcome.steps] == [("small", "not_taken"), ("large", "ok")]
    assert caller.services() == ["small", "large"]


async def test_switch_without_a_match_is_a_structured_404_never_a_pass_through() -> None:
    caller = FakeCaller({"small": scale(1), "large": scale(1)})
    error = await failure(GraphEngine(graph(SWITCH, ["small", "large"]), caller), infer_request(500.0))
    doc = error.to_json("g")
    assert (error.status, doc["code"], doc["node"]) == (404, "no_route", "root")
    assert "request.inputs[0].data[0] < 10.0" in doc["error"]
    assert [s["outcome"] for s in doc["steps"]] == ["not_taken", "not_taken"]
    assert caller.calls == []


async def test_switch_step_without_condition_is_the_default() -> None:
    nodes = {"root": {"routerType": "Switch", "steps": [
        {"serviceName": "small", "condition": "request.inputs[0].data[0] < 10.0"},
        {"serviceName": "fallback"},
    ]}}
    caller = FakeCaller({"small": scale(1, "small"), "fallback": scale(1, "fallback")})
    outcome = await run(GraphEngine(graph(nodes, ["small", "fallback"]), caller), infer_request(500.0))
    assert outputs(outcome.value) == {"fallback": [500.0]}


async def test_condition_failing_on_a_request_is_a_400_naming_the_step() -> None:
    nodes = {"root": {"routerType": "Switch", "steps": [
        {"serviceName": "a", "name": "by-route", "condition": "request.parameters.route == 'a'"}]}}
    error = await failure(GraphEngine(graph(nodes, ["a"]), FakeCaller({"a": scale(1)})))
    assert (error.code, error.status, error.node, error.step) == ("condition_error", 400, "root", "by-route")
    assert "request.parameters.route == 'a'" in error.message


async def test_conditions_see_the_previous_response_inside_a_sequence() -> None:
    nodes = {
        "root": {"routerType": "Sequence", "steps": [
            {"serviceName": "classify"}, {"nodeName": "route", "data": "$response"}]},
        "route": {"routerType": "Switch", "steps": [
            {"serviceName": "positive", "data": "$request", "condition": "response.outputs[0].data[0] > 0.5"},
            {"serviceName": "negative", "data": "$request"},
        ]},
    }
    caller = FakeCaller({"classify": answers({"outputs": [{"name": "p", "datatype": "FP64", "shape": [1],
                                                            "data": [0.9]}]}),
                         "positive": scale(1, "pos"), "negative": scale(1, "neg")})
    outcome = await run(GraphEngine(graph(nodes, ["classify", "positive", "negative"]), caller), infer_request(3.0))
    assert outputs(outcome.value) == {"pos": [3.0]}
    assert [(s.node, s.step, s.outcome) for s in outcome.steps] == [
        ("root", "classify", "ok"), ("route", "positive", "ok"), ("root", "route", "ok")]


async def test_a_request_that_is_not_json_fails_a_condition_as_bad_request() -> None:
    nodes = {"root": {"routerType": "Switch", "steps": [{"serviceName": "a", "condition": "true"}]}}
    error = await failure(GraphEngine(graph(nodes, ["a"]), FakeCaller({"a": scale(1)})), Payload(b"\x00not json"))
    assert (error.code, error.status) == ("bad_request", 400)


# --- Ensemble -----------------------------------------------------------------------------------


async def test_ensemble_runs_steps_in_parallel_and_names_outputs_by_step() -> None:
    both_started = asyncio.Event()
    started: list[str] = []

    def gated(name: str, factor: float) -> Any:
        inner = scale(factor)

        async def handler(doc: Any) -> Any:
            started.append(name)
            if len(started) == 2:
                both_started.set()
            await both_started.wait()  # only returns once the other step is running too
            return await inner(doc)

        return handler

    nodes = {"root": {"routerType": "Ensemble", "steps": [
        {"serviceName": "a", "name": "double"}, {"serviceName": "b", "name": "triple"}]}}
    caller = FakeCaller({"a": gated("a", 2), "b": gated("b", 3)})
    outcome = await run(GraphEngine(graph(nodes, ["a", "b"]), caller), infer_request(1.0, 2.0, id="r7"))
    doc = outcome.value.doc()
    assert doc["model_name"] == "g" and doc["id"] == "r7"
    assert outputs(outcome.value) == {"double/y": [2.0, 4.0], "triple/y": [3.0, 6.0]}


async def test_ensemble_soft_failure_leaves_the_step_out_hard_failure_fails() -> None:
    nodes = {"root": {"routerType": "Ensemble", "steps": [
        {"serviceName": "a"}, {"serviceName": "b", "dependency": "Soft"}]}}
    outcome = await run(GraphEngine(graph(nodes, ["a", "b"]), FakeCaller({"a": scale(2), "b": fails(500)})))
    assert outputs(outcome.value) == {"a/y": [2.0, 4.0]}
    assert sorted((s.step, s.outcome) for s in outcome.steps) == [("a", "ok"), ("b", "skipped")]

    nodes["root"]["steps"][1]["dependency"] = "Hard"
    error = await failure(GraphEngine(graph(nodes, ["a", "b"]), FakeCaller({"a": hangs(), "b": fails(503)})))
    # The Hard failure cancels the step still running and answers at once.
    assert (error.code, error.status, error.step) == ("upstream_error", 503, "b")


async def test_ensemble_keeps_binary_tensors_binary() -> None:
    def binary(value: bytes) -> Any:
        header = json.dumps({"outputs": [{"name": "raw", "datatype": "UINT8", "shape": [len(value)],
                                          "parameters": {"binary_data_size": len(value)}}]}).encode()
        return answers(Payload(header + value, "application/octet-stream", len(header), "response"))

    nodes = {"root": {"routerType": "Ensemble", "steps": [{"serviceName": "a"}, {"serviceName": "b"}]}}
    outcome = await run(GraphEngine(graph(nodes, ["a", "b"]), FakeCaller({"a": binary(b"\x01\x02"),
                                                                         "b": binary(b"\x03")})))
    value = outcome.value
    assert [o["name"] for o in value.doc()["outputs"]] == ["a/raw", "b/raw"]
    assert value.tail == b"\x01\x02\x03"
    assert value.http_headers()["inference-header-content-length"] == str(value.header_length)


async def test_ensemble_of_a_non_oip_answer_is_a_bad_upstream_response() -> None:
    nodes = {"root": {"routerType": "Ensemble", "steps": [{"serviceName": "a"}]}}
    error = await failure(GraphEngine(graph(nodes, ["a"]), FakeCaller({"a": answers({"result": 1})})))
    assert (error.code, error.status, error.node) == ("bad_upstream_response", 502, "root")


# --- Splitter -----------------------------------------------------------------------------------


async def test_splitter_draws_by_weight_from_the_injected_rng() -> None:
    nodes = {"root": {"routerType": "Splitter", "steps": [
        {"serviceName": "a", "weight": 80}, {"serviceName": "b", "weight": 20}, {"serviceName": "c", "weight": 0}]}}
    caller = FakeCaller({"a": scale(1), "b": scale(1), "c": scale(1)})
    engine = GraphEngine(graph(nodes, ["a", "b", "c"]), caller, rng=random.Random(7))
    for _ in range(1000):
        await run(engine)
    expected_rng = random.Random(7)
    expected = Counter(expected_rng.choices("abc", weights=[80, 20, 0])[0] for _ in range(1000))
    counts = Counter(caller.services())
    assert counts == expected
    assert counts["c"] == 0
    assert 740 <= counts["a"] <= 860  # 80 % within about four standard deviations


async def test_splitter_reports_its_choice_per_step_in_metrics() -> None:
    nodes = {"root": {"routerType": "Splitter", "steps": [
        {"serviceName": "a", "weight": 100}, {"serviceName": "b", "weight": 0}]}}
    engine = GraphEngine(graph(nodes, ["a", "b"]), FakeCaller({"a": scale(1), "b": scale(1)}))
    for _ in range(3):
        await run(engine)
    assert engine.metrics.registry.get_sample_value(
        "loom_router_route_total", {"graph": "g", "node": "root", "step": "a"}) == 3


# --- nested nodes, timeouts, deadline, upstream errors ------------------------------------------


async def test_a_step_can_run_another_node() -> None:
    nodes = {
        "root": {"routerType": "Sequence", "steps": [
            {"serviceName": "a"}, {"nodeName": "fanout", "data": "$response"}]},
        "fanout": {"routerType": "Ensemble", "steps": [
            {"serviceName": "b", "data": "$response"}, {"serviceName": "c", "data": "$request"}]},
    }
    caller = FakeCaller({"a": scale(2), "b": scale(10), "c": scale(100)})
    outcome = await run(GraphEngine(graph(nodes, ["a", "b", "c"]), caller), infer_request(1.0))
    # Inside the nested node $response is the node's input (a's answer), $request the graph's request.
    assert outputs(outcome.value) == {"b/y": [20.0], "c/y": [100.0]}
    assert [(s.node, s.step) for s in outcome.steps if s.outcome == "ok"][-1] == ("root", "fanout")


async def test_step_timeout_is_a_504_and_soft_steps_are_skipped_after_it() -> None:
    nodes = {"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "a"}, {"serviceName": "slow", "data": "$response", "timeoutMs": 20, "dependency": "Hard"}]}}
    error = await failure(GraphEngine(graph(nodes, ["a", "slow"]), FakeCaller({"a": scale(2), "slow": hangs()})))
    assert (error.code, error.status, error.step) == ("step_timeout", 504, "slow")
    assert "20 ms" in error.message

    nodes["root"]["steps"][1]["dependency"] = "Soft"
    outcome = await run(GraphEngine(graph(nodes, ["a", "slow"]), FakeCaller({"a": scale(2), "slow": hangs()})))
    assert outputs(outcome.value) == {"y": [2.0, 4.0]}


async def test_the_overall_deadline_stops_the_graph_even_for_soft_steps() -> None:
    nodes = {"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "a"}, {"serviceName": "slow", "data": "$response", "dependency": "Soft"},
        {"serviceName": "b"}]}}
    config = graph(nodes, ["a", "slow", "b"], deadlineMs=30, stepTimeoutMs=60_000)
    caller = FakeCaller({"a": scale(2), "slow": hangs(), "b": scale(1)})
    # A frozen clock: however slow this machine, `a` starts with the whole 30 ms left, and `slow`
    # hangs until the deadline's 30 ms of real time have passed.
    error = await failure(GraphEngine(config, caller, clock=lambda: 0.0))
    assert (error.code, error.status, error.step) == ("deadline_exceeded", 504, "slow")
    assert caller.services() == ["a", "slow"]


async def test_deadline_passed_before_a_step_starts() -> None:
    now = [0.0]
    inner = scale(2)

    async def slow_a(doc: Any) -> Any:
        now[0] += 5.0  # a took five seconds of a one-second deadline (the step timeout is longer)
        return await inner(doc)

    nodes = {"root": {"routerType": "Sequence", "steps": [{"serviceName": "a"}, {"serviceName": "b"}]}}
    config = graph(nodes, ["a", "b"], deadlineMs=1000)
    caller = FakeCaller({"a": slow_a, "b": scale(1)})
    error = await failure(GraphEngine(config, caller, clock=lambda: now[0]))
    assert (error.code, error.step) == ("deadline_exceeded", "b")
    assert caller.services() == ["a"]


@pytest.mark.parametrize(
    ("handler", "code", "status", "upstream_status"),
    [
        (fails(500), "upstream_error", 502, 500),
        (fails(404, "model 'a' not found"), "upstream_error", 502, 404),
        (fails(400, "input 'x': bad shape"), "upstream_error", 400, 400),
        (fails(401, "a valid API key is required"), "upstream_error", 401, 401),
        (fails(429, "rate limit exceeded"), "upstream_error", 429, 429),
        (fails(503, "not ready"), "upstream_error", 503, 503),
        (fails(None, "cannot reach a: ConnectError"), "upstream_unreachable", 502, None),
        (answers({"error": "predict failed"}), "upstream_error_body", 502, 200),
    ],
)
async def test_upstream_errors_map_to_statuses(
    handler: Any, code: str, status: int, upstream_status: int | None
) -> None:
    config = graph({"root": {"routerType": "Sequence", "steps": [{"serviceName": "a"}]}}, ["a"])
    error = await failure(GraphEngine(config, FakeCaller({"a": handler})))
    assert (error.code, error.status, error.upstream_status) == (code, status, upstream_status)


async def test_retry_after_of_an_upstream_is_passed_on() -> None:
    config = graph({"root": {"routerType": "Sequence", "steps": [{"serviceName": "a"}]}}, ["a"])
    error = await failure(GraphEngine(config, FakeCaller({"a": fails(503, "queue full", {"retry-after": "1"})})))
    assert error.headers == {"retry-after": "1"}


# --- generate and streaming ---------------------------------------------------------------------


async def test_generate_chains_text_and_only_the_last_step_streams() -> None:
    nodes = {"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "a"}, {"serviceName": "b", "data": "$response"}]}}
    caller = FakeCaller({"a": echo_text("-a"), "b": echo_text("-b")})
    request = Payload(json.dumps({"text_input": "hi", "parameters": {"max_tokens": 5}}).encode())
    outcome = await GraphEngine(graph(nodes, ["a", "b"]), caller).run(request, "generate", {}, stream=True)
    assert [(c.service, c.endpoint) for c in caller.calls] == [("a", "generate"), ("b", "generate_stream")]
    assert caller.calls[1].doc == {"text_input": "hi-a", "parameters": {"max_tokens": 5}}
    assert isinstance(outcome.value, Stream)
    chunks = [chunk async for chunk in outcome.value.chunks()]
    assert len(chunks) == len("hi-a-b")
    assert "".join(json.loads(c[len(b"data: "):])["text_output"] for c in chunks) == "hi-a-b"


async def test_generate_ensemble_names_texts_by_step() -> None:
    nodes = {"root": {"routerType": "Ensemble", "steps": [{"serviceName": "a"}, {"serviceName": "b"}]}}
    request = Payload(json.dumps({"text_input": "hi"}).encode())
    engine = GraphEngine(graph(nodes, ["a", "b"]), FakeCaller({"a": echo_text("-a"), "b": echo_text("-b")}))
    outcome = await engine.run(request, "generate", {})
    assert outcome.value.doc() == {"model_name": "g", "text_outputs": {"a": "hi-a", "b": "hi-b"}}


async def test_step_metrics_count_latency_and_errors_per_step() -> None:
    config = graph({"root": {"routerType": "Sequence", "steps": [
        {"serviceName": "a"}, {"serviceName": "b", "dependency": "Soft"}]}}, ["a", "b"])
    engine = GraphEngine(config, FakeCaller({"a": scale(2), "b": fails(500)}))
    await run(engine)
    sample = engine.metrics.registry.get_sample_value
    assert sample("loom_router_step_duration_seconds_count",
                  {"graph": "g", "node": "root", "step": "a", "target": "a"}) == 1
    assert sample("loom_router_step_errors_total", {"graph": "g", "node": "root", "step": "b",
                                                    "code": "upstream_error", "dependency": "Soft"}) == 1
    assert sample("loom_router_node_duration_seconds_count",
                  {"graph": "g", "node": "root", "router_type": "Sequence"}) == 1
