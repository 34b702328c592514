"""Build hooks of the docs site (listed under `hooks:` in mkdocs.yml).

- Mermaid is served from the site itself, so the diagrams render with no network. The
  npm package `mermaid` (pinned in package.json and package-lock.json, installed by
  `scripts/bootstrap dev` or `npm ci`) is copied to the site as MERMAID_JS, and each
  page with a diagram loads it after the theme's own script: Material then draws with
  the `mermaid` already loaded instead of fetching one from a CDN. Pages without a
  diagram do not load its 3.5 MB.
- The CLI reference's Default column (mkdocs-click, table style): since click 8.3 an
  option without a default holds a sentinel object, which mkdocs-click printed as
  `Sentinel.UNSET`, and an empty-string default gave an empty code span. Each row is
  now formatted from the option's info dict, which says None (or False for a flag)
  where nothing is set, on every click version; an empty string shows as `""`, and a
  required option as *required* (mkdocs-click writes `_required`, which Markdown
  leaves as it is).
- A table row with more or fewer cells than its header is a warning, so the strict build
  fails on it. Python-Markdown pads or drops cells to the header's count, which hides the
  mistake in the page: a row with one cell too many loses its last one, and a paragraph
  that follows a table without a blank line becomes rows of the table.
"""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Any

import click
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from mkdocs.utils import get_relative_url
from mkdocs_click import _docs

ROOT = Path(__file__).resolve().parent
MERMAID_SOURCE = ROOT / "node_modules" / "mermaid" / "dist" / "mermaid.min.js"
MERMAID_JS = "assets/javascripts/mermaid.min.js"

_format_table_option_row = _docs._format_table_option_row
log = logging.getLogger("mkdocs.hooks.tables")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
SEPARATOR = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")


def on_startup(**_: Any) -> None:
    _docs._format_table_option_row = _table_option_row


def on_files(files: Files, config: MkDocsConfig) -> Files:
    if not MERMAID_SOURCE.is_file():
        raise PluginError(
            f"{MERMAID_SOURCE.relative_to(ROOT)} is missing: run `npm ci` "
            "(scripts/bootstrap dev does) so the site serves its own Mermaid"
        )
    files.append(File.generated(config, MERMAID_JS, abs_src_path=str(MERMAID_SOURCE)))
    return files


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    for line, cells, expected in ragged_table_rows(markdown):
        log.warning(
            "%s:%d: a table row with %d cells under a header of %d (a missing or extra "
            "'|', or a paragraph with no blank line after the table)",
            page.file.src_uri,
            line,
            cells,
            expected,
        )
    return markdown


def ragged_table_rows(markdown: str) -> list[tuple[int, int, int]]:
    """(line number, cells, the header's cells) of each table row whose count differs from
    its header's, with the table extension's rules: a table is a block whose second line is
    a separator row, every line up to the next blank one is a row, and a `|` inside a code
    span or escaped is no separator. Fenced code is skipped."""
    lines = markdown.splitlines()
    ragged: list[tuple[int, int, int]] = []
    fence: str | None = None
    start = 0
    while start < len(lines):
        opening = FENCE.match(lines[start])
        if opening and (fence is None or opening[1].startswith(fence)):
            fence = None if fence else opening[1]
            start += 1
            continue
        is_table = (
            fence is None
            and "|" in lines[start]
            and start + 1 < len(lines)
            and SEPARATOR.match(lines[start + 1]) is not None
            and (start == 0 or not lines[start - 1].strip() or lines[start - 1].startswith("#"))
        )
        if not is_table:
            start += 1
            continue
        expected = len(_cells(lines[start]))
        end = start + 1
        while end < len(lines) and lines[end].strip():
            cells = len(_cells(lines[end]))
            if cells != expected:
                ragged.append((end + 1, cells, expected))
            end += 1
        start = end
    return ragged


def _cells(row: str) -> list[str]:
    """A table row's cells, split as Python-Markdown's table extension splits them."""
    row = row.strip()
    row = row.removeprefix("|")
    if row.endswith("|") and not row.endswith("\\|"):
        row = row[:-1]
    cells, cell, at = [], "", 0
    while at < len(row):
        char = row[at]
        if char == "\\" and at + 1 < len(row):
            cell += row[at : at + 2]
            at += 2
        elif char == "`":
            run = len(row[at:]) - len(row[at:].lstrip("`"))
            close = re.compile(rf"(?<!`)`{{{run}}}(?!`)").search(row, at + run)
            end = close.end() if close else at + run
            cell += row[at:end]
            at = end
        elif char == "|":
            cells.append(cell)
            cell, at = "", at + 1
        else:
            cell += char
            at += 1
    cells.append(cell)
    return cells


def on_post_page(output: str, page: Page, config: MkDocsConfig) -> str:
    if 'class="mermaid"' not in output:
        return output
    script = f'<script src="{get_relative_url(MERMAID_JS, page.url)}"></script>'
    head, body_end, tail = output.rpartition("</body>")
    return f"{head}{script}\n{body_end}{tail}"


def _table_option_row(option: click.Option) -> str:
    shown = copy.copy(option)
    default = option.to_info_dict()["default"]
    # An empty string is a real default (no table prefix): show it as `""`.
    shown.default = '""' if default == "" else default
    row = _format_table_option_row(shown)
    if shown.default is None and option.required:
        row = row.removesuffix(" _required |") + " *required* |"
    return row
