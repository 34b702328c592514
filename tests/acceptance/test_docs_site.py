"""The docs site as a reader sees it, with no network: built, served on 127.0.0.1 and
opened page by page in Debian's headless Chromium.

On every page: each Mermaid diagram rendered (an <svg>, not its source shown as text), no
console error, no request for anything but 127.0.0.1, no element id twice (the API page
once documented the testing classes twice), no table wider than the page or with rows
of unequal width, and in the CLI reference no `Sentinel.UNSET` and no empty code span for
a default.

The build itself is strict and shows its warnings (`--quiet` would hide them, and strict
mode then passes whatever they say). A table row with more or fewer cells than its header
is one of them (the site's build hooks): once rendered, the row has been padded or cut to
the header's width, and the page no longer shows the mistake.

INBOX_DOCS_SCREENSHOTS=DIR saves a full-page screenshot of every page in DIR.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ..support.browser import Browser, chromium

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(
    path.relative_to(DOCS).as_posix()
    for path in DOCS.rglob("*.md")
    if DOCS / "snippets" not in path.parents
)
RAW_DIAGRAM = re.compile(r'<pre class="mermaid"')
SCREENSHOTS = os.environ.get("INBOX_DOCS_SCREENSHOTS")

# What the page shows once its scripts ran, measured in the page.
PAGE_FACTS = """(() => {
  const content = document.querySelector('.md-content');
  const width = content.getBoundingClientRect().right;
  const counts = {};
  for (const element of document.querySelectorAll('[id]')) {
    counts[element.id] = (counts[element.id] || 0) + 1;
  }
  const label = (t) => (t.querySelector('th, td') || t).textContent.trim().slice(0, 40);
  return {
    duplicateIds: Object.keys(counts).filter((id) => counts[id] > 1),
    wideTables: [...content.querySelectorAll('table')]
      .filter((t) => t.getBoundingClientRect().right > width + 1
        || (t.closest('.md-typeset__scrollwrap') || t).scrollWidth
          > (t.closest('.md-typeset__scrollwrap') || t).clientWidth + 1)
      .map(label),
    raggedTables: [...content.querySelectorAll('table')]
      .filter((t) => new Set([...t.rows].map((r) => [...r.cells]
        .reduce((n, c) => n + c.colSpan, 0))).size > 1)
      .map(label),
    emptyCode: [...content.querySelectorAll('code')]
      .filter((c) => !c.closest('pre') && !c.textContent.trim()).length,
    sentinel: content.innerText.includes('Sentinel.'),
    rawDiagrams: document.querySelectorAll('pre.mermaid').length,
  };
})()"""


def url_of(page: str) -> str:
    """The page's address under mkdocs' directory URLs: how-to/x.md is how-to/x/."""
    stem = page.removesuffix(".md")
    if stem == "index" or stem.endswith("/index"):
        return stem.removesuffix("index")
    return f"{stem}/"


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def build(config: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` as scripts/test runs it: warnings shown, and fatal."""
    command = ["mkdocs", "build", "--strict", "-f", str(config), "--site-dir", str(out)]
    return subprocess.run(
        [sys.executable, "-m", *command],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = build(ROOT / "mkdocs.yml", out)
    assert built.returncode == 0, built.stdout + built.stderr
    assert "WARNING" not in built.stdout + built.stderr, built.stdout + built.stderr
    return out


# The failures guide's table as it once was: one row with a cell too many, and the
# paragraph after it with no blank line in between (rendered as three bogus rows).
RAGGED = """\
# Failures

| the handler | Dramatiq | FastStream |
|---|---|---|
| settles it itself | | `msg.ack()`, `msg.nack()` raise `HandlerTransactionError` |
| catches a database error | the commit is refused | the same | Dramatiq's Redis broker
and FastStream's Redis streams do not report redeliveries.

| a `|` in code | an escaped \\| pipe |
|---|---|
| `a | b` | c \\| d |
"""


def test_docs_site__a_table_row_with_the_wrong_number_of_cells_fails_the_build(tmp_path: Path):
    # Given a site with the project's build hooks, whose one page has a ragged table
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(RAGGED)
    config = tmp_path / "mkdocs.yml"
    config.write_text(
        f"site_name: ragged\ndocs_dir: {docs}\nhooks: [{ROOT / 'mkdocs_hooks.py'}]\n"
        "markdown_extensions: [tables]\n"
    )

    # When it is built as the suite builds the real one
    built = build(config, tmp_path / "site")

    # Then the build fails, naming each row that is not as wide as its header (and not the
    # rows whose `|` is in code or escaped)
    output = built.stdout + built.stderr
    assert built.returncode != 0, output
    row = r"index\.md:(\d+): a table row with (\d+) cells under a header of 3"
    warned = re.findall(row, output)
    assert warned == [("6", "4"), ("7", "1")], output
    assert output.count("a table row with") == 2, output


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def browser(served: str) -> Iterator[Browser]:
    with chromium() as opened:
        opened.open_tab()
        yield opened


def rendered_diagrams(node: dict[str, Any]) -> Iterator[bool]:
    """For each <div class="mermaid"> Material made: whether its shadow root holds an svg
    that is a diagram (Mermaid draws a bomb with aria-roledescription="error" instead)."""
    attributes = node.get("attributes", [])
    named = dict(zip(attributes[::2], attributes[1::2], strict=True))
    if node.get("localName") == "div" and "mermaid" in named.get("class", "").split():
        svgs = [n for root in node.get("shadowRoots", []) for n in _descendants(root, "svg")]
        yield bool(svgs) and all(
            dict(zip(s["attributes"][::2], s["attributes"][1::2], strict=True)).get(
                "aria-roledescription"
            )
            != "error"
            for s in svgs
        )
    for child in node.get("children", []) + node.get("shadowRoots", []):
        yield from rendered_diagrams(child)


def _descendants(node: dict[str, Any], name: str) -> Iterator[dict[str, Any]]:
    for child in node.get("children", []):
        if child.get("localName") == name:
            yield child
        yield from _descendants(child, name)


def test_docs_site__has_diagrams_to_check(site: Path):
    # The page test below checks what it finds: make sure it finds diagrams at all.
    pages = [p for p in site.rglob("*.html") if RAW_DIAGRAM.search(p.read_text())]
    assert len(pages) >= 3, pages


@pytest.mark.parametrize("page", PAGES)
def test_docs_site__page_renders_offline(page: str, site: Path, served: str, browser: Browser):
    # Given the page as built, with the diagrams Mermaid is to draw
    html = (site / url_of(page) / "index.html").read_text()
    expected = len(RAW_DIAGRAM.findall(html))

    # When Chromium opens it from 127.0.0.1, and Material has had the time to draw them
    visit = browser.visit(served + url_of(page))
    browser.wait_until(f"document.querySelectorAll('div.mermaid').length >= {expected}", 15)
    browser.settle(0.2)
    facts = browser.evaluate(PAGE_FACTS)
    diagrams = list(rendered_diagrams(browser.document()))
    browser.collect(visit)
    if SCREENSHOTS:
        name = url_of(page).strip("/").replace("/", "_") or "index"
        browser.screenshot(Path(SCREENSHOTS) / f"{name}.png")

    # Then every diagram is a drawing, and the page needed nothing from elsewhere
    assert facts["rawDiagrams"] == 0 and diagrams.count(True) == expected, (
        f"{page}: {diagrams.count(True)} of {expected} Mermaid diagrams rendered"
    )
    assert visit.errors == [], f"{page}: console errors"
    assert visit.foreign_requests() == [], f"{page}: requests that leave 127.0.0.1"
    assert facts["duplicateIds"] == [], f"{page}: ids on more than one element"
    assert facts["wideTables"] == [], f"{page}: tables wider than the page"
    assert facts["raggedTables"] == [], f"{page}: tables whose rows have unequal cells"
    assert facts["emptyCode"] == 0, f"{page}: empty code spans"
    assert not facts["sentinel"], f"{page}: shows a click sentinel as a default"
