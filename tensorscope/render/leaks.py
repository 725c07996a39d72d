"""The leak report (``tensorscope.find_leaks()``, ``%tensorscope leaks``) as text and as HTML.

``tracking.leaks.report.LeakReport`` is data (a LEAKS table, holder groups, totals per
device, notes); this module only draws it. The HTML uses the summary's self-styled
tables (``render.html.html_table``), so it reads the same in JupyterLab, the classic
Notebook, nbconvert's export and a bare page; every string is escaped.
"""
from __future__ import annotations

from .._common import esc as _e
from .._common import fmt_bytes
from .html import BOX_STYLE, NOTE_STYLE, html_table


def _created(g) -> str:
    created = ""
    if g.cells:
        created = "cell " + ",".join(str(c) for c in g.cells[:5])
    if g.sources:
        created += (" · " if created else "") + "; ".join(g.sources[:2])
    return created


def _totals_text(rep) -> str:
    return ", ".join(f"{d}: {fmt_bytes(b)}" for d, b in sorted(rep.totals.items()))


def _head(rep) -> str:
    n = len(rep.table)
    return (f"tensorscope leaks: {n} live storage{'s' if n != 1 else ''}, {_totals_text(rep) or 'nothing'}")


def _cost(rep) -> str:
    return f"searched {rep.visited} objects in {rep.elapsed_s * 1e3:.0f} ms"


def _group_kind(g) -> str:
    return g.holder_kind + (f", growing {fmt_bytes(g.growth_bytes)}/cell" if g.growth_bytes else "")


#: group kinds that are not leaks (nothing to release): listed after the leaks, under their own line
_NOT_LEAKS = frozenset(("model_state", "optimizer_state", "value"))


def report_text(rep, max_groups: int = 30) -> str:
    if not rep.groups:
        return "tensorscope leaks: no live tensor storage found" + "".join(f"\nnote: {n}" for n in rep.notes)
    lines = [f"{_head(rep)} ({_cost(rep)})"]
    said = False
    for g in rep.groups[:max_groups]:
        if g.holder_kind in _NOT_LEAKS and not said:
            lines.append("  not leaks (model/optimizer state, named values):")
            said = True
        devs = ", ".join(f"{d} {fmt_bytes(b)}" for d, b in sorted(g.by_device.items()))
        where = ""
        if g.cells:
            where = " · cell " + ",".join(str(c) for c in g.cells[:5])
        if g.sources:
            where += " · " + "; ".join(g.sources[:2])
        lines.append(f"  {fmt_bytes(g.nbytes):>10}  [{_group_kind(g)}] {g.holder}  ({g.n_storages} storage"
                     f"{'s' if g.n_storages != 1 else ''}: {devs}{where})")
        lines.append(f"{'':14}fix: {g.fix}")
    if len(rep.groups) > max_groups:
        lines.append(f"  … {len(rep.groups) - max_groups} more holders (see .table)")
    lines.extend(f"note: {n}" for n in rep.notes)
    return "\n".join(lines)


def state_line(nbytes: int, n: int) -> str:
    """``kept as model/optimizer state: 267.0 KiB in 4 storages``."""
    return f"kept as model/optimizer state: {fmt_bytes(nbytes)} in {n} storage{'s' if n != 1 else ''}"


def report_html(rep, max_groups: int = 100) -> str:
    parts = [f'<div class="tensorscope-leaks" style="{BOX_STYLE}">',
             f"<div><b>{_e(_head(rep))}</b> <span style='color:#777'>({_e(_cost(rep))})</span></div>"]
    if rep.groups:
        rows = [(fmt_bytes(g.nbytes), _group_kind(g), g.holder, str(g.n_storages), _created(g), g.fix)
                for g in rep.groups[:max_groups]]
        parts.append(html_table(("bytes", "kind", "holder", "storages", "created", "fix"), rows))
        if len(rep.groups) > max_groups:
            parts.append(f"<div>… {len(rep.groups) - max_groups} more holders (see .table)</div>")
    for n in rep.notes:
        parts.append(f'<div style="{NOTE_STYLE}">note: {_e(n)}</div>')
    parts.append("</div>")
    return "".join(parts)
