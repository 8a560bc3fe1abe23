"""images/*.Dockerfile, statically (the real build is `make images`, too slow for `make test`): read with the
parser Docker and BuildKit use, every COPY source exists in the build context (the repository), the entrypoint's
module or console script exists, the final stage runs as a non-root user, and the base image is a build ARG so
`make images` can build FROM its local Debian base instead of pulling one.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import dockerfile
import pytest
from click.testing import CliRunner

from loom.operator.cli import main

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
# What setup.py maps: import name -> folder (the images install only these two).
PACKAGE_DIRS = {"loom.operator": "operator", "loom.workloads": "workloads"}


def commands(path: Path) -> tuple[dockerfile.Command, ...]:
    return dockerfile.parse_file(str(path))


def final_stage(path: Path) -> list[dockerfile.Command]:
    cmds = list(commands(path))
    last_from = max(i for i, c in enumerate(cmds) if c.cmd == "FROM")
    return cmds[last_from:]


def module_file(module: str) -> Path | None:
    """The source file of `loom.x.y` in the checkout (its __main__ for a package run with -m), or None."""
    for name, folder in PACKAGE_DIRS.items():
        if module == name or module.startswith(name + "."):
            rest = module.removeprefix(name).strip(".").split(".") if module != name else []
            base = REPO / folder / Path(*rest) if rest else REPO / folder
            for candidate in (base / "__main__.py", base.with_suffix(".py")):
                if candidate.is_file():
                    return candidate
    return None


def test_there_is_an_image_for_every_image_setting_of_the_operator() -> None:
    # trainer_image, server_image (router_image is the server image too), features_image, vllm_image, the operator.
    assert {p.stem for p in DOCKERFILES} == {"operator", "server", "trainer", "features", "vllm"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.stem)
def test_every_copy_source_exists_in_the_build_context(path: Path) -> None:
    stages = {c.value[2].lower() for c in commands(path) if c.cmd == "FROM" and len(c.value) == 3}
    copies = [c for c in commands(path) if c.cmd in {"COPY", "ADD"}]
    assert copies
    for copy in copies:
        origin = next((f.split("=", 1)[1] for f in copy.flags if f.startswith("--from=")), None)
        sources = copy.value[:-1]
        if origin is not None:
            # From an earlier stage of the same file: that stage must exist (its paths exist only in the build).
            assert origin.lower() in stages, f"{path.name}:{copy.start_line}: no stage {origin!r}"
            continue
        for source in sources:
            assert not Path(source).is_absolute() and ".." not in Path(source).parts, (path.name, source)
            assert (REPO / source).exists(), f"{path.name}:{copy.start_line}: COPY source {source!r} is not in the repo"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.stem)
def test_the_final_stage_runs_as_a_non_root_user_created_in_it(path: Path) -> None:
    stage = final_stage(path)
    users = [c.value[0] for c in stage if c.cmd == "USER"]
    assert users, f"{path.name}: no USER in the final stage"
    user = users[-1].split(":")[0]
    assert user not in {"0", "root"}, path.name
    # The uid is created in the same stage, so the container has a passwd entry and a home for it.
    created = [c for c in stage if c.cmd == "RUN" and re.search(rf"useradd\b.*--uid {re.escape(user)}\b", c.value[0])]
    assert created or not user.isdigit(), f"{path.name}: uid {user} is never created"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.stem)
def test_the_base_image_is_a_build_argument(path: Path) -> None:
    cmds = commands(path)
    args = {c.value[0].split("=", 1)[0]: c.value[0].partition("=")[2] for c in cmds if c.cmd == "ARG"}
    assert args.get("BASE"), f"{path.name}: no ARG BASE with a default"
    froms = [c.value[0] for c in cmds if c.cmd == "FROM"]
    stages = {c.value[2] for c in cmds if c.cmd == "FROM" and len(c.value) == 3}
    assert all(f in {"${BASE}", "$BASE"} or f in stages for f in froms), froms


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.stem)
def test_the_entrypoint_exists(path: Path) -> None:
    entry = [c for c in final_stage(path) if c.cmd == "ENTRYPOINT"]
    assert entry and entry[-1].json, f"{path.name}: ENTRYPOINT missing or not in exec form"
    argv = entry[-1].value
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    if argv[0] in {"python", "python3"}:
        assert argv[1] == "-m", argv
        assert module_file(argv[2]) is not None, f"{path.name}: no module {argv[2]} in the checkout"
    elif argv[0] in scripts:
        target = scripts[argv[0]].split(":")[0]
        assert module_file(target) is not None, f"{path.name}: {argv[0]} -> {target} is not in the checkout"
    else:
        # A console script of a dependency the image installs (torchrun comes with torch).
        assert argv[0] == "torchrun" and "torch" in path.read_text(), argv


def test_the_operator_image_smoke_test_command_works() -> None:
    """`make images` starts the operator image once with `loom --version`."""
    result = CliRunner().invoke(main, ["--version"])
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert result.exit_code == 0 and result.output.strip() == f"loom, version {version}", result.output


def test_build_sh_starts_every_image_once() -> None:
    """`make images` smoke-tests each image it builds: images/build.sh has a command for every Dockerfile."""
    script = (IMAGES / "build.sh").read_text()
    body = script[script.index("smoke() {") : script.index("\n}", script.index("smoke() {"))]
    cases = set(re.findall(r"^\s+(\w+)\) echo ", body, re.MULTILINE))
    assert cases == {p.stem for p in DOCKERFILES}, cases


def test_the_trainer_image_builds_deepspeed_against_the_torch_it_installs_first() -> None:
    """deepspeed ships a source distribution whose setup.py imports torch and its own op_builder/ folder."""
    runs = " ".join(c.value[0] for c in commands(IMAGES / "trainer.Dockerfile") if c.cmd == "RUN")
    installs = [part for part in re.split(r"&&", runs) if "pip install" in part]
    torch_first = next(i for i, part in enumerate(installs) if "'torch" in part)
    train = next(i for i, part in enumerate(installs) if "[train]" in part)
    assert torch_first < train, installs
    deepspeed = installs[train]
    # torch must be visible to the build (no isolated build environment), no CUDA op compiled (no nvcc in the
    # image), and the build's folder on sys.path for `from op_builder import ...` (PYTHONSAFEPATH removes it).
    assert "--no-build-isolation" in deepspeed and "DS_BUILD_OPS=0" in deepspeed, deepspeed
    assert "-u PYTHONSAFEPATH" in deepspeed, deepspeed
