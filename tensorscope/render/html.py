"""The one HTML table writer and the inline styles every tensorscope HTML output shares.

Jupyter styles every output table: JupyterLab and nbconvert's lab template
(``.jp-RenderedHTMLCommon td, th {text-align: right; white-space: normal; padding: .5em}``,
``table {table-layout: fixed; margin: auto}``) and the classic Notebook (``.rendered_html``) alike.
Inline styles outrank any selector without ``!important`` and survive JupyterLab's sanitizer
(a ``<style>`` element of an untrusted output does not), so every property those rules set is
set here on the element itself, scoped to our own tables: text reads left-aligned, numbers
right-aligned and never wrapped ("384.0 KiB" stays on one line), the same in a bare page.
Every cell is escaped here (``_common.esc``).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Optional

from .._common import esc

BOX_STYLE = "font-family:system-ui,-apple-system,'Segoe UI',sans-serif;font-size:12px;line-height:1.4;text-align:left"
TITLE_STYLE = "margin:6px 0 2px;font-weight:600;text-align:left"
NOTE_STYLE = "color:#a15c00;text-align:left"
IMG_STYLE = "display:block;max-width:100%;height:auto;margin:2px 0"
TABLE_STYLE = ("border-collapse:collapse;border-spacing:0;border:none;table-layout:auto;width:auto;"
               "margin:0 0 4px 0;font-size:12px;color:inherit")
_CELL = "padding:1px 8px;border:none;line-height:1.4;max-width:none;background:transparent;"
TH_STYLE = _CELL + "text-align:left;vertical-align:bottom;font-weight:600;white-space:nowrap"
TD_STYLE = _CELL + "text-align:left;vertical-align:top;white-space:normal;overflow-wrap:break-word"
NUM_STYLE = _CELL + "text-align:right;vertical-align:top;white-space:nowrap;font-variant-numeric:tabular-nums"
KEY_STYLE = _CELL + "text-align:left;vertical-align:top;white-space:nowrap"

#: a number, optionally with a unit, a share or a range: "384.0 KiB", "12", "1.5 ms", "3.2%", "12,345"
_NUMBER = re.compile(r"^[-+−]?[\d][\d,._]*(\s?(B|KiB|MiB|GiB|TiB|ns|µs|us|ms|s|%|x|×|/cell))?$")


#: columns that hold names even when every value looks like a number (module "0", cell 3)
_TEXT_HEADERS = frozenset(("module", "op", "phase", "device", "kind", "holder", "fix", "created", "type", "where",
                           "message", "when", "cell"))


def is_number_text(v) -> bool:
    return isinstance(v, (int, float)) or (isinstance(v, str) and bool(_NUMBER.match(v.strip())))


#: the summary's stylesheet: one ``<style>`` block per output instead of a style attribute per cell (54 KB of a
#: 438-op summary). Scoped under ``.tensorscope-summary`` so each rule outranks JupyterLab's and the classic
#: Notebook's (``.jp-RenderedHTMLCommon td``, ``.rendered_html td``: one class and one element; ours: two and
#: two). An untrusted
#: JupyterLab output loses the ``<style>`` element (its sanitizer): the tables then read as any DataFrame
#: does there (Jupyter's own table style), the table keeps its one inline style (auto layout, left margin).
SUMMARY_CSS = (
    ".tensorscope-summary{" + BOX_STYLE + "}"
    ".tensorscope-summary .ts-t{" + TITLE_STYLE + "}"
    ".tensorscope-summary .ts-note{" + NOTE_STYLE + "}"
    ".tensorscope-summary .ts-img{" + IMG_STYLE + "}"
    ".tensorscope-summary table.tensorscope-table td,.tensorscope-summary table.tensorscope-table th{"
    + TD_STYLE + "}"
    ".tensorscope-summary table.tensorscope-table th{font-weight:600;vertical-align:bottom;white-space:nowrap}"
    ".tensorscope-summary table.tensorscope-table td.n,.tensorscope-summary table.tensorscope-table th.n"
    "{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}"
    ".tensorscope-summary table.tensorscope-table td.k{white-space:nowrap}"
    ".tensorscope-summary details{margin:2px 0}"
    ".tensorscope-summary summary{cursor:pointer;font-weight:600}"
    ".tensorscope-summary .ts-head{font-size:13px;margin:0 0 2px}"
    ".tensorscope-summary .ts-bad{color:#b00020}"
    ".tensorscope-summary .ts-ok{color:#2e7d32}"
    ".tensorscope-summary .ts-pred{color:#6a1b9a;font-weight:600}"
    ".tensorscope-summary ol{margin:2px 0 4px 18px;padding:0}"
    ".tensorscope-summary .ts-sub{margin-left:14px}")


def style_block() -> str:
    return f"<style>{SUMMARY_CSS}</style>"


def html_table(header: Optional[Sequence[str]], rows: Sequence[Sequence[Any]], *, classes: bool = False) -> str:
    """One self-styled table: a column whose cells are all numbers (with units) is right-aligned and
    never wraps; every other column is left-aligned text. A header-less two-column table is a list of
    ``key: value`` pairs (keys on one line). ``classes``: the cells name their style as a class of
    ``SUMMARY_CSS`` (the output carries ``style_block()``) instead of an inline style each."""
    if classes:
        return _class_table(header, rows)
    ncols = max((len(r) for r in rows), default=len(header or ()))
    numeric = []
    for c in range(ncols):
        vals = [r[c] for r in rows if c < len(r) and r[c] not in (None, "", "-")]
        named = header is not None and c < len(header) and str(header[c]).lower() in _TEXT_HEADERS
        numeric.append(bool(vals) and not named and all(is_number_text(v) for v in vals))
    kv = header is None and ncols == 2
    parts = [f'<table class="tensorscope-table" style="{TABLE_STYLE}">']
    if header:
        parts.append("<thead><tr>" + "".join(
            f'<th style="{TH_STYLE}{";text-align:right" if c < ncols and numeric[c] else ""}">{esc(h)}</th>'
            for c, h in enumerate(header)) + "</tr></thead>")
    parts.append("<tbody>")
    for r in rows:
        cells = []
        for c, v in enumerate(r):
            st = NUM_STYLE if numeric[c] else (KEY_STYLE if kv and c == 0 else TD_STYLE)
            cells.append(f'<td style="{st}">{esc(v)}</td>')
        parts.append("<tr>" + "".join(cells) + "</tr>")
    parts.append("</tbody></table>")
    return "".join(parts)


def _numeric(header: Optional[Sequence[str]], rows: Sequence[Sequence[Any]]) -> list[bool]:
    ncols = max((len(r) for r in rows), default=len(header or ()))
    numeric = []
    for c in range(ncols):
        vals = [r[c] for r in rows if c < len(r) and r[c] not in (None, "", "-")]
        named = header is not None and c < len(header) and str(header[c]).lower() in _TEXT_HEADERS
        numeric.append(bool(vals) and not named and all(is_number_text(v) for v in vals))
    return numeric


#: the one inline style a class-styled table keeps: what Jupyter's table rules would otherwise change
CLASS_TABLE_STYLE = "border-collapse:collapse;table-layout:auto;width:auto;margin:0 0 4px 0"


def _class_table(header: Optional[Sequence[str]], rows: Sequence[Sequence[Any]]) -> str:
    numeric = _numeric(header, rows)
    kv = header is None and len(numeric) == 2
    # the two properties Jupyter's own table style gets wrong for us stay inline (they survive every sanitizer,
    # and JupyterLab drops the <style> element of an output it does not trust): text left, numbers unwrapped
    cls = ['<td class="n" style="white-space:nowrap">' if n else
           ('<td class="k" style="text-align:left;white-space:nowrap">' if kv and c == 0 else
            '<td style="text-align:left">') for c, n in enumerate(numeric)]
    parts = [f'<table class="tensorscope-table" style="{CLASS_TABLE_STYLE}">']
    if header:
        parts.append("<thead><tr>" + "".join(
            ('<th class="n">' if c < len(numeric) and numeric[c] else '<th style="text-align:left">') + f"{esc(h)}</th>"
            for c, h in enumerate(header)) + "</tr></thead>")
    parts.append("<tbody>")
    for r in rows:
        parts.append("<tr>" + "".join(f"{cls[c]}{esc(v)}</td>" for c, v in enumerate(r)) + "</tr>")
    parts.append("</tbody></table>")
    return "".join(parts)
