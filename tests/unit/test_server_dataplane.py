"""The model server's data plane without any transport: lifecycle, metadata, infer, batching,
generate and streaming, each answer a protocol object and each refusal a typed error."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loom.workloads.server.batching import ShuttingDownError
from loom.workloads.server.config import BatchingConfig
from loom.workloads.server.dataplane import DataPlane
from loom.workloads.server.errors import (
    InferenceError,
    InvalidInputError,
    ModelNotFoundError,
    ModelNotReadyError,
    OverloadedError,
    UnavailableError,
)
from loom.workloads.server.model import InferRequest, InferResponse, Model, ModelError, Tensor, TensorSpec
from loom.workloads.server.protocol import GenerateRequest, GenerateResponse

pytestmark = pytest.mark.timeout(60)


class Shouter(Model):
    """infer: y = 10 * x (x == 13 refused, x == 99 crashes); generate: the prompt upper-cased, by letter."""

    platform = "test"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.batches: list[list[str | None]] = []
        self.fail_load = False

    def load(self, folder: Path) -> None:
        if self.fail_load:
            raise FileNotFoundError(f"nothing in {folder}")

    def predict(self, batch: list[InferRequest]) -> list[InferResponse | Exception]:
        self.entered.set()
        self.gate.wait(timeout=30)
        self.batches.append([r.id for r in batch])
        results: list[InferResponse | Exception] = []
        for request in batch:
            if "text_input" in request.inputs:
                prompt = request.inputs["text_input"].data.reshape(-1)[0]
                text = np.array([str(prompt).upper().encode()], dtype=object)
                results.append(InferResponse(outputs=[Tensor("text_output", "BYTES", text)]))
                continue
            x = request.inputs["x"].data
            if (x == 13).any():
                results.append(ModelError("13 is unlucky"))
            elif (x == 99).any():
                results.append(KeyError("x"))
            else:
                results.append(InferResponse(outputs=[Tensor("y", "INT64", x * 10)]))
        return results

    def generate(self, prompt: str, parameters: dict[str, Any]) -> Iterator[str]:
        for char in prompt:
            if char == "!":
                raise RuntimeError("no shouting past here")
            yield char.upper()

    def inputs(self) -> list[TensorSpec]:
        return [TensorSpec("x", "INT64", [-1])]

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec("y", "INT64", [-1])]


class Mute(Shouter):
    def predict(self, batch: list[InferRequest]) -> list[InferResponse | Exception]:
        return [InferResponse(outputs=[Tensor("y", "INT64", np.zeros(1, dtype=np.int64))]) for _ in batch]


Plane = tuple[DataPlane, Shouter]


def request(value: int) -> InferRequest:
    return InferRequest(inputs={"x": Tensor("x", "INT64", np.array([value]))}, id=f"r{value}")


async def until(condition: Callable[[], bool], message: str) -> None:
    """Wait for a state, not a time; generous because the test machine may be busy."""
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(message)


async def started(plane: DataPlane) -> DataPlane:
    await plane.start(Path("/models"))
    await until(lambda: plane.ready or plane.load_error is not None, "the model never finished loading")
    return plane


@pytest.fixture
async def served() -> AsyncIterator[Plane]:
    model = Shouter("shout", "3")
    # maxLatencyMs=0: a lone request never waits for company, while requests that queued behind a
    # running batch still join the next one (up to maxBatchSize) at once.
    plane = DataPlane(model, BatchingConfig(max_batch_size=2, max_latency_ms=0, max_queue=4))
    await started(plane)
    yield plane, model
    await plane.stop()


def gauge(plane: DataPlane, name: str) -> float | None:
    return plane.metrics.registry.get_sample_value(name, {"model": plane.model.name})


async def test_metadata_and_name_resolution(served: Plane) -> None:
    plane, model = served
    assert plane.server_metadata().to_dict() == {
        "name": "loom-model-server", "version": "0.1.0",
        "extensions": ["binary_tensor_data", "generate", "generate_stream"],
    }
    metadata = plane.model_metadata("shout", "3")
    assert (metadata.name, metadata.versions, metadata.platform) == ("shout", ["3"], "test")
    assert (metadata.inputs, metadata.outputs) == ([TensorSpec("x", "INT64", [-1])], [TensorSpec("y", "INT64", [-1])])
    assert plane.resolve("shout") is model and plane.model_ready("shout", "3")
    with pytest.raises(ModelNotFoundError, match="model 'other' not found"):
        plane.model_metadata("other")
    with pytest.raises(ModelNotFoundError, match=r"model 'shout' has no version '4' \(serving 3\)"):
        plane.model_ready("shout", "4")


async def test_not_ready_until_loaded_and_a_load_failure_says_why() -> None:
    model = Shouter("shout")
    model.fail_load = True
    plane = DataPlane(model, BatchingConfig())
    reasons: list[str] = []
    plane.on_load_failed = reasons.append
    assert not plane.model_ready("shout")
    with pytest.raises(ModelNotReadyError, match=r"^model shout is not ready$"):
        await plane.infer("shout", None, request(1))
    await started(plane)
    try:
        await until(lambda: bool(reasons), "the load failure was never reported")
        assert reasons == ["FileNotFoundError: nothing in /models"]
        assert not plane.ready and gauge(plane, "loom_server_model_ready") is None
        with pytest.raises(ModelNotReadyError, match="is not ready: FileNotFoundError: nothing in /models"):
            plane.ready_model("shout")
    finally:
        await plane.stop()


async def test_infer_answers_each_request_with_its_own_result_or_typed_error(served: Plane) -> None:
    plane, _ = served
    answer = await plane.infer("shout", "3", request(4))
    assert [(t.name, t.data.tolist()) for t in answer.outputs] == [("y", [40])]
    with pytest.raises(InvalidInputError, match=r"^13 is unlucky$"):
        await plane.infer("shout", None, request(13))
    with pytest.raises(InferenceError, match=r"^KeyError: 'x'$"):
        await plane.infer("shout", None, request(99))
    with pytest.raises(ModelNotFoundError):
        await plane.infer("nope", None, request(1))
    assert gauge(plane, "loom_server_model_ready") == 1
    assert gauge(plane, "loom_server_inflight_requests") == 0


async def test_max_batch_size_bounds_each_predict_call_and_a_full_queue_overloads(served: Plane) -> None:
    plane, model = served
    model.gate.clear()
    first = asyncio.ensure_future(plane.infer("shout", None, request(0)))
    await until(model.entered.is_set, "the first batch never ran")
    queued = [asyncio.ensure_future(plane.infer("shout", None, request(v))) for v in (1, 2, 13, 4)]
    await until(lambda: plane.queue_depth == 4, "the requests never queued")
    with pytest.raises(OverloadedError, match="queue is full") as refused:
        await plane.infer("shout", None, request(5))
    assert refused.value.retry_after_s == 1
    model.gate.set()
    assert (await first).outputs[0].data.tolist() == [0]
    results = await asyncio.gather(*queued, return_exceptions=True)
    assert [r.outputs[0].data.tolist() if isinstance(r, InferResponse) else str(r) for r in results] == [
        [10], [20], "13 is unlucky", [40],
    ]
    # maxBatchSize=2: the four queued requests ran two by two, in arrival order.
    assert model.batches == [["r0"], ["r1", "r2"], ["r13", "r4"]]
    assert plane.metrics.registry.get_sample_value("loom_server_batch_size_count", {"model": "shout"}) == 3


async def test_generate_is_batched_and_answers_text(served: Plane) -> None:
    plane, model = served
    answer = await plane.generate("shout", "3", GenerateRequest("hey", {"max_tokens": 3}, id="g1"))
    assert answer == GenerateResponse("shout", "3", "HEY", "g1")
    assert model.batches == [["g1"]]
    mute = DataPlane(Mute("mute"), BatchingConfig())
    await started(mute)
    try:
        with pytest.raises(InferenceError, match="model produced no text output"):
            await mute.generate("mute", None, GenerateRequest("hi"))
    finally:
        await mute.stop()


async def test_generate_stream_yields_pieces_and_counts_tokens(served: Plane) -> None:
    plane, _ = served
    async with aclosing(plane.generate_stream("shout", None, GenerateRequest("abc", id="s1"))) as pieces:
        got = [piece async for piece in pieces]
    assert got == [GenerateResponse("shout", "3", letter, "s1") for letter in "ABC"]
    assert gauge(plane, "loom_server_generated_tokens_total") == 3
    assert gauge(plane, "loom_server_inflight_requests") == 0


async def test_a_stream_failing_midway_raises_after_its_first_pieces(served: Plane) -> None:
    plane, _ = served
    seen: list[str] = []
    with pytest.raises(InferenceError, match=r"^RuntimeError: no shouting past here$"):
        async for piece in plane.generate_stream("shout", None, GenerateRequest("ok!")):
            seen.append(piece.text_output)
    assert seen == ["O", "K"]
    assert gauge(plane, "loom_server_inflight_requests") == 0


async def test_stream_slots_are_bounded_and_given_back_when_a_stream_closes(served: Plane) -> None:
    plane, _ = served
    open_streams = [plane.generate_stream("shout", None, GenerateRequest("abc")) for _ in range(4)]
    for stream in open_streams:
        await anext(stream)  # each stream is running and holds its slot
    with pytest.raises(OverloadedError, match="too many concurrent streams"):
        plane.generate_stream("shout", None, GenerateRequest("x"))
    await open_streams[0].aclose()  # the client went away
    async with aclosing(plane.generate_stream("shout", None, GenerateRequest("x"))) as again:
        assert [p.text_output async for p in again] == ["X"]
    for stream in open_streams[1:]:
        await stream.aclose()
    assert gauge(plane, "loom_server_inflight_requests") == 0


async def test_streaming_needs_a_model_that_generates() -> None:
    class Plain(Shouter):
        generate = Model.generate

    plane = DataPlane(Plain("plain"), BatchingConfig())
    await started(plane)
    try:
        with pytest.raises(InvalidInputError, match="model plain does not support streaming generate"):
            plane.generate_stream("plain", None, GenerateRequest("x"))
    finally:
        await plane.stop()


async def test_stopping_answers_the_batch_in_hand_then_refuses_as_unavailable(served: Plane) -> None:
    plane, model = served
    model.gate.clear()
    running = asyncio.ensure_future(plane.infer("shout", None, request(1)))
    await until(model.entered.is_set, "the first batch never ran")
    stopping = asyncio.ensure_future(plane.stop())
    model.gate.set()
    await stopping
    assert (await running).outputs[0].data.tolist() == [10]
    with pytest.raises(UnavailableError, match="not running") as refused:
        await plane.infer("shout", None, request(3))
    assert isinstance(refused.value, ShuttingDownError)
