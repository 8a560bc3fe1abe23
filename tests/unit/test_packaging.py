"""Packaging guards: packages follow the folders, images ship no dev stack, `operator` never shadows the stdlib,
extras stay light, and `loom` finds optional command groups without importing them by name."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import EntryPoint
from pathlib import Path
from types import ModuleType

import click
import pytest

from loom.operator import cli

REPO = Path(__file__).resolve().parents[2]
IMAGES = sorted((REPO / "images").glob("*.Dockerfile"))
DEV_ONLY = ("loom.devstack", "loom.e2e")


def pyproject() -> dict[str, object]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def load_setup_py() -> ModuleType:
    spec = importlib.util.spec_from_file_location("loom_setup", REPO / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_sources(dockerfile: Path) -> list[str]:
    """What a Dockerfile copies from the build context (not from another stage)."""
    sources: list[str] = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources += words[1:-1]
    return sources


def test_checkout_packages_every_folder_with_an_init() -> None:
    package_dir, packages = load_setup_py().present_packages(REPO)
    assert package_dir == {
        "loom.operator": "operator",
        "loom.workloads": "workloads",
        "loom.client": "client",
        "loom.devstack": "devstack",
        "loom.e2e": "e2e",
    }
    for name, folder in package_dir.items():
        for init in (REPO / folder).rglob("__init__.py"):
            assert ".".join([name, *init.parent.relative_to(REPO / folder).parts]) in packages
    assert {"loom.devstack.cluster", "loom.devstack.agent", "loom.operator.api", "loom.workloads.server"} <= set(
        packages
    )


def test_the_editable_install_resolves_every_package() -> None:
    code = (
        "import loom.operator, loom.workloads, loom.client, loom.devstack.cluster, loom.devstack.agent, loom.e2e;"
        " print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("dockerfile", IMAGES, ids=lambda p: p.name)
def test_images_copy_existing_sources_and_no_dev_stack(dockerfile: Path) -> None:
    sources = copy_sources(dockerfile)
    assert sources, "no COPY found"
    for source in sources:
        assert (REPO / source).exists(), f"{dockerfile.name} copies {source}, which does not exist"
        assert source.rstrip("/") not in ("devstack", "e2e"), f"{dockerfile.name} ships dev-only {source}"


def test_server_image_exposes_the_port_the_server_listens_on() -> None:
    from loom.workloads.server.config import ServerConfig

    exposed = re.findall(r"^EXPOSE (.+)$", (REPO / "images" / "server.Dockerfile").read_text(), re.MULTILINE)
    assert exposed == [str(ServerConfig.model_fields["port"].default)]


@pytest.mark.slow
def test_a_wheel_built_from_what_the_images_copy_holds_no_dev_stack(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    for source in copy_sources(REPO / "images" / "operator.Dockerfile"):
        if (REPO / source).is_dir():
            shutil.copytree(REPO / source, context / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / source, context / source)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=context,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("loom-*.whl")
    top = {name.split("/")[1] for name in zipfile.ZipFile(wheel).namelist() if name.startswith("loom/")}
    assert top == {"operator", "workloads"}


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


def test_operator_never_imports_the_dev_stack() -> None:
    code = (
        "import sys, loom.operator.main;"
        f"print(sorted(m for m in sys.modules if m.startswith({DEV_ONLY!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_loom_dev_comes_from_the_entry_point_group() -> None:
    (entry,) = [e for e in cli.entry_points(group=cli.CLI_GROUP) if e.name == "dev"]
    assert entry.value == "loom.devstack.cli:dev"
    assert isinstance(cli.main.commands["dev"], click.Group)


def register(monkeypatch: pytest.MonkeyPatch, *entries: EntryPoint) -> click.Group:
    group = click.Group("loom")
    monkeypatch.setattr(cli, "main", group)
    monkeypatch.setattr(cli, "entry_points", lambda group: list(entries))
    cli._register_optional()
    return group


def test_an_entry_point_whose_module_is_absent_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an image sees: its metadata names loom.devstack.cli, the package is not there."""
    absent = EntryPoint(name="dev", value="loom.devstack_absent.cli:dev", group=cli.CLI_GROUP)
    present = EntryPoint(name="crds", value="loom.operator.cli:crds", group=cli.CLI_GROUP)
    assert sorted(register(monkeypatch, absent, present).commands) == ["crds"]


def test_a_present_module_that_fails_to_import_is_not_hidden(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "loom_broken_cli.py").write_text("import loom_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = EntryPoint(name="broken", value="loom_broken_cli:group", group=cli.CLI_GROUP)
    with pytest.raises(ModuleNotFoundError, match="loom_no_such_dependency"):
        register(monkeypatch, broken)
