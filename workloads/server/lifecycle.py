"""Graceful shutdown of the model server: the shared SIGTERM drain (loom.workloads.common.lifecycle), which the
InferenceGraph router uses too."""

from __future__ import annotations

from loom.workloads.common.lifecycle import (
    CloseWhileDraining,
    Drain,
    GracefulServer,
    add_drain_arguments,
    check_drain_arguments,
    uvicorn_config,
)

__all__ = ["CloseWhileDraining", "Drain", "GracefulServer", "add_drain_arguments", "check_drain_arguments",
           "uvicorn_config"]
