"""Operator settings, read once from the environment (the Helm chart sets them)."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field

PREFIX = "loom.dev"
FIELD_MANAGER = "loom-operator"
FINALIZER = f"{PREFIX}/finalizer"


class OperatorSettings(BaseModel):
    namespaces: list[str] = Field(default_factory=list, description="Namespaces to watch; empty = cluster-wide.")
    metrics_port: int = 8081
    health_port: int = 8080
    trainer_image: str = "loom/trainer:0.1.0"
    server_image: str = "loom/server:0.1.0"
    router_image: str = "loom/server:0.1.0"
    # Watches are re-established this often so a silently dropped connection cannot stall reconciliation.
    watch_server_timeout_s: int = 300
    watch_client_timeout_s: int = 330
    # Periodic re-reconcile of every object: the safety net that makes status converge after missed events.
    resync_interval_s: float = 30.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        env = dict(os.environ if env is None else env)
        values: dict[str, object] = {}
        if env.get("LOOM_NAMESPACES"):
            values["namespaces"] = [ns.strip() for ns in env["LOOM_NAMESPACES"].split(",") if ns.strip()]
        for field in ("metrics_port", "health_port", "watch_server_timeout_s", "watch_client_timeout_s"):
            key = "LOOM_" + field.upper()
            if key in env:
                values[field] = int(env[key])
        if "LOOM_RESYNC_INTERVAL_S" in env:
            values["resync_interval_s"] = float(env["LOOM_RESYNC_INTERVAL_S"])
        for field in ("trainer_image", "server_image", "router_image"):
            key = "LOOM_" + field.upper()
            if key in env:
                values[field] = env[key]
        return cls.model_validate(values)
