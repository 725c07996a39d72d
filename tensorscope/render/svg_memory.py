"""Inline SVG of the memory timeline: live bytes after each op, stacked by category, the peak marked.

Built by hand like ``render/svg.py`` (no matplotlib, no JavaScript, no URL); every text and hover
``<title>`` is escaped. The x axis is the op sequence; past ``width`` ops, each pixel column shows
the op with the most live bytes in it (so the peak is never averaged away). Colours come from
``svg.COLORS``, one legend entry per category drawn.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .._common import esc as _e
from .._common import fmt_bytes
from ..schema import MEMORY_CATEGORIES as CATEGORIES
from .svg import _FONT, COLORS, _legend, _where


def _columns(live: np.ndarray, width: int) -> np.ndarray:
    """Indexes of the rows drawn: all when they fit, else per column the row with the largest total."""
    n = live.shape[1]
    if n <= width:
        return np.arange(n)
    edges = np.linspace(0, n, width + 1).astype(np.int64)
    total = live.sum(axis=0)
    out = [int(a + np.argmax(total[a:b])) for a, b in zip(edges[:-1], edges[1:]) if b > a]
    return np.array(out, dtype=np.int64)


def memory_timeline_svg(timeline: Any, device: Optional[str] = None, width: int = 720, height: int = 160) -> str:
    """The SVG of one device's rows of a MEMORY_TIMELINE table (the device with the highest peak
    when ``device`` is None); "" when there is nothing to draw."""
    if timeline is None or timeline.num_rows == 0:
        return ""
    cols = timeline.to_pydict()
    devs = cols["device"]
    if device is None:
        best: dict[str, int] = {}
        for d, v in zip(devs, cols["live_bytes"]):
            best[d] = max(best.get(d, 0), v or 0)
        device = max(best, key=best.__getitem__)
    idx = [i for i, d in enumerate(devs) if d == device]
    if not idx:
        return ""
    live = np.array([[cols[f"{c}_bytes"][i] or 0 for i in idx] for c in CATEGORIES], dtype=np.float64)
    peak_at = next((k for k, i in enumerate(idx) if cols["is_peak"][i]), int(np.argmax(live.sum(axis=0))))
    total = live.sum(axis=0)
    top = float(total.max()) or 1.0
    left, right, top_pad, plot_h = 56, 8, 8, height
    plot_w = width - left - right
    drawn = _columns(live, plot_w)
    if peak_at not in set(drawn.tolist()):
        drawn = np.sort(np.append(drawn, peak_at))
    n = len(idx)
    xs = left + (drawn + 0.5) * plot_w / max(n, 1) if n > 1 else np.array([left + plot_w / 2.0])

    def y(v: np.ndarray) -> np.ndarray:
        return top_pad + plot_h - v / top * plot_h

    parts: list[str] = []
    used: list[str] = []
    below = np.zeros(len(drawn))
    for ci, c in enumerate(CATEGORIES):
        vals = live[ci, drawn]
        if not vals.any():
            continue
        used.append(f"mem_{c}")
        upper = below + vals
        pts = [f"{x:.1f},{yy:.1f}" for x, yy in zip(xs, y(upper))]
        pts += [f"{x:.1f},{yy:.1f}" for x, yy in zip(xs[::-1], y(below)[::-1])]
        color = _color(c)
        parts.append(f'<polygon points="{" ".join(pts)}" stroke="none" fill="{color}">'
                     f'<title>{_e(c.replace("_", " "))}: up to {_e(fmt_bytes(int(vals.max())))}</title></polygon>')
        below = upper
    if not used:
        return ""
    # the peak: a line at its op, with what it was
    i = idx[peak_at]
    px = left + (peak_at + 0.5) * plot_w / max(n, 1) if n > 1 else left + plot_w / 2.0
    where = _where(cols["source_file"][i], cols["source_line"][i])
    what = [f"peak {fmt_bytes(int(total[peak_at]))} after op {cols['seq'][i]} {cols['op'][i] or ''}",
            f"{cols['phase'][i] or ''}" + (f", module {cols['module'][i]}" if cols["module"][i] else "")
            + (f", {where}" if where else "")]
    what += [f"{c.replace('_', ' ')} {fmt_bytes(int(live[ci, peak_at]))}" for ci, c in enumerate(CATEGORIES)
             if live[ci, peak_at]]
    parts.append(f'<line x1="{px:.1f}" y1="{top_pad}" x2="{px:.1f}" y2="{top_pad + plot_h}" stroke="#c00" '
                 f'stroke-width="1" stroke-dasharray="3,2"><title>{_e(chr(10).join(what))}</title></line>')
    label = f"peak {fmt_bytes(int(total[peak_at]))} ({cols['op'][i] or ''})"
    anchor = "end" if px > left + plot_w * 0.6 else "start"
    lx = px - 3 if anchor == "end" else px + 3
    parts.append(f'<text x="{lx:.1f}" y="{top_pad + 10}" {_FONT} fill="#c00" text-anchor="{anchor}">{_e(label)}</text>')
    # axes
    parts.append(f'<line x1="{left}" y1="{top_pad + plot_h}" x2="{left + plot_w}" y2="{top_pad + plot_h}" stroke="#999"/>')
    parts.append(f'<text x="{left - 4}" y="{top_pad + 9}" {_FONT} fill="#333" text-anchor="end">{_e(fmt_bytes(int(top)))}</text>')
    parts.append(f'<text x="{left - 4}" y="{top_pad + plot_h}" {_FONT} fill="#333" text-anchor="end">0</text>')
    parts.append(f'<text x="{left}" y="{top_pad + plot_h + 12}" {_FONT} fill="#333">op {_e(str(cols["seq"][idx[0]]))}</text>')
    parts.append(f'<text x="{left + plot_w}" y="{top_pad + plot_h + 12}" {_FONT} fill="#333" text-anchor="end">'
                 f'op {_e(str(cols["seq"][idx[-1]]))} ({_e(device)})</text>')
    legend, lh = _legend(used, left, top_pad + plot_h + 20, plot_w)
    h = top_pad + plot_h + 20 + lh + 4
    return (f'<svg class="tensorscope-memory" width="{width}" height="{h:.0f}" viewBox="0 0 {width} {h:.0f}" '
            f'role="img"><title>{_e("live bytes by category after each op")}</title>{"".join(parts)}{legend}</svg>')


def _color(category: str) -> str:
    return COLORS[f"mem_{category}"][0]
