"""Node agent that runs pods as local processes (see loom.e2e.agent.agent)."""

from loom.e2e.agent.services import service_address

__all__ = ["service_address"]
