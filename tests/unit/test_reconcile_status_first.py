"""The skeleton's order for a kind whose status goes first (a TrainingJob): its `prepare` writes (children the status
does not name) go out beside the status write, the rest (`apply`) only after both answered; an error of either
fails the pass once both are done. The API server is a fake behind kube.patch_status; the kind is a stand-in."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest

from loom.operator.core import client as kube
from loom.operator.core import reconcile
from loom.operator.core.kit import Event
from loom.operator.core.model import StatusBase

pytestmark = pytest.mark.timeout(30)


class StatusFirstKind:
    kind: ClassVar[str] = "TrainingJob"
    status_model: ClassVar[type[Any]] = StatusBase
    status_first: ClassVar[bool] = True

    def __init__(self, log: list[str], generation: int, fail_prepare: bool = False) -> None:
        self.log, self.generation, self.fail_prepare = log, generation, fail_prepare
        self.owner_written: list[bool] = []

    def parse(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(body.get("spec") or {})

    def check(self, body: dict[str, Any], spec: dict[str, Any]) -> None:
        return None

    async def observe(self, ctx: reconcile.Pass[dict[str, Any]]) -> None:
        return None

    def decide(self, ctx: reconcile.Pass[dict[str, Any]], observed: None) -> None:
        return None

    async def prepare(self, ctx: reconcile.Pass[Any], observed: None, plan: None, *, owner_written: bool) -> None:
        self.owner_written.append(owner_written)
        self.log.append("children sent")
        await asyncio.sleep(0)
        self.log.append("children answered")
        if self.fail_prepare:
            raise RuntimeError("services is forbidden")

    async def apply(self, ctx: reconcile.Pass[Any], observed: None, plan: None) -> None:
        self.log.append("pods sent")

    def status(
        self, ctx: reconcile.Pass[Any], observed: None, plan: None, previous: StatusBase | None
    ) -> tuple[StatusBase, Sequence[Event]]:
        return StatusBase(observed_generation=self.generation), []


def job(observed_generation: int) -> dict[str, Any]:
    meta = {"name": "j", "namespace": "ml", "uid": "u1", "generation": 1}
    return {"apiVersion": "loom.dev/v1alpha1", "kind": "TrainingJob", "metadata": meta,
            "spec": {}, "status": StatusBase(observed_generation=observed_generation).to_wire()}  # fmt: skip


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What went out, in order; a status write answers one loop turn after it was sent."""
    sent: list[str] = []

    async def patch_status(api_version: str, kind: str, namespace: str, name: str, patch: Any) -> dict[str, Any]:
        sent.append("status sent")
        await asyncio.sleep(0)
        sent.append("status answered")
        return {}

    monkeypatch.setattr(kube, "patch_status", patch_status)
    monkeypatch.setattr(reconcile, "post_events", lambda body, events: None)
    return sent


async def test_the_children_go_out_beside_a_status_write_and_the_pods_after_both(log: list[str]) -> None:
    kind = StatusFirstKind(log, generation=1)
    await reconcile.run(kind, "ml", "j", body=job(observed_generation=0))
    assert log[:2] == ["status sent", "children sent"]  # neither waits for the other's answer
    assert set(log[2:4]) == {"status answered", "children answered"}
    assert log[4:] == ["pods sent"]
    assert kind.owner_written == [True]  # the status write's answer checks the children's owner


async def test_without_a_status_write_the_children_check_their_owner_themselves(log: list[str]) -> None:
    kind = StatusFirstKind(log, generation=1)
    await reconcile.run(kind, "ml", "j", body=job(observed_generation=1))  # the status does not change
    assert log == ["children sent", "children answered", "pods sent"]
    assert kind.owner_written == [False]


async def test_a_refused_child_fails_the_pass_after_the_status_is_written_and_before_any_pod(log: list[str]) -> None:
    kind = StatusFirstKind(log, generation=1, fail_prepare=True)
    with pytest.raises(RuntimeError, match="forbidden"):
        await reconcile.run(kind, "ml", "j", body=job(observed_generation=0))
    assert "status answered" in log and "pods sent" not in log
