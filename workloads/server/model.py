"""The model-side interface: what a handler implements, kept apart from the wire protocol.

A handler sees decoded requests (:class:`InferRequest`, numpy arrays) and returns one result per
request. It never sees HTTP, JSON or batching: the server pools requests, calls ``predict`` once
per batch and answers each request with its own result. Returning an ``Exception`` in a result
slot fails only that request.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Tensor:
    """One named tensor in Open Inference Protocol terms (datatype is the protocol's, e.g. FP32)."""

    name: str
    datatype: str
    data: np.ndarray[Any, Any]
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> list[int]:
        return list(self.data.shape)


@dataclass
class InferRequest:
    """One client's request, as the handler sees it."""

    inputs: dict[str, Tensor]
    parameters: dict[str, Any] = field(default_factory=dict)
    # Names of the outputs the client asked for; None means "all of them".
    requested_outputs: list[str] | None = None
    id: str | None = None


@dataclass
class InferResponse:
    """One request's answer."""

    outputs: list[Tensor]
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class TensorSpec:
    """Metadata entry for GET /v2/models/{name}: name, datatype and shape (-1 = any size)."""

    name: str
    datatype: str
    shape: list[int]


class ModelError(Exception):
    """A request the model cannot serve (bad input); the client gets a 400 with this message."""


class Model:
    """Base class of every handler.

    Subclasses implement :meth:`load` and :meth:`predict`; generative models also implement
    :meth:`generate`. ``options`` are the config's ``handlerOptions``.
    """

    platform: str = "loom"

    def __init__(self, name: str, version: str | None = None, options: dict[str, Any] | None = None):
        self.name = name
        self.version = version
        self.options: dict[str, Any] = dict(options or {})
        self.ready = False

    def load(self, folder: Path) -> None:
        """Load the model from the fetched folder. Called once, before the server reports ready."""
        raise NotImplementedError

    def predict(self, batch: list[InferRequest]) -> list[InferResponse | Exception]:
        """Run one batch; return exactly one result (or an exception) per request, in order."""
        raise NotImplementedError

    def generate(self, prompt: str, parameters: dict[str, Any]) -> Iterator[str]:
        """Yield generated text piece by piece (for the streaming generate endpoint)."""
        raise ModelError(f"model {self.name} does not support generate")

    @property
    def supports_generate(self) -> bool:
        return type(self).generate is not Model.generate

    def inputs(self) -> list[TensorSpec]:
        return []

    def outputs(self) -> list[TensorSpec]:
        return []


def select_outputs(request: InferRequest, outputs: list[Tensor]) -> list[Tensor]:
    """Keep the outputs this request asked for (all when it named none); unknown names are errors."""
    if request.requested_outputs is None:
        return outputs
    by_name = {tensor.name: tensor for tensor in outputs}
    missing = [name for name in request.requested_outputs if name not in by_name]
    if missing:
        raise ModelError(f"unknown requested output(s): {', '.join(missing)}")
    return [by_name[name] for name in request.requested_outputs]
