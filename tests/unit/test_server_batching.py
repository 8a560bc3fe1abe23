"""Adaptive batcher: batches form, answers go back to their own requests, failures stay local."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from loom.workloads.server.batching import AdaptiveBatcher, QueueFullError, ShuttingDownError
from loom.workloads.server.config import BatchingConfig
from loom.workloads.server.model import InferRequest, InferResponse, ModelError, Tensor


def request(value: int, **parameters: object) -> InferRequest:
    data = np.array([value], dtype=np.int64)
    return InferRequest(inputs={"x": Tensor("x", "INT64", data)}, parameters=dict(parameters), id=str(value))


class Recorder:
    """A predict function that records each batch; `gate` holds the worker thread when set."""

    def __init__(self, fail_on: set[int] | None = None, raise_on: set[int] | None = None):
        self.batches: list[list[int]] = []
        self.fail_on = fail_on or set()
        self.raise_on = raise_on or set()
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def __call__(self, batch: list[InferRequest]) -> list[InferResponse | Exception]:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(timeout=60)
        values = [int(r.inputs["x"].data[0]) for r in batch]
        self.batches.append(values)
        if self.raise_on & set(values):
            raise RuntimeError(f"batch poisoned by {sorted(self.raise_on & set(values))}")
        results: list[InferResponse | Exception] = []
        for r, v in zip(batch, values, strict=True):
            if v in self.fail_on:
                results.append(ModelError(f"cannot serve {v}"))
                continue
            scale = int(r.parameters.get("scale", 1))
            out = Tensor("y", "INT64", np.array([v * scale], dtype=np.int64), parameters={"id": r.id})
            results.append(InferResponse(outputs=[out]))
        return results


async def run_all(batcher: AdaptiveBatcher, requests: list[InferRequest]) -> list[object]:
    tasks = [asyncio.ensure_future(batcher.submit(r)) for r in requests]
    return await asyncio.gather(*tasks, return_exceptions=True)


async def test_queued_requests_run_as_one_batch_and_answers_keep_their_order() -> None:
    recorder = Recorder()
    batcher = AdaptiveBatcher(recorder, BatchingConfig(max_batch_size=8, max_latency_ms=10_000))
    batcher.start()
    results = await run_all(batcher, [request(i) for i in range(8)])
    await batcher.stop()
    assert recorder.batches == [list(range(8))]
    assert [int(r.outputs[0].data[0]) for r in results] == list(range(8))  # type: ignore[union-attr]


async def test_batches_never_exceed_max_batch_size() -> None:
    recorder = Recorder()
    recorder.gate = threading.Event()
    batcher = AdaptiveBatcher(recorder, BatchingConfig(max_batch_size=3, max_latency_ms=0, max_queue=100))
    batcher.start()
    first = asyncio.ensure_future(batcher.submit(request(100)))
    await asyncio.to_thread(recorder.entered.wait, 60)  # worker is busy with request 100
    rest = [asyncio.ensure_future(batcher.submit(request(i))) for i in range(7)]
    await asyncio.sleep(0)
    recorder.gate.set()
    await asyncio.gather(first, *rest)
    await batcher.stop()
    assert recorder.batches == [[100], [0, 1, 2], [3, 4, 5], [6]]


async def test_per_request_parameters_stay_with_their_request() -> None:
    recorder = Recorder()
    batcher = AdaptiveBatcher(recorder, BatchingConfig(max_batch_size=4, max_latency_ms=10_000))
    batcher.start()
    reqs = [request(1, scale=10), request(2), request(3, scale=-1), request(4, scale=3)]
    results = await run_all(batcher, reqs)
    await batcher.stop()
    assert len(recorder.batches) == 1
    assert [int(r.outputs[0].data[0]) for r in results] == [10, 2, -3, 12]  # type: ignore[union-attr]
    assert [r.outputs[0].parameters["id"] for r in results] == ["1", "2", "3", "4"]  # type: ignore[union-attr]


async def test_a_failing_item_fails_only_its_own_request() -> None:
    recorder = Recorder(fail_on={2})
    batcher = AdaptiveBatcher(recorder, BatchingConfig(max_batch_size=4, max_latency_ms=10_000))
    batcher.start()
    results = await run_all(batcher, [request(i) for i in range(4)])
    await batcher.stop()
    assert isinstance(results[2], ModelError)
    assert [int(r.outputs[0].data[0]) for i, r in enumerate(results) if i != 2] == [0, 1, 3]  # type: ignore[union-attr]


async def test_a_handler_that_raises_for_the_batch_is_retried_per_request() -> None:
    recorder = Recorder(raise_on={1})
    batcher = AdaptiveBatcher(recorder, BatchingConfig(max_batch_size=3, max_latency_ms=10_000))
    batcher.start()
    results = await run_all(batcher, [request(i) for i in range(3)])
    await batcher.stop()
    assert recorder.batches == [[0, 1, 2], [0], [1], [2]]
    assert isinstance(results[1], RuntimeError)
    assert int(results[0].outputs[0].data[0]) == 0  # type: ignore[union-attr]
    assert int(results[2].outputs[0].data[0]) == 2  # type: ignore[union-attr]


async def test_a_full_queue_refuses_new_requests_and_keeps_the_queued_ones() -> None:
    recorder = Recorder()
    recorder.gate = threading.Event()
    batcher = AdaptiveBatcher(recorder, BatchingConfig(max_batch_size=1, max_latency_ms=0, max_queue=2))
    batcher.start()
    running = asyncio.ensure_future(batcher.submit(request(0)))
    await asyncio.to_thread(recorder.entered.wait, 60)
    queued = [asyncio.ensure_future(batcher.submit(request(i))) for i in (1, 2)]
    await asyncio.sleep(0)
    with pytest.raises(QueueFullError):
        await batcher.submit(request(3))
    recorder.gate.set()
    results = await asyncio.gather(running, *queued)
    await batcher.stop()
    assert [int(r.outputs[0].data[0]) for r in results] == [0, 1, 2]
    assert recorder.batches == [[0], [1], [2]]


async def test_a_handler_returning_the_wrong_number_of_results_fails_the_batch() -> None:
    batcher = AdaptiveBatcher(lambda batch: [], BatchingConfig(max_batch_size=2, max_latency_ms=10_000))
    batcher.start()
    results = await run_all(batcher, [request(1), request(2)])
    await batcher.stop()
    assert all(isinstance(r, RuntimeError) and "0 results for 2" in str(r) for r in results)


async def test_requests_left_at_shutdown_are_failed_not_dropped() -> None:
    recorder = Recorder()
    recorder.gate = threading.Event()
    batcher = AdaptiveBatcher(recorder, BatchingConfig(max_batch_size=1, max_latency_ms=0, max_queue=5))
    batcher.start()
    running = asyncio.ensure_future(batcher.submit(request(0)))
    await asyncio.to_thread(recorder.entered.wait, 60)
    waiting = asyncio.ensure_future(batcher.submit(request(1)))
    await asyncio.sleep(0)
    recorder.gate.set()
    await running
    stop = asyncio.ensure_future(batcher.stop())
    outcome = await asyncio.gather(waiting, return_exceptions=True)
    await stop
    # Either it ran before the stop or it was failed explicitly; it never hangs.
    assert isinstance(outcome[0], InferResponse | ShuttingDownError)
    with pytest.raises(ShuttingDownError):
        await batcher.submit(request(2))
