"""The README's trails from a CRD field to its effect: each names at most three files, each file exists and names the
field, and the first declares it on a model (or declares the model the kind's api.py types the field with).

A trail goes stale when code moves (a feature package split, a module renamed): this test is where that shows, so a
newcomer following the README never lands on a file that is gone or no longer has anything to do with the field.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# | Kind `spec.a.b[].c` | `path` -> `path` -> `path` |
ROW = re.compile(r"^\| (\w+) `spec\.([\w.\[\]]+)` \| (.+) \|$")
EXPECTED = {
    ("TrainingJob", "checkpoint.everySteps"),
    ("InferenceService", "autoscaling.target"),
    ("InferenceService", "routing"),
    ("InferenceService", "adapters"),
    ("InferenceGraph", "steps[].condition"),
}


def trails() -> dict[tuple[str, str], list[str]]:
    page = ROOT / "docs" / "architecture" / "layout.md"  # the README's "Layout" section moved there
    section = page.read_text().split("Finding the code behind a CRD field", 1)[1]
    found: dict[tuple[str, str], list[str]] = {}
    for line in section.splitlines():
        if (match := ROW.match(line)) is not None:
            found[(match[1], match[2])] = re.findall(r"`([^`]+)`", match[3])
    return found


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_the_readme_has_a_trail_for_each_of_the_five_fields() -> None:
    assert set(trails()) == EXPECTED


@pytest.mark.parametrize("field", sorted(EXPECTED), ids=lambda f: f"{f[0]}.{f[1]}")
def test_a_trail_reaches_the_effect_within_three_files_that_name_the_field(field: tuple[str, str]) -> None:
    files = trails()[field]
    assert 1 <= len(files) <= 3, f"{field}: {files}"
    leaf = field[1].replace("[]", "").rsplit(".", 1)[-1]
    # The Python name (snake_case) where code reads it; the wire name (camelCase) counts too (docstrings, CEL).
    names = {leaf, snake(leaf)}
    for path in files:
        source = ROOT / path
        assert source.is_file(), f"{field}: {path} does not exist"
        text = source.read_text()
        assert any(re.search(rf"\b{re.escape(n)}\b", text) for n in names), f"{field}: {path} never names {leaf}"
    model = (ROOT / files[0]).read_text()
    if re.search(rf"^\s+{snake(leaf)}: ", model, re.M):
        return
    # A whole block (spec.routing): the kind's api.py types the field with a model the trail's first file declares.
    kind_api = (ROOT / "operator/kinds" / field[0].lower() / "api.py").read_text()
    typed = re.search(rf"^\s+{snake(leaf)}: (.+)$", kind_api, re.M)
    assert typed is not None, f"{field}: neither {files[0]} nor the kind's api.py declares {snake(leaf)}"
    classes = set(re.findall(r"^class (\w+)\(", model, re.M))
    assert classes & set(re.findall(r"\w+", typed[1])), f"{field}: {files[0]} declares none of {typed[1]}"
