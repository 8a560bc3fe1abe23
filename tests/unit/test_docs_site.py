"""The documentation site (mkdocs.yml, docs/) builds strict and works in a real browser.

The site is built with `mkdocs build --strict` (a link to a missing page or anchor, or an included example that is
not there, fails it), served over HTTP from this process, and opened in headless Chromium (Debian's, driven by
playwright; `make docs-tools` installs it, and `make test` runs that first): the home page and a task page render
(screenshots in .state/docs-site/), the search finds "LoRA", three tasks (LoRA serving, Kueue, the chart's RBAC)
are reached in at most two clicks from the home page, and no page of the built site links to a missing page or
anchor. No cluster.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest

REPO = Path(__file__).resolve().parents[2]
SHOTS = REPO / ".state" / "docs-site"


def chromium() -> str:
    """The host's Chromium (LOOM_CHROMIUM, else Debian's `chromium` on PATH)."""
    found = os.environ.get("LOOM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "no Chromium on this machine: `make docs-tools` installs Debian's (apt-get install chromium)"
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture(scope="module")
def base_url(site: Path) -> Iterator[str]:
    handler = functools.partial(QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser: object) -> Iterator[object]:
    opened = browser.new_page(viewport={"width": 1280, "height": 900})  # type: ignore[attr-defined]
    yield opened
    opened.close()


def test_the_home_page_and_a_task_page_render(page: object, base_url: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.goto(base_url + "index.html")  # type: ignore[attr-defined]
    assert page.locator("h1").first.inner_text().rstrip("¶") == "Loom"  # type: ignore[attr-defined]
    assert page.locator("img[src$='architecture.svg']").evaluate("i => i.naturalWidth") > 0  # type: ignore[attr-defined]
    page.screenshot(path=str(SHOTS / "home.png"), full_page=True)  # type: ignore[attr-defined]
    page.goto(base_url + "tasks/adapters.html")  # type: ignore[attr-defined]
    assert page.locator("h1").first.inner_text().rstrip("¶") == "LoRA adapters"  # type: ignore[attr-defined]
    assert page.locator("pre code").count() >= 2  # type: ignore[attr-defined]
    page.screenshot(path=str(SHOTS / "task-adapters.png"), full_page=True)  # type: ignore[attr-defined]
    assert (SHOTS / "home.png").stat().st_size > 10_000
    assert (SHOTS / "task-adapters.png").stat().st_size > 10_000


def test_an_included_example_is_the_file_itself(page: object, base_url: str) -> None:
    """Concept pages include examples/ (pymdownx.snippets): what the reader sees is the file, line for line."""
    page.goto(base_url + "concepts/trainingjob.html")  # type: ignore[attr-defined]
    shown = page.locator("pre code").first.inner_text()  # type: ignore[attr-defined]
    assert shown.strip() == (REPO / "examples" / "trainingjob-fsdp-chargpt.yaml").read_text().strip()


def test_the_search_finds_lora(page: object, base_url: str) -> None:
    page.goto(base_url + "index.html")  # type: ignore[attr-defined]
    page.wait_for_load_state("networkidle")  # type: ignore[attr-defined]
    query = page.locator("input.md-search__input")  # type: ignore[attr-defined]
    query.click()
    found = page.locator(".md-search-result__item", has_text="LoRA")  # type: ignore[attr-defined]
    # The index loads in a web worker; on a loaded machine a query typed before it is ready can go unanswered, so
    # the query is typed again until results show (60 s at most).
    for _ in range(20):
        query.fill("")
        query.press_sequentially("LoRA", delay=50)  # key by key, as a reader types (fill sends one input event)
        try:
            found.first.wait_for(timeout=3_000)
            break
        except Exception:
            continue
    assert found.count() >= 2, page.locator(".md-search-result").text_content()  # type: ignore[attr-defined]
    assert "LoRA" in (found.first.text_content() or "")


@pytest.mark.parametrize(
    ("first", "second", "heading"),
    [
        ("Serve LoRA adapters", None, "LoRA adapters"),
        ("Quotas with Kueue", None, "Quotas and fair sharing with Kueue"),
        ("The Helm chart", "RBAC (least privilege)", "RBAC (least privilege)"),
    ],
)
def test_three_tasks_are_at_most_two_clicks_from_the_home_page(
    page: object, base_url: str, first: str, second: str | None, heading: str
) -> None:
    """LoRA serving and Kueue: one click (the home page's task table); the chart's RBAC: two (the chart's page,
    then its table of contents)."""
    page.goto(base_url + "index.html")  # type: ignore[attr-defined]
    page.locator("article").get_by_role("link", name=first, exact=True).first.click()  # type: ignore[attr-defined]
    if second is not None:
        page.locator("nav.md-nav--secondary").get_by_role("link", name=second, exact=True).first.click()  # type: ignore[attr-defined]
    shown = page.get_by_role("heading", name=heading).first  # type: ignore[attr-defined]
    shown.wait_for(timeout=10_000)
    assert shown.is_visible()


class Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if name in ("href", "src") and value and tag in ("a", "img"):
                self.hrefs.append(value)


def parsed(path: Path) -> Links:
    links = Links()
    links.feed(path.read_text(errors="replace"))
    return links


def test_no_page_links_to_a_missing_page_or_anchor(site: Path) -> None:
    pages = {path: parsed(path) for path in site.rglob("*.html")}
    missing: list[str] = []
    for path, links in pages.items():
        if path.name == "404.html":
            continue
        here = "http://site/" + path.relative_to(site).as_posix()
        for href in links.hrefs:
            target = urlsplit(urljoin(here, href))
            if target.netloc != "site" or target.scheme != "http":
                continue
            file = site / unquote(target.path.lstrip("/"))
            if file.is_dir():
                file = file / "index.html"
            if not file.exists():
                missing.append(f"{path.relative_to(site)}: {href}")
            elif target.fragment and file.suffix == ".html" and unquote(target.fragment) not in pages[file].ids:
                missing.append(f"{path.relative_to(site)}: {href} (no such anchor)")
    assert missing == []


def test_every_link_of_the_readme_resolves() -> None:
    text = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    broken = []
    for target in targets:
        if re.match(r"[a-z]+:", target):
            continue
        path, _, _ = target.partition("#")
        if path and not (REPO / path).exists():
            broken.append(target)
    assert broken == []


def test_the_readme_is_at_most_200_lines() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


COMMAND_FENCE = re.compile(r"^\s*```(bash|sh|shell|console|python)\s*$")
MARK = re.compile(r"^\s*<!-- commands: (run by|run in part by|not run by a test)\b(.*)-->$")


def command_blocks() -> list[tuple[Path, int, str]]:
    """(page, line, the mark above it or '') for every block of commands a reader is told to run: README.md and the
    site's pages (the generated CRD reference has none)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    found = []
    for page in pages:
        lines = page.read_text().splitlines()
        fenced = False
        for number, line in enumerate(lines, start=1):
            if line.lstrip().startswith("```"):
                included = number < len(lines) and lines[number].lstrip().startswith("--8<--")  # a file, shown
                if not fenced and COMMAND_FENCE.match(line) and not included:
                    above = lines[number - 2] if number >= 2 else ""
                    found.append((page, number, above if MARK.match(above) else ""))
                fenced = not fenced
    return found


def test_every_command_block_is_run_by_a_test_or_marked_not_run() -> None:
    """A `<!-- commands: run by <test> -->` (or `run in part by`, or `not run by a test`) line right above each
    block of commands; a test it names exists."""
    blocks = command_blocks()
    assert len(blocks) >= 10
    unmarked = [f"{page.relative_to(REPO)}:{line}" for page, line, mark in blocks if not mark]
    assert unmarked == []
    for page, line, mark in blocks:
        for named in re.findall(r"(?:e2e|tests)/[\w/]+\.py", mark):
            assert (REPO / named).exists(), f"{page.relative_to(REPO)}:{line} names {named}"
