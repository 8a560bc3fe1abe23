"""Packaging guards: every package folder is listed, `operator` never shadows the stdlib, extras stay light."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pyproject() -> dict[str, object]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_package_folder_is_listed() -> None:
    tool = pyproject()["tool"]["setuptools"]  # type: ignore[index]
    listed = set(tool["packages"])
    found = set()
    for prefix, folder in tool["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([prefix, *rel.parts]))
    assert found - listed == set(), "add these to [tool.setuptools] packages"


def test_operator_folder_does_not_shadow_stdlib() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import operator, loom.operator; print(operator.__file__ != loom.operator.__file__)"],
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "True"


def test_operator_install_is_light() -> None:
    deps = " ".join(pyproject()["project"]["dependencies"])  # type: ignore[index]
    for heavy in ("torch", "deepspeed", "feast", "mlflow"):
        assert heavy not in deps
    assert "kubernetes>=30,<37" in deps  # 37.x conflicts with botocore's python-dateutil pin


def test_operator_import_does_not_pull_heavy_modules() -> None:
    code = (
        "import sys, loom.operator.main, loom.operator.cli;"
        "print(sorted(m for m in ('torch', 'deepspeed', 'feast', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
