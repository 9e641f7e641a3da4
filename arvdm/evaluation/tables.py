"""Results tables: one row per configuration, as CSV (full precision) and as a Markdown table.

    from arvdm.evaluation.tables import write_results_table
    write_results_table(rows, "out/results.csv", "out/results.md")      # rows: mappings column -> value

Contract: a missing or None value is a blank cell; the Markdown table shows floats with 4 significant
digits (``format_value``) and escapes ``|`` inside cells. Both files are written atomically.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from data.atomic import atomic_write_text

__all__ = ["format_value", "markdown_table", "write_results_table"]

#: Significant digits of a float in a Markdown table or a points CSV.
SIGNIFICANT_DIGITS = 4


def format_value(v: Any) -> str:
    """A table cell: floats with ``SIGNIFICANT_DIGITS`` significant digits, '' for None / NaN, str otherwise."""
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.{SIGNIFICANT_DIGITS}g}"
    return str(v)


def _columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None) -> list[str]:
    """The given column order, else the union of the rows' keys in first-seen order (every field appears)."""
    if columns is not None:
        return list(columns)
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    return cols


def _escape(s: str) -> str:
    """A Markdown cell's text: a '|' inside it would split the cell."""
    return s.replace("|", "\\|")


def write_results_table(
    rows: Sequence[Mapping[str, Any]],
    csv_path: str | os.PathLike,
    md_path: str | os.PathLike,
    columns: Sequence[str] | None = None,
) -> tuple[Path, Path]:
    """Write one row per configuration as CSV (full precision) and as a Markdown table (4 significant digits).

    Args:
        rows: mappings of column -> value (missing values are left blank).
        columns: column order; default the union of the rows' keys in first-seen order.
    Returns:
        (csv_path, md_path).
    """
    cols = _columns(rows, columns)
    if not cols:
        raise ValueError("write_results_table: no columns (empty rows and no columns given)")
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in cols})
    csv_out = atomic_write_text(csv_path, buf.getvalue())

    md_out = atomic_write_text(md_path, markdown_table(rows, cols))
    return csv_out, md_out


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A Markdown table of the given columns (``format_value`` cells, blank where missing), newline-terminated."""
    lines = ["| " + " | ".join(_escape(c) for c in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_escape(format_value(r.get(c))) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"
