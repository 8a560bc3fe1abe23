"""`loom dev up` when the user must act first (wipe the data, free the machine's real node, become root): the
stack's message alone, as a CLI error, not a traceback (found on a new user's `loom dev up --real-node` over a stack
made without it)."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from loom.devstack.cli import dev
from loom.devstack.cluster.handle import StackError
from loom.devstack.cluster.realnode.host import RealNodeError


@pytest.mark.parametrize(
    "error",
    [
        StackError("this stack's data was made without the real node: `loom dev down --wipe` first"),
        RealNodeError("the real node needs root (bridges, network namespaces, cgroups, mounts)"),
    ],
)
def test_up_prints_what_to_do_without_a_traceback(monkeypatch: pytest.MonkeyPatch, error: StackError) -> None:
    def refuse(*_: Any, **__: Any) -> Any:
        raise error

    monkeypatch.setattr("loom.devstack.cluster.up", refuse)
    result = CliRunner().invoke(dev, ["up", "--real-node"])
    assert result.exit_code == 1
    assert result.output.strip() == f"Error: {error}"
    assert "Traceback" not in result.output


def test_other_failures_keep_their_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug is not a message for the user: it still surfaces as the exception it is."""

    def broken(*_: Any, **__: Any) -> Any:
        raise KeyError("ports")

    monkeypatch.setattr("loom.devstack.cluster.up", broken)
    result = CliRunner().invoke(dev, ["up"])
    assert isinstance(result.exception, KeyError)
