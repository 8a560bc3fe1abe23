"""The data plane: one model's lifecycle, batching, generation and streaming, without any transport.

What a route needs, as methods that take protocol objects and return them (protocol.py) or raise the
typed errors of errors.py; HTTP (app.py) only parses requests, calls these and maps errors to status
codes, so everything here is testable without a server (tests/unit/test_server_dataplane.py).

* lifecycle: :meth:`DataPlane.start` loads the model in the background (liveness answers at once,
  readiness only once it is loaded) and starts the batcher; :meth:`DataPlane.stop` drains it.
* infer and generate go through the :class:`~.batching.AdaptiveBatcher` (``batching.maxBatchSize``,
  ``maxLatencyMs``, ``maxQueue``): concurrent requests share one ``predict`` call.
* generate_stream runs the model's ``generate`` iterator in a thread, at most ``maxQueue`` at once.
* metrics: ready, in-flight and token gauges here; batch and queue metrics through the batcher.
* enrichment (optional, enrichment.py): infer (and generate, which goes through it) requests get their entity's
  online features as extra input tensors before they join a batch; generate_stream is not enriched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path

import numpy as np

from .batching import AdaptiveBatcher
from .config import BatchingConfig
from .enrichment import Enricher
from .errors import (
    InferenceError,
    InvalidInputError,
    ModelNotFoundError,
    ModelNotReadyError,
    OverloadedError,
    ServerError,
)
from .metrics import ServerMetrics
from .model import InferRequest, InferResponse, Model, ModelError, Tensor
from .protocol import (
    GenerateRequest,
    GenerateResponse,
    ModelMetadata,
    ProtocolError,
    ServerMetadata,
)

log = logging.getLogger(__name__)

SERVER_NAME = "loom-model-server"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["binary_tensor_data", "generate", "generate_stream"]

_DONE = object()


class DataPlane:
    """Serves one model: resolve it by name/version, report readiness, run requests against it."""

    def __init__(
        self,
        model: Model,
        batching: BatchingConfig,
        metrics: ServerMetrics | None = None,
        enricher: Enricher | None = None,
    ):
        self.model = model
        self.metrics = metrics or ServerMetrics(model.name)
        self.enricher = enricher
        self.batching = batching
        self._batcher = AdaptiveBatcher(model.predict, batching, self.metrics)
        self._loader: asyncio.Future[None] | None = None
        self._streams = 0
        self.load_error: str | None = None
        # Called with the reason when loading fails (the process entry point exits on it).
        self.on_load_failed: Callable[[str], None] | None = None

    # --- lifecycle -------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.model.ready and self.load_error is None

    @property
    def queue_depth(self) -> int:
        return self._batcher.depth

    def load(self, folder: Path) -> None:
        """Load the model (blocking); a failure is recorded as ``load_error``, never raised."""
        try:
            self.model.load(folder)
            self.model.ready = True
            self.metrics.ready.labels(self.model.name).set(1)
            log.info("model %s version %s loaded from %s", self.model.name, self.model.version, folder)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("loading model %s failed", self.model.name)
            if self.on_load_failed is not None:
                self.on_load_failed(self.load_error)

    async def start(self, folder: Path) -> None:
        """Start the batcher and load the model in a worker thread (returns at once)."""
        self._batcher.start()
        self._loader = asyncio.get_running_loop().run_in_executor(None, self.load, folder)

    async def stop(self) -> None:
        """Stop the batcher: running batches finish, queued requests fail with ShuttingDownError."""
        if self._loader is not None:
            # A load still running cannot be interrupted; do not wait for it to stop the server.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._loader), timeout=0.1)
        await self._batcher.stop()
        if self.enricher is not None:
            await self.enricher.aclose()

    # --- metadata --------------------------------------------------------------------------------

    def server_metadata(self) -> ServerMetadata:
        return ServerMetadata(SERVER_NAME, SERVER_VERSION, list(EXTENSIONS))

    def resolve(self, name: str, version: str | None = None) -> Model:
        """The model called ``name`` (at ``version``, when given); ModelNotFoundError otherwise."""
        model = self.model
        if name != model.name:
            raise ModelNotFoundError(f"model {name!r} not found")
        if version is not None and model.version is not None and version != model.version:
            raise ModelNotFoundError(f"model {name!r} has no version {version!r} (serving {model.version})")
        return model

    def ready_model(self, name: str, version: str | None = None) -> Model:
        """Like :meth:`resolve`, and ModelNotReadyError (with the load failure) until it is ready."""
        model = self.resolve(name, version)
        if not self.ready:
            reason = f": {self.load_error}" if self.load_error else ""
            raise ModelNotReadyError(f"model {model.name} is not ready{reason}")
        return model

    def model_ready(self, name: str, version: str | None = None) -> bool:
        self.resolve(name, version)
        return self.ready

    def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        model = self.resolve(name, version)
        return ModelMetadata(
            name=model.name,
            versions=[model.version] if model.version else [],
            platform=model.platform,
            inputs=model.inputs(),
            outputs=model.outputs(),
        )

    # --- inference -------------------------------------------------------------------------------

    async def infer(self, name: str, version: str | None, request: InferRequest) -> InferResponse:
        """Run one request through the batcher; its own result, or its own typed error."""
        self.ready_model(name, version)
        inflight = self.metrics.inflight.labels(self.model.name)
        inflight.inc()
        try:
            if self.enricher is not None:
                request = await self.enricher.enrich(request)
            return await self._batcher.submit(request)
        except ServerError:
            raise
        except (ModelError, ProtocolError) as exc:
            raise InvalidInputError(str(exc)) from exc
        except Exception as exc:
            raise InferenceError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            inflight.dec()

    async def generate(self, name: str, version: str | None, request: GenerateRequest) -> GenerateResponse:
        """Generate text for one prompt; batched with concurrent prompts (one forward pass per step)."""
        model = self.ready_model(name, version)
        prompt = np.array([request.text_input], dtype=object)
        result = await self.infer(
            name,
            version,
            InferRequest(
                inputs={"text_input": Tensor("text_input", "BYTES", prompt)},
                parameters=dict(request.parameters),
                requested_outputs=None,
                id=request.id,
            ),
        )
        texts = [t for t in result.outputs if t.name == "text_output"] or [
            t for t in result.outputs if t.datatype == "BYTES"
        ]
        if not texts:
            raise InferenceError("model produced no text output")
        value = np.asarray(texts[0].data).reshape(-1)[0]
        text = value.decode() if isinstance(value, bytes) else str(value)
        return GenerateResponse(model.name, model.version, text, request.id)

    def generate_stream(
        self, name: str, version: str | None, request: GenerateRequest
    ) -> AsyncGenerator[GenerateResponse, None]:
        """Admit a stream now (typed errors before any piece), then yield its pieces one by one.

        A failure after the first piece surfaces as InferenceError from the iterator. Close the
        iterator (``contextlib.aclosing``) when the client goes away, so its slot is given back.
        """
        model = self.ready_model(name, version)
        if not model.supports_generate:
            raise InvalidInputError(f"model {model.name} does not support streaming generate")
        if self._streams >= self.batching.max_queue:
            raise OverloadedError("too many concurrent streams")
        self._streams += 1
        self.metrics.inflight.labels(model.name).inc()
        return self._stream(model, request)

    async def _stream(self, model: Model, request: GenerateRequest) -> AsyncGenerator[GenerateResponse, None]:
        tokens = self.metrics.tokens.labels(model.name)
        try:
            pieces: Iterator[str] = model.generate(request.text_input, dict(request.parameters))
            while True:
                # The model's iterator blocks (it computes): each step runs in a worker thread.
                piece = await asyncio.to_thread(next, pieces, _DONE)
                if piece is _DONE:
                    break
                tokens.inc()
                yield GenerateResponse(model.name, model.version, str(piece), request.id)
        except ServerError:
            raise
        except Exception as exc:
            log.warning("generate_stream failed: %s", exc)
            raise InferenceError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._streams -= 1
            self.metrics.inflight.labels(model.name).dec()
