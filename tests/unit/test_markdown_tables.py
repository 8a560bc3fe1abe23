"""Every Markdown table in the repository renders whole: its rows are contiguous, it starts with a header and a
delimiter row, and every row has the header's number of cells. A blank line inside a table (as once after the
router row of the README's benchmark table) cuts it in two, and GitHub renders the rows after it as loose text;
a row with a cell too many or too few loses or shifts cells."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DELIMITER = re.compile(r"^\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")


def cells(row: str) -> int:
    """The number of cells of a table row (escaped pipes `\\|` do not split; in GFM pipes in code spans do)."""
    body = row.strip().removeprefix("|").removesuffix("|")
    return len(re.split(r"(?<!\\)\|", body))


def table_problems(text: str) -> list[str]:
    """What breaks a table in `text`: a block of `|` lines that is not header + delimiter + rows of equal width."""
    problems: list[str] = []
    block: list[tuple[int, str]] = []
    fenced = False

    def check(rows: list[tuple[int, str]]) -> None:
        if not rows:
            return
        first_line, header = rows[0]
        if len(rows) < 2 or not DELIMITER.match(rows[1][1]):
            problems.append(
                f"line {first_line}: rows without a header and delimiter row above them (a table cut in two by a"
                f" blank line, or a stray row): {header.strip()[:80]}"
            )
            return
        width = cells(header)
        for number, row in rows[1:]:
            if cells(row) != width:
                problems.append(f"line {number}: {cells(row)} cells, the header has {width}: {row.strip()[:80]}")

    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("|"):
            block.append((number, line))
            continue
        check(block)
        block = []
    check(block)
    return problems


def markdown_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / name for name in listed.stdout.split() if not name.startswith("shared/")]


def test_the_checker_finds_a_table_cut_by_a_blank_line_and_a_row_of_the_wrong_width() -> None:
    whole = "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n"
    assert table_problems(whole) == []
    cut = "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n| 5 | 6 |\n"
    (problem,) = table_problems(cut)
    assert problem.startswith("line 5: rows without a header")
    (wide,) = table_problems("| a | b |\n|---|---|\n| 1 | 2 | 3 |\n")
    assert wide.startswith("line 3: 3 cells, the header has 2")
    assert table_problems("```\n| not | a table\n```\n") == []
    assert table_problems("| a | b |\n|---|---|\n| `x \\| y` | 2 |\n") == []


def test_readme_is_checked() -> None:
    assert REPO / "README.md" in markdown_files()


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_table_renders_whole(path: Path) -> None:
    assert table_problems(path.read_text()) == []
