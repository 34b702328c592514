"""The growth benchmark's charts of the claim as the table grows, one question each.

    python -m bench.growth_charts run1/growth.json run2/growth.json --out docs/assets/benchmark

- growth-claim.png: does the claim's cost grow with the table? Each series' claim /
  update at each size over the same ratio on its empty table (1 is the empty table's
  cost; the band is the target: within 10%).
- growth-wal.png: what a claim transaction writes (WAL bytes) and reads (blocks from
  outside shared buffers) at each size: where the cost goes when it grows.
- growth-bytes.png: the bytes a remembered message takes at each series' largest size,
  heap and key apart (the line: 120 bytes).

`python -m bench.growth` draws them from its own run (with the purge's charts); several
runs (one a layout at 10^8 rows takes most of an hour) are drawn together from their
reports, a later report's figures replacing an earlier one's for the same series and
size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TARGET_BYTES = 120
"""Bytes a remembered message, at most (the compact row's target)."""
FLAT = 0.10
"""How far from the empty table's claim / update a size may be and still count as flat."""


def series(shape: str, layout: str) -> str:
    """A shape and layout's name in a report: the shape alone for the library's table."""
    return shape if layout == "plain" else f"{shape}, {layout}"


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' reports as one: each series and size keeps its last run's figures."""
    loads: dict[tuple[str, str, int, str], dict[str, Any]] = {}
    ratios: dict[tuple[str, str, int], dict[str, Any]] = {}
    merged: dict[str, Any] = {"sizes": {}, "purge": {}}
    for report in reports:
        for load in report["loads"]:
            key = (load["shape"], load.get("layout", "plain"), load["rows"], load["mode"])
            loads[key] = load
        for ratio in report["ratios"]:
            ratios[(ratio["shape"], ratio.get("layout", "plain"), ratio["rows"])] = ratio
        merged["sizes"] |= report["sizes"]
        merged["purge"] |= report["purge"]
    return merged | {"loads": list(loads.values()), "ratios": list(ratios.values())}


_SHAPES = {"random": "random ids", "ordered": "time-ordered ids", "uuid7": "UUIDv7 ids"}
_LAYOUTS = {
    "plain": "the library's table",
    "library_compact": "the compact claim",
    "partitioned": "a partition a day",
    "compact": "the compact row, a partition a day",
    "idtime": "the compact row by the id's time",
}


def _label(shape: str, layout: str) -> str:
    """A series' name on a chart: its ids and its table, in words."""
    return f"{_SHAPES.get(shape, shape)}, {_LAYOUTS.get(layout, layout)}"


def _lines(report: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """Each series' sizes, each with its ratio and its claim load's figures."""
    claims = {
        (series(x["shape"], x.get("layout", "plain")), x["rows"]): x
        for x in report["loads"]
        if x["mode"] == "claim"
    }
    lines: dict[str, dict[int, dict[str, Any]]] = {}
    for ratio in report["ratios"]:
        shape, layout = ratio["shape"], ratio.get("layout", "plain")
        name = series(shape, layout)
        lines.setdefault(_label(shape, layout), {})[ratio["rows"]] = {
            "ratio": ratio["claim_over_update"],
            "sizes": report["sizes"].get(f"{name}/{ratio['rows']}"),
            **claims.get((name, ratio["rows"]), {}),
        }
    return {name: dict(sorted(sizes.items())) for name, sizes in sorted(lines.items())}


_SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")


def _size_label(rows: int) -> str:
    if not rows:
        return "empty"
    exponent = len(str(rows)) - 1
    if rows == 10**exponent:
        return f"10{str(exponent).translate(_SUPERSCRIPT)}"
    return f"{rows:,}"


def charts(report: dict[str, Any], out: Path) -> list[Path]:
    """Draw the three charts of the claim's growth into ``out``; the paths written (none
    when the report measured no size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = _lines(report)
    if not lines:
        return []
    sizes = sorted({rows for points in lines.values() for rows in points})
    at = {rows: index for index, rows in enumerate(sizes)}
    ticks = ([at[rows] for rows in sizes], [_size_label(rows) for rows in sizes])
    written: list[Path] = []
    for name, draw in (
        ("growth-claim.png", _claim_chart),
        ("growth-wal.png", _wal_chart),
        ("growth-bytes.png", _bytes_chart),
    ):
        fig = draw(plt, lines, at, ticks)
        if fig is None:
            continue
        written.append(out / name)
        fig.savefig(written[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return written


Lines = dict[str, dict[int, dict[str, Any]]]
Ticks = tuple[list[int], list[str]]


def _claim_chart(plt: Any, lines: Lines, at: dict[int, int], ticks: Ticks) -> Any:
    fig, ax = plt.subplots(figsize=(8, 4.6))
    ax.axhspan(1 - FLAT, 1 + FLAT, color="#dfe8f3", zorder=0)
    ax.text(0, 1 + FLAT, f" target: within {FLAT:.0%} of the empty table", fontsize=8, va="bottom")
    for name, points in lines.items():
        empty = points.get(0, {}).get("ratio")
        if not empty:
            continue
        xs = [at[rows] for rows in points]
        ys = [point["ratio"] / empty for point in points.values()]
        ax.plot(xs, ys, "o-", label=name)
        ax.text(xs[-1], ys[-1], f"  {ys[-1]:.2f}", fontsize=8, va="center")
    ax.set_xticks(*ticks)
    ax.set_xlabel("rows in the inbox")
    ax.set_ylabel("claim / update, over the same on the empty table")
    ax.set_title("Does the claim's cost grow with the table?", fontsize=11)
    ax.legend(fontsize=8, loc="lower left")
    ax.spines[["top", "right"]].set_visible(False)
    return fig


def _wal_chart(plt: Any, lines: Lines, at: dict[int, int], ticks: Ticks) -> Any:
    fig, (wal, reads) = plt.subplots(1, 2, figsize=(11, 4.6))
    for name, points in lines.items():
        xs = [at[rows] for rows in points]
        wal.plot(xs, [p.get("wal_bytes_per_tx", 0) for p in points.values()], "o-", label=name)
        reads.plot(xs, [p.get("blocks_read_per_tx", 0) for p in points.values()], "o-")
    wal.set_yscale("log")
    wal.set_ylabel("WAL bytes a claim transaction")
    reads.set_ylabel("blocks read a claim transaction\n(outside shared buffers)")
    reads.set_ylim(bottom=0)
    for ax in (wal, reads):
        ax.set_xticks(*ticks)
        ax.set_xlabel("rows in the inbox")
        ax.spines[["top", "right"]].set_visible(False)
    fig.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2)
    fig.suptitle("What a claim writes and reads as the table grows", fontsize=11)
    return fig


def _bytes_chart(plt: Any, lines: Lines, _: dict[int, int], __: Ticks) -> Any:
    bars = []
    for name, points in lines.items():
        top = max(points)
        sized = points[top]["sizes"]
        if top and sized:
            bars.append((f"{name} ({_size_label(top)} rows)", sized))
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(bars) + 2.2))
    for index, (_, sized) in enumerate(bars):
        heap, key = sized["table_bytes_per_row"], sized["primary_key_bytes_per_row"]
        other = max(sized["bytes_per_row"] - heap - key, 0.0)
        parts = [("heap", heap, "#2f6db3"), ("key", key, "#7fa6d6")]
        if other >= 1:  # below a byte: rounding, not an index
            parts.append(("other indexes", other, "#9aa9b8"))
        left = 0.0
        for label, width, color in parts:
            ax.barh(index, width, left=left, color=color, height=0.6,
                    label=label if not index else None)  # fmt: skip
            left += width
        ax.text(left, index, f" {sized['bytes_per_row']:.0f}", va="center", fontsize=9)
    ax.axvline(TARGET_BYTES, color="black", linestyle="--", linewidth=1)
    ax.text(TARGET_BYTES, 0.01, f" target: {TARGET_BYTES}", fontsize=8,
            transform=ax.get_xaxis_transform())  # fmt: skip
    ax.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("bytes a remembered message (table and indexes over rows)")
    ax.set_title("What a remembered message costs on disk", fontsize=11)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    ax.spines[["top", "right"]].set_visible(False)
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.growth_charts", description=__doc__)
    parser.add_argument("reports", nargs="+", type=Path, help="growth.json of each run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    report = merge([json.loads(path.read_text()) for path in args.reports])
    args.out.mkdir(parents=True, exist_ok=True)
    for chart in charts(report, args.out):
        print(f"chart: {chart}")


if __name__ == "__main__":
    main()
