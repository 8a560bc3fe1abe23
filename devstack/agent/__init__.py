"""Node agent that runs pods as local processes (see loom.devstack.agent.agent)."""

from loom.devstack.agent.proxies import service_address

__all__ = ["service_address"]
