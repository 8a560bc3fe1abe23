"""`loom dev env` gives a host-run operator what it needs to start: the README's `eval "$(loom dev env)"` then
`loom operator` failed with "LOOM_TRAINER_IMAGE is not set ..." before the image settings were exported."""

from __future__ import annotations

import shlex

import pytest
from click.testing import CliRunner

from loom.devstack import backing
from loom.devstack.cli import dev
from loom.devstack.cluster import build, lifecycle
from loom.operator.settings import OperatorSettings


def test_the_exports_let_a_host_run_operator_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "is_built", lambda: True)
    monkeypatch.setattr(lifecycle.StackState, "load", classmethod(lambda cls: None))
    monkeypatch.setattr(backing, "host_prometheus_url", lambda: "http://127.0.0.5:9090")
    printed = CliRunner().invoke(dev, ["env"])
    assert printed.exit_code == 0, printed.output
    env = dict(
        word.split("=", 1) for line in printed.output.splitlines() for word in shlex.split(line)[1:] if "=" in word
    )
    settings = OperatorSettings.from_env(env)
    assert settings.trainer_image == "localhost/loom/trainer:0.1.0" and settings.vllm_image.endswith("/vllm:0.1.0")
    assert settings.prometheus_url == "http://127.0.0.5:9090"
