"""``check_substitution``'s report as text and as HTML (the report is data: substitution.py)."""
from __future__ import annotations

from .._common import esc
from .._location import format_location
from .html import BOX_STYLE, html_table

#: divergences listed before "… N more in report.table"
LIMIT = 40


def _where(r, cells=None) -> str:
    """``Cell In[N], line M`` or ``file.py:L`` (the one location format)."""
    if not r.get("source_file"):
        return ""
    return format_location(r["source_file"], r["source_line"], cells)


def _cells(rep):
    from .._location import trace_cells

    t = rep.wrapped if rep.wrapped is not None else rep.plain
    return trace_cells(t) if t is not None else None


def headline(rep) -> str:
    who = rep.subclass or "the subclass"
    if rep.ok:
        return f"{who} substitutes for torch.Tensor in {rep.fn_name}: no divergence"
    c = ", ".join(f"{n} {k}" for k, n in sorted(rep.counts().items(), key=lambda kv: -kv[1]))
    return f"{who} does not substitute for torch.Tensor in {rep.fn_name}: {rep.table.num_rows} divergence(s) ({c})"


def substitution_text(rep) -> str:
    lines = [headline(rep)]
    cells = _cells(rep)
    for r in rep.table.slice(0, LIMIT).to_pylist():
        where = _where(r, cells)
        lines.append(f"  - {r['kind']}: {r['op'] or ''}{' in ' + r['call'] if r['call'] else ''}"
                     f"{' [' + r['phase'] + ']' if r['phase'] else ''}: plain {r['plain']} → subclass {r['wrapped']}"
                     f"{' (' + where + ')' if where else ''}{' — ' + r['detail'] if r['detail'] else ''}")
    if rep.table.num_rows > LIMIT:
        lines.append(f"  … {rep.table.num_rows - LIMIT} more in report.table")
    return "\n".join(lines)


def substitution_html(rep) -> str:
    color = "#1a7f37" if rep.ok else "#b42318"
    parts = [f'<div class="tensorscope-substitution" style="{BOX_STYLE}">',
             f'<div style="font-weight:600;color:{color}">{esc(headline(rep))}</div>']
    if not rep.ok:
        cells = _cells(rep)
        rows = [(r["kind"], r["phase"], r["op"], r["call"], r["plain"], r["wrapped"], _where(r, cells), r["detail"])
                for r in rep.table.slice(0, LIMIT).to_pylist()]
        parts.append(html_table(("kind", "phase", "op", "call", "plain", "subclass", "where", "detail"), rows))
        if rep.table.num_rows > LIMIT:
            parts.append(f"<div>… {rep.table.num_rows - LIMIT} more in report.table</div>")
    parts.append("</div>")
    return "".join(parts)
