"""Text and HTML of a ``TraceDiff``: the totals side by side, then the biggest changes first (escaped)."""
from __future__ import annotations

from .._common import esc as _e
from .._common import fmt_bytes, fmt_ns
from .html import BOX_STYLE, TITLE_STYLE, html_table


def _pct(a, b) -> str:
    if not a:
        return "new" if b else "±0%"
    return f"{100.0 * (b - a) / a:+.1f}%"


def _signed_ns(n) -> str:
    return "-" if n is None else ("+" if n >= 0 else "−") + fmt_ns(abs(n))


def _signed_bytes(n) -> str:
    return ("+" if n >= 0 else "−") + fmt_bytes(abs(n))


def total_rows(d):
    a, b = d.totals_a, d.totals_b
    rows = [("ATen ops", str(a["ops"]), str(b["ops"]), f"{b['ops'] - a['ops']:+d}"),
            ("CPU time in ops", fmt_ns(a["cpu_ns"]), fmt_ns(b["cpu_ns"]), _pct(a["cpu_ns"], b["cpu_ns"])),
            ("wall time", fmt_ns(a["wall_ns"]), fmt_ns(b["wall_ns"]), _pct(a["wall_ns"], b["wall_ns"])),
            ("hidden copies", str(a["hidden_copies"]), str(b["hidden_copies"]),
             f"{b['hidden_copies'] - a['hidden_copies']:+d}"),
            ("casts", str(a["casts"]), str(b["casts"]), f"{b['casts'] - a['casts']:+d}"),
            ("layout changes", str(a["layout_changes"]), str(b["layout_changes"]),
             f"{b['layout_changes'] - a['layout_changes']:+d}")]
    for dev in sorted(set(a["peak_bytes"]) | set(b["peak_bytes"])):
        x, y = a["peak_bytes"].get(dev, 0), b["peak_bytes"].get(dev, 0)
        rows.append((f"peak live bytes ({dev})", fmt_bytes(x), fmt_bytes(y), _pct(x, y)))
    rows.append(("leaked bytes", fmt_bytes(a["leaked_bytes"]), fmt_bytes(b["leaked_bytes"]),
                 _signed_bytes(b["leaked_bytes"] - a["leaked_bytes"])))
    return rows


def change_rows(d, limit):
    out = []
    for r in d.changed().slice(0, limit).to_pylist():
        what = r["op"] or ""
        if r["detail"] and r["section"] != "ops":
            what = f"{what} ({r['detail']})" if what else r["detail"]
        where = (r["module"] or "") + (f" [{r['phase']}]" if r["phase"] else "")
        out.append((r["section"], r["status"], where, what, f"{r['count_a']} → {r['count_b']}",
                    _signed_ns(r["delta_cpu_ns"]), _signed_bytes(r["delta_bytes"])))
    return out


_HEAD = ("section", "status", "module", "op", "count", "Δ CPU", "Δ bytes")


def diff_text(d, limit: int = 25) -> str:
    lines = [f"tensorscope diff: {d.label_a} → {d.label_b}"]
    for name, x, y, c in total_rows(d):
        lines.append(f"  {name}: {x} → {y} ({c})")
    ch = change_rows(d, limit)
    if ch:
        lines.append("  biggest changes (" + " | ".join(_HEAD) + "):")
        lines += ["    " + " | ".join(r) for r in ch]
    else:
        lines.append("  the same ops, casts and layout changes ran (times may differ: see .table)")
    n = d.changed().num_rows
    if n > limit:
        lines.append(f"  … {n - limit} more in .table")
    return "\n".join(lines)


def diff_html(d, limit: int = 25) -> str:
    parts = [f'<div class="tensorscope-diff" style="{BOX_STYLE}">',
             f'<div style="{TITLE_STYLE}">tensorscope diff: {_e(d.label_a)} → {_e(d.label_b)}</div>',
             html_table(("", d.label_a, d.label_b, "change"), total_rows(d))]
    ch = change_rows(d, limit)
    if ch:
        parts.append(f'<div style="{TITLE_STYLE}">biggest changes</div>')
        parts.append(html_table(_HEAD, ch))
    n = d.changed().num_rows
    if n > limit:
        parts.append(f"<div>… {n - limit} more in .table</div>")
    parts.append("</div>")
    return "".join(parts)
