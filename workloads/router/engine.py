"""Graph execution: pure asyncio over a :class:`Caller`, no HTTP server code.

Semantics (the README has the user-facing version):

- A step's input is ``$request``, the graph's request, at any depth, or ``$response``: inside a
  Sequence the previous step's result (for the first step, the node's input), in the other node
  types the node's input. So a nested node reached with a response can still route the caller's
  original request (classify, then send the request where the class says), and works on the
  response with ``$response``. A step calls a service or runs another node on its input.
- Sequence: the steps in order, each with a condition (if any) deciding whether it runs; the node's
  result is the last result. Switch: the first step whose condition holds (a step without one is the
  default); none holds -> ``no_route`` (404). Ensemble: the steps whose conditions hold, in parallel;
  results combined by step name (:mod:`payload`). Splitter: one step, drawn by weight from ``rng``.
- A failing step with ``dependency: Hard`` fails the graph; a ``Soft`` one is recorded (outcome
  ``skipped``) and the node goes on as if it had not run: a Sequence passes the data on unchanged,
  an Ensemble leaves it out, a Switch or Splitter yields its input. A graph whose answer would then
  be the caller's own request (nothing produced an answer) fails with the last skipped error
  instead: a Soft step never turns into a silent echo. ``deadline_exceeded`` and ``condition_error``
  always stop the graph.
- Timeouts: each call gets ``min(step timeout, time left until the graph's deadline)``.
- OpenAI chat (steps with ``protocol: openai-chat``, endpoint ``chat``): the same, over
  ``/v1/chat/completions``; how a chat answer feeds the next step is :mod:`openai_chat`'s.
- Streaming (generate_stream, or a chat request with ``stream: true``): only the step in the last
  position streams, i.e. the last step of the root node, recursively through nested nodes; every
  earlier step runs the non-streaming ``generate`` endpoint (or chat with ``stream: false``) and its
  complete text feeds the next step. The streaming step's events are
  passed on as they arrive. A graph whose last position is an Ensemble, or a skipped step, ends with a
  complete body, which the HTTP layer sends as one event.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

from .conditions import Condition, ConditionEvalError, compile_conditions
from .config import ROOT, NodeConfig, RouterConfig, StepConfig
from .errors import GraphError, StepOutcome, StepRecord, status_for_upstream
from .metrics import RouterMetrics
from .openai_chat import chat_request
from .payload import (
    Endpoint,
    Payload,
    PayloadError,
    as_request,
    combine_generate,
    combine_infer,
    error_message,
    request_id,
)
from .prompt import PromptError
from .retrieval import Retrieval, RetrievalFailed, Retriever, augment
from .upstream import Caller, Stream, UpstreamFailure

Result: TypeAlias = Payload | Stream


@dataclass
class Run:
    """One request's pass through the graph."""

    request: Payload
    endpoint: Endpoint
    headers: Mapping[str, str]
    deadline: float
    stream: bool
    steps: list[StepRecord] = field(default_factory=list)
    skipped: list[GraphError] = field(default_factory=list)
    retrieval: Retrieval | None = None  # the last retrieval step's, named in the response


@dataclass
class Outcome:
    value: Result
    steps: list[StepRecord]
    skipped: list[GraphError]
    retrieval: Retrieval | None = None


def _soft(step: StepConfig, error: GraphError) -> bool:
    return step.dependency == "Soft" and not error.fatal


