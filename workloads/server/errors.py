"""Why the data plane refused or failed a request, as types; each transport maps them to its codes.

HTTP (app.py): not found 404, not ready 503, overloaded 503 with ``Retry-After``, unavailable 503,
invalid input 400, inference failure 500. The message is what the client reads.
"""

from __future__ import annotations


class ServerError(Exception):
    """Base of every error the data plane raises on purpose."""


class ModelNotFoundError(ServerError):
    """No model (or no such version of it) is served here."""


class ModelNotReadyError(ServerError):
    """The model is still loading, or failed to load (the message says why)."""


class UnavailableError(ServerError):
    """The server cannot take the request now (e.g. it is shutting down)."""


class OverloadedError(UnavailableError):
    """Queue or stream slots are full: the client should retry after ``retry_after_s``."""

    retry_after_s = 1


class InvalidInputError(ServerError):
    """The request is well-formed but the model cannot serve it (a ModelError, a bad tensor)."""


class InferenceError(ServerError):
    """The handler failed on a valid request (a bug or a resource problem on the server's side)."""
