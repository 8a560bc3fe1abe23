"""Which packages the `loom` distribution holds: those of the package folders that are present.

Everything else (name, dependencies, extras, entry points) is in pyproject.toml. The packages are
computed here, not listed there, because the container images copy only operator/ and workloads/:
their wheels then hold the operator and the workloads and nothing else, while a checkout's editable
install (`make venv`) also gets the dev-only folders devstack/ (the local stack, `loom dev`) and e2e/.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent

# Import name -> folder. `operator` is a stdlib module: the folders are importable only under `loom.`.
PACKAGE_DIRS = {
    "loom.operator": "operator",
    "loom.workloads": "workloads",
    # The Python SDK and its CLI verbs (`loom get`, `loom run --local`, ...): for the people who train and serve.
    "loom.client": "client",
    # Dev and test only, absent from the images (images/*.Dockerfile never copy them).
    "loom.devstack": "devstack",
    "loom.e2e": "e2e",
}


def present_packages(root: Path = ROOT) -> tuple[dict[str, str], list[str]]:
    """package_dir and packages for the folders that exist under `root` (every folder with an __init__.py)."""
    package_dir: dict[str, str] = {}
    packages: list[str] = []
    for name, folder in PACKAGE_DIRS.items():
        if not (root / folder / "__init__.py").is_file():
            continue
        package_dir[name] = folder
        for init in sorted((root / folder).rglob("__init__.py")):
            packages.append(".".join([name, *init.parent.relative_to(root / folder).parts]))
    return package_dir, packages


if __name__ == "__main__":
    dirs, names = present_packages()
    setup(package_dir=dirs, packages=names)
