"""Text and HTML of a ``Divergence``: the verdict, the first divergence, where the error grew and the
ops only one run made (every string escaped)."""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Optional

from .._common import esc as _e
from .._location import format_location
from .html import BOX_STYLE, TITLE_STYLE, html_table


def _err(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf (NaN/Inf counts differ)"
    return f"{x:.3g}"


def _where(r: dict[str, Any]) -> str:
    loc = format_location(r.get("source_file"), r.get("source_line"), {})
    mod = r.get("module") or "(no module)"
    return f"{mod} at {loc}" if loc else mod


def first_lines(d: Any) -> list[str]:
    """The verdict and the first divergence, as sentences."""
    f = d.facts
    out = [f"{f['aligned']} ops aligned of {f['ops_a']} (a) and {f['ops_b']} (b): {f['identical']} identical, "
           f"{f['close']} close, {f['diverged']} diverged ({f['numeric']} numeric, {f['structural']} structural, "
           f"{f['propagated']} propagated), {f['unknown']} without fingerprints"]
    r = d.first
    if r is None:
        out.append("no divergence: every aligned op's outputs agree within the tolerance of its dtypes"
                   if not f["diverged"] else "no op diverged with agreeing inputs")
        return out
    why = ("its inputs agree" + (" (through casts only one run made)" if r["after_cast"] else "")
           if r["cause"] == "numeric" else "an input comes from ops only one run ran (kernel, decomposition "
           "or compiled region)")
    out.append(f"first divergence: {r['op']} in {_where(r)} [{r['phase']}] (a#{r['seq_a']}, b#{r['seq_b']}): "
               f"{r['dtype_a']} vs {r['dtype_b']}, relative error {_err(r['rel_err'])} > {r['threshold']:.3g}; "
               f"{why}")
    if r["explained"]:
        out.append(f"  within what the precision explains ({r['dtype_a']} vs {r['dtype_b']}: up to "
                   f"{r['expected']:.3g})")
    else:
        out.append(f"  beyond what the precision explains (up to {r['expected']:.3g} for {r['dtype_a']} vs "
                   f"{r['dtype_b']})")
    return out


def grew_rows(d: Any, limit: int) -> list[tuple[str, ...]]:
    return [(f"a#{r['seq_a']}", r["op"] or "", _where(r), _err(r["input_err"]), _err(r["rel_err"]),
             "inf" if r["growth"] is None or math.isinf(r["growth"]) else f"{r['growth']:.0f}x")
            for r in d.grew[:limit]]


def structure_rows(d: Any, limit: int) -> list[tuple[str, ...]]:
    s = d.structure
    if s.num_rows == 0:
        return []
    keys: Counter[tuple[str, ...]] = Counter()
    for r in s.to_pylist():
        dt = f"{r['in_dtype']} → {r['out_dtype']}" if r["kind"] == "cast" else ""
        keys[(r["side"], r["kind"], r["op"] or "", _where(r), dt)] += 1
    return [(side, kind, op, where, dt, str(n)) for (side, kind, op, where, dt), n in keys.most_common(limit)]


_GREW = ("op", "name", "where", "input error", "error", "growth")
_STRUCT = ("only in", "kind", "op", "where", "cast", "count")


def diverge_text(d: Any, limit: int = 10) -> str:
    lines = [f"tensorscope diverge: {d.label_a} → {d.label_b}"]
    lines += ["  " + s for s in first_lines(d)]
    g = grew_rows(d, limit)
    if g:
        lines.append("  where the error grew (" + " | ".join(_GREW) + "):")
        lines += ["    " + " | ".join(r) for r in g]
    st = structure_rows(d, limit)
    if st:
        lines.append("  structure: ops only one run made (" + " | ".join(_STRUCT) + "):")
        lines += ["    " + " | ".join(r) for r in st]
    lines.append("  one row per aligned pair in .pairs (Arrow); the unpaired ops in .structure")
    return "\n".join(lines)


def diverge_html(d: Any, limit: int = 10) -> str:
    parts = [f'<div class="tensorscope-diverge" style="{BOX_STYLE}">',
             f'<div style="{TITLE_STYLE}">tensorscope diverge: {_e(d.label_a)} → {_e(d.label_b)}</div>']
    parts += [f"<div>{_e(s)}</div>" for s in first_lines(d)]
    g = grew_rows(d, limit)
    if g:
        parts.append(f'<div style="{TITLE_STYLE}">where the error grew</div>')
        parts.append(html_table(_GREW, g))
    st = structure_rows(d, limit)
    if st:
        parts.append(f'<div style="{TITLE_STYLE}">structure: ops only one run made</div>')
        parts.append(html_table(_STRUCT, st))
    parts.append("</div>")
    return "".join(parts)
