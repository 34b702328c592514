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
"""

from __future__ import annotations

import copy
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
