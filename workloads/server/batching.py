"""Adaptive batching: pool requests into one predict call, answer each request on its own.

A batch closes when it holds ``max_batch_size`` requests or when its oldest request has waited
``max_latency_ms``. While one batch runs (in a single worker thread, so the event loop keeps
accepting requests), the next one fills up; under load batches therefore grow by themselves and
at low load a lone request waits at most ``max_latency_ms``. The queue is bounded: a full queue
refuses new work at once (the server answers 503) instead of letting latency grow without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from .config import BatchingConfig
from .errors import OverloadedError, UnavailableError
from .model import InferRequest, InferResponse

log = logging.getLogger(__name__)

PredictFn = Callable[[list[InferRequest]], list[InferResponse | Exception]]


class QueueFullError(OverloadedError):
    """The bounded queue is full; the request was not accepted."""


class ShuttingDownError(UnavailableError):
    """The batcher stopped before the request ran."""


class BatchObserver(Protocol):
    def batch_done(self, size: int, seconds: float) -> None: ...

    def queue_depth(self, depth: int) -> None: ...


@dataclass
class _Pending:
    request: InferRequest
    future: asyncio.Future[InferResponse]
    enqueued: float = field(default_factory=time.monotonic)


class AdaptiveBatcher:
    """Owns the queue, the collector task and the predict thread of one model."""

    def __init__(self, predict: PredictFn, config: BatchingConfig, observer: BatchObserver | None = None):
        self._predict = predict
        self._max_batch = config.max_batch_size
        self._max_wait = config.max_latency_ms / 1000.0
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=config.max_queue)
        self._observer = observer
        # One thread: handlers need not be thread-safe, and batches run in arrival order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predict")
        self._task: asyncio.Task[None] | None = None

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._collect(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if not pending.future.done():
                pending.future.set_exception(ShuttingDownError("server is shutting down"))
        self._executor.shutdown(wait=True)

    async def submit(self, request: InferRequest) -> InferResponse:
        """Queue one request and wait for its own answer; raises its own error, if any."""
        if self._task is None:
            raise ShuttingDownError("batcher is not running")
        pending = _Pending(request, asyncio.get_running_loop().create_future())
        try:
            self._queue.put_nowait(pending)
        except asyncio.QueueFull as exc:
            raise QueueFullError(f"queue is full ({self._queue.maxsize} requests waiting)") from exc
        self._report_depth()
        return await pending.future

    def _report_depth(self) -> None:
        if self._observer is not None:
            self._observer.queue_depth(self._queue.qsize())

    async def _gather(self) -> list[_Pending]:
        first = await self._queue.get()
        batch = [first]
        deadline = first.enqueued + self._max_wait
        while len(batch) < self._max_batch:
            try:
                batch.append(self._queue.get_nowait())
                continue
            except asyncio.QueueEmpty:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
            except TimeoutError:
                break
        return batch

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._gather()
            self._report_depth()
            # A client that went away no longer needs its slot in the batch.
            batch = [p for p in batch if not p.future.done()]
            if not batch:
                continue
            started = time.monotonic()
            running = loop.run_in_executor(self._executor, self._run_batch, [p.request for p in batch])
            try:
                results = await asyncio.shield(running)
            except asyncio.CancelledError:
                # Stopping: finish the batch in hand so its requests get their answers, then stop.
                self._deliver(batch, await running)
                raise
            if self._observer is not None:
                self._observer.batch_done(len(batch), time.monotonic() - started)
            self._deliver(batch, results)

    @staticmethod
    def _deliver(batch: list[_Pending], results: list[InferResponse | Exception]) -> None:
        for pending, result in zip(batch, results, strict=True):
            if pending.future.done():
                continue
            if isinstance(result, Exception):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)

    def _run_batch(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        try:
            results = self._predict(requests)
        except Exception as exc:
            if len(requests) == 1:
                return [exc]
            # The handler failed the whole batch: run each request alone so only the bad one fails.
            log.warning("batch of %d failed (%s); retrying its requests one by one", len(requests), exc)
            return [self._run_one(request) for request in requests]
        if len(results) != len(requests):
            error = RuntimeError(f"handler returned {len(results)} results for {len(requests)} requests")
            return [error] * len(requests)
        return results

    def _run_one(self, request: InferRequest) -> InferResponse | Exception:
        try:
            (result,) = self._predict([request])
        except Exception as exc:
            return exc
        return result