class GraphEngine:
    def __init__(
        self,
        config: RouterConfig,
        caller: Caller,
        conditions: dict[tuple[str, int], Condition] | None = None,
        rng: random.Random | None = None,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        retriever: Retriever | None = None,
    ):
        if retriever is None and any(s.retrieve for n in config.nodes.values() for s in n.steps):
            raise ValueError("a graph with retrieve steps needs a retriever")
        self.config = config
        self.caller = caller
        self.retriever = retriever
        self.conditions = compile_conditions(config) if conditions is None else conditions
        self.rng = rng or random.Random()
        self.metrics = metrics or RouterMetrics(config.graph_name)
        self.clock = clock

    async def run(
        self, request: Payload, endpoint: Endpoint, headers: Mapping[str, str], stream: bool = False
    ) -> Outcome:
        """Execute the graph on ``request``; raises GraphError (with the steps that ran) on failure."""
        run = Run(request, endpoint, headers, self.clock() + self.config.deadline_ms / 1000.0, stream)
        try:
            value = await self._node(run, ROOT, request, last=True)
            if isinstance(value, Payload) and value.origin == "request":
                if run.skipped:
                    raise run.skipped[-1]
                raise GraphError("no_route", 404, "no step ran: every step's condition was false", node=ROOT)
        except GraphError as exc:
            exc.steps = run.steps
            raise
        return Outcome(value, run.steps, run.skipped, run.retrieval)

    async def _node(self, run: Run, name: str, data: Payload, last: bool) -> Result:
        node = self.config.nodes[name]
        started = self.clock()
        code: str | None = None
        try:
            if node.router_type == "Sequence":
                return await self._sequence(run, name, node, data, last)
            if node.router_type == "Ensemble":
                return await self._ensemble(run, name, node, data)
            if node.router_type == "Switch":
                index = self._switch_choice(run, name, node, data)
            else:
                index = self._splitter_choice(node)
            step = node.steps[index]
            self.metrics.routed(name, step.label)
            try:
                return await self._step(run, name, step, data, last)
            except GraphError as exc:
                if not _soft(step, exc):
                    raise
                run.skipped.append(exc)
                return data
        except GraphError as exc:
            code = exc.code
            raise
        finally:
            self.metrics.node_done(name, node.router_type, self.clock() - started, code)

    async def _sequence(self, run: Run, name: str, node: NodeConfig, data: Payload, last: bool) -> Result:
        current: Result = data
        final = len(node.steps) - 1
        for index, step in enumerate(node.steps):
            assert isinstance(current, Payload)  # only the final step may stream
            if not self._holds(run, name, index, step, current):
                run.steps.append(StepRecord(name, step.label, "not_taken", step.service_name))
                continue
            try:
                current = await self._step(run, name, step, current, last and index == final)
            except GraphError as exc:
                if not _soft(step, exc):
                    raise
                run.skipped.append(exc)
        return current

    def _switch_choice(self, run: Run, name: str, node: NodeConfig, data: Payload) -> int:
        for index, step in enumerate(node.steps):
            if self._holds(run, name, index, step, data):
                return index
            run.steps.append(StepRecord(name, step.label, "not_taken", step.service_name))
        self.metrics.routed(name, "no_route")
        conditions = ", ".join(repr(s.condition) for s in node.steps)
        raise GraphError(
            "no_route", 404, f"no step's condition holds for this request (conditions: {conditions})", node=name
        )

    def _splitter_choice(self, node: NodeConfig) -> int:
        weights = [step.weight or 0 for step in node.steps]
        return self.rng.choices(range(len(node.steps)), weights=weights)[0]

    async def _ensemble(self, run: Run, name: str, node: NodeConfig, data: Payload) -> Payload:
        selected: list[tuple[int, StepConfig]] = []
        for index, step in enumerate(node.steps):
            if self._holds(run, name, index, step, data):
                selected.append((index, step))
            else:
                run.steps.append(StepRecord(name, step.label, "not_taken", step.service_name))
        if not selected:
            raise GraphError("no_route", 404, "no step's condition holds for this request", node=name)
        results: dict[int, Payload] = {}
        failures: list[GraphError] = []

        async def one(index: int, step: StepConfig) -> None:
            try:
                result = await self._step(run, name, step, data, last=False)
            except GraphError as exc:
                if not _soft(step, exc):
                    raise
                run.skipped.append(exc)
                failures.append(exc)
                return
            assert isinstance(result, Payload)
            results[index] = result

        try:
            # A Hard failure cancels the steps still running: the graph's answer is already known.
            async with asyncio.TaskGroup() as group:
                for index, step in selected:
                    group.create_task(one(index, step))
        except ExceptionGroup as grouped:
            errors = [e for e in grouped.exceptions if isinstance(e, GraphError)]
            if len(errors) != len(grouped.exceptions):
                raise
            raise errors[0] from None
        done = [(step.label, results[index]) for index, step in selected if index in results]
        if not done:
            raise failures[0]
        combine = combine_infer if run.endpoint == "infer" else combine_generate
        try:
            return combine(self.config.graph_name, request_id(run.request), done)
        except PayloadError as exc:
            raise GraphError("bad_upstream_response", 502, str(exc), node=name) from exc

    def _holds(self, run: Run, name: str, index: int, step: StepConfig, data: Payload) -> bool:
        condition = self.conditions.get((name, index))
        if condition is None:
            return True
        try:
            request_doc = run.request.doc()
        except PayloadError as exc:
            raise GraphError(
                "bad_request", 400, f"a condition needs the request as JSON: {exc}", node=name, step=step.label
            ) from exc
        try:
            response_doc = request_doc if data is run.request else data.doc()
        except PayloadError as exc:
            raise GraphError(
                "bad_upstream_response", 502, f"a condition needs this node's input as JSON: {exc}",
                node=name, step=step.label,
            ) from exc
        try:
            return condition.holds(request_doc, response_doc)
        except ConditionEvalError as exc:
            raise GraphError(
                "condition_error", 400, f"condition {condition.expression!r} failed on this request: {exc}",
                node=name, step=step.label,
            ) from exc

    async def _step(self, run: Run, node: str, step: StepConfig, current: Payload, last: bool) -> Result:
        data = run.request if step.data == "$request" else current
        target = step.service_name or f"node:{step.node_name}"
        started = self.clock()
        try:
            if step.node_name is not None:
                result = await self._node(run, step.node_name, data, last)
            else:
                result = await self._call(run, node, step, data, last)
        except GraphError as exc:
            seconds = self.clock() - started
            if exc.node is None:
                exc.node, exc.step, exc.service = node, step.label, step.service_name
            outcome: StepOutcome = "skipped" if _soft(step, exc) else "failed"
            run.steps.append(
                StepRecord(node, step.label, outcome, step.service_name, exc.upstream_status, seconds * 1000, exc.code)
            )
            self.metrics.step_done(node, step.label, target, seconds, exc.code, step.dependency)
            raise
        seconds = self.clock() - started
        run.steps.append(StepRecord(node, step.label, "ok", step.service_name, 200, seconds * 1000))
        self.metrics.step_done(node, step.label, target, seconds, None, step.dependency)
        return result

    async def _call(self, run: Run, node: str, step: StepConfig, data: Payload, last: bool) -> Result:
        assert step.service_name is not None
        service = step.service_name
        left = run.deadline - self.clock()
        if left <= 0:
            raise GraphError(
                "deadline_exceeded", 504, f"the graph's deadline of {self.config.deadline_ms} ms passed"
            )
        step_timeout = self.config.step_timeout_s(step)
        streams = last and run.stream
        if run.endpoint == "chat":
            body = chat_request(data, run.request, self.config.services[service].model_name, streams)
            if step.retrieve is not None:
                body = await self._retrieve(run, node, step, body, left)
                left = run.deadline - self.clock()
        else:
            body = as_request(data, run.endpoint, run.request)
        try:
            async with asyncio.timeout(min(step_timeout, left)):
                if streams:
                    stream_endpoint = "chat" if run.endpoint == "chat" else "generate_stream"
                    return await self.caller.stream(service, stream_endpoint, body, run.headers)
                result = await self.caller.call(service, run.endpoint, body, run.headers)
        except TimeoutError as exc:
            if left < step_timeout:
                raise GraphError(
                    "deadline_exceeded", 504, f"the graph's deadline of {self.config.deadline_ms} ms passed"
                ) from exc
            raise GraphError(
                "step_timeout", 504, f"no answer within the step timeout of {step_timeout * 1000:.0f} ms"
            ) from exc
        except UpstreamFailure as exc:
            raise self._upstream_error(exc) from exc
        message = error_message(result)
        if message is not None:
            raise GraphError(
                "upstream_error_body", 502, f"upstream answered 200 with an error body: {message}",
                upstream_status=200, upstream_message=message,
            )
        return result

    async def _retrieve(self, run: Run, node: str, step: StepConfig, body: Payload, left: float) -> Payload:
        """The chat request with the retrieved documents in its prompt (retrieval.py); metrics per step."""
        spec = step.retrieve
        assert spec is not None and self.retriever is not None
        view = spec.feature_view
        doc = body.doc()
        assert isinstance(doc, dict)  # chat_request built it
        started = self.clock()
        try:
            augmented = await augment(
                doc, spec, self.config.stores[view], self.retriever, run.headers, min(spec.timeout_ms / 1000.0, left)
            )
        except PromptError as exc:
            raise GraphError(exc.code, 400, exc.message) from exc
        except RetrievalFailed as exc:
            self.metrics.retrieved(node, step.label, view, self.clock() - started, None, degraded=False)
            code, status = ("retrieval_timeout", 504) if exc.timed_out else ("retrieval_failed", 502)
            raise GraphError(code, status, f"retrieval from FeatureView {view!r} failed: {exc.message}") from exc
        retrieval = augmented.retrieval
        documents = None if retrieval.degraded is not None else len(retrieval.sources)
        self.metrics.retrieved(
            node, step.label, view, self.clock() - started, documents, degraded=retrieval.degraded is not None
        )
        run.retrieval = retrieval
        return Payload.from_doc(augmented.request, origin="request")

    @staticmethod
    def _upstream_error(exc: UpstreamFailure) -> GraphError:
        if exc.status is None:
            return GraphError("upstream_unreachable", 502, exc.message)
        if exc.status == 200:
            return GraphError(
                "upstream_error_body", 502, f"upstream answered 200 with an error event: {exc.message}",
                upstream_status=200, upstream_message=exc.message,
            )
        return GraphError(
            "upstream_error", status_for_upstream(exc.status), f"upstream answered {exc.status}: {exc.message}",
            upstream_status=exc.status, upstream_message=exc.message, headers=exc.headers,
        )
