"""The docs site as a reader sees it, with no network: built, served on 127.0.0.1 and
opened page by page in Debian's headless Chromium.

On every page: each Mermaid diagram rendered (an <svg>, not its source shown as text), no
console error, no request for anything but 127.0.0.1, no element id twice (the API page
once documented the testing classes twice), no table wider than the page, and in the CLI
reference no `Sentinel.UNSET` and no empty code span for a default.

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


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=True,
    )
    return out


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
    assert facts["emptyCode"] == 0, f"{page}: empty code spans"
    assert not facts["sentinel"], f"{page}: shows a click sentinel as a default"
