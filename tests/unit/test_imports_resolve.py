"""Every `from loom.<module> import <names>` in the tree resolves, the ones inside functions included.

A module moved into a feature package leaves imports behind that only run when their function does: an e2e test's
helper, a test that imports lazily, a benchmark. mypy never sees tests, e2e or bench, and a tier that does not run
that function passes; this finds them all at once, without running any of them.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPORT = re.compile(r"^\s*from (loom\.[\w.]+) import \(?([\w, \n]+?)\)?$", re.M)


def imports() -> list[tuple[str, str, str]]:
    """(file, module, name) of every `from loom... import` in the tree's Python files."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if any(part.startswith(".") or part == "__pycache__" for part in parts):
            continue
        for match in IMPORT.finditer(path.read_text()):
            names = [n.strip().split(" as ")[0] for n in match[2].replace("\n", " ").split(",") if n.strip()]
            found += [(str(path.relative_to(ROOT)), match[1], name) for name in names]
    return found


def test_every_loom_import_in_the_tree_resolves() -> None:
    found = imports()
    assert len(found) > 1000  # the walk found the tree
    missing = []
    for where, module_name, name in found:
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            try:
                importlib.import_module(f"{module_name}.{name}")  # a submodule: `from loom.x import y`
            except ModuleNotFoundError:
                missing.append(f"{where}: {module_name} has no {name}")
    assert missing == []
