"""`Cluster.wait_crds_established`: one `kubectl wait` for all CRDs per round, a retry (after a nudge) when kubectl
fails at once on a just-created CRD's `conditions: null`, and kubectl's own error once the time is up. kubectl here
is a stand-in script that records its arguments and answers as told."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from loom.devstack.cluster.handle import Cluster, KubectlError

NULL_CONDITIONS = "error: .status.conditions accessor error: <nil> is of the type <nil>, expected []interface{}"
FAKE_KUBECTL = f"""#!{sys.executable}
import json, pathlib, sys
here = pathlib.Path(__file__).parent
calls = json.loads((here / "calls.json").read_text()) if (here / "calls.json").exists() else []
calls.append(sys.argv[1:])
(here / "calls.json").write_text(json.dumps(calls))
if sys.argv[1] == "wait":
    answers = json.loads((here / "answers.json").read_text())
    rc, err = answers.pop(0) if len(answers) > 1 else answers[0]
    (here / "answers.json").write_text(json.dumps(answers))
    sys.stderr.write(err)
    sys.exit(rc)
"""


def cluster(tmp_path: Path, answers: list[tuple[int, str]]) -> Cluster:
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(FAKE_KUBECTL)
    kubectl.chmod(0o755)
    (tmp_path / "answers.json").write_text(json.dumps(answers))
    return Cluster(tmp_path / "kubeconfig", "https://127.0.0.1:1", tmp_path, tmp_path / "ca.crt")


def calls(tmp_path: Path) -> list[list[str]]:
    return list(json.loads((tmp_path / "calls.json").read_text()))


def test_one_wait_covers_every_crd(tmp_path: Path) -> None:
    cluster(tmp_path, [(0, "")]).wait_crds_established(["a.loom.dev", "b.loom.dev"], timeout_s=60)
    assert calls(tmp_path) == [
        ["wait", "--for=condition=Established", "--timeout=5s", "crd/a.loom.dev", "crd/b.loom.dev"]
    ]


def test_a_just_created_crds_null_conditions_are_waited_through(tmp_path: Path) -> None:
    cluster(tmp_path, [(1, NULL_CONDITIONS), (0, "")]).wait_crds_established(["a.loom.dev"], timeout_s=60)
    made = calls(tmp_path)
    assert [call[0] for call in made] == ["wait", "annotate", "wait"]
    assert made[1][:3] == ["annotate", "--overwrite", "crd/a.loom.dev"]
    assert made[1][3].startswith("loom.dev/establish=")


def test_kubectls_error_is_raised_once_the_time_is_up(tmp_path: Path) -> None:
    timed_out = "error: timed out waiting for the condition on customresourcedefinitions/a.loom.dev"
    with pytest.raises(KubectlError) as raised:
        cluster(tmp_path, [(1, timed_out)]).wait_crds_established(["a.loom.dev"], timeout_s=0)
    assert raised.value.stderr == timed_out
    assert [call[0] for call in calls(tmp_path)] == ["wait"]
    assert calls(tmp_path)[0][2] == "--timeout=1s"  # never a zero timeout, which kubectl reads as "check once"
