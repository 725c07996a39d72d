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


def html_table(header: Optional[Sequence[str]], rows: Sequence[Sequence[Any]]) -> str:
    """One self-styled table: a column whose cells are all numbers (with units) is right-aligned and
    never wraps; every other column is left-aligned text. A header-less two-column table is a list of
    ``key: value`` pairs (keys on one line)."""
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
