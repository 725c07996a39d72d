"""SVG of the memory timeline: live bytes after each op, stacked by category, the peak marked.

Built by hand like ``render/svg.py`` (no matplotlib, no JavaScript, no URL); every text and hover
``<title>`` is escaped. The x axis is the op sequence; past ``width`` ops, each pixel column shows
the op with the most live bytes in it (so the peak is never averaged away). Each category is one
``<path>``: the area under the running sum of the categories up to it, as a step line that only
moves where the bytes change, drawn largest first so each covers the one below (a few hundred bytes
per category, whatever the number of ops). Colours come from ``svg.COLORS``, one legend entry per
category drawn. ``MIN_CHART_BYTES``: below it the summary draws no chart (a chart of 6 bytes says
nothing the table does not).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .._common import esc as _e
from .._common import fmt_bytes
from ..schema import MEMORY_CATEGORIES as CATEGORIES
from .svg import _FONT, COLORS, _legend, _where

#: no memory chart for a trace whose peak live bytes are below this (the table says it all)
MIN_CHART_BYTES = 4096


def _columns(live: np.ndarray, width: int) -> np.ndarray:
    """Indexes of the rows drawn: all when they fit, else per column the row with the largest total."""
    n = live.shape[1]
    if n <= width:
        return np.arange(n)
    edges = np.linspace(0, n, width + 1).astype(np.int64)
    total = live.sum(axis=0)
    out = [int(a + np.argmax(total[a:b])) for a, b in zip(edges[:-1], edges[1:]) if b > a]
    return np.array(out, dtype=np.int64)


def _step(xs: np.ndarray, ys: np.ndarray, base: float, x_end: float) -> str:
    """The path of the area under a step line through (xs, ys): moves only where y changes."""
    change = np.flatnonzero(np.diff(ys)) + 1
    xi = np.round(xs[change]).astype(np.int64).tolist()
    yi = ys[change].astype(np.int64).tolist()
    steps = "".join([f"H{x}V{v}" for x, v in zip(xi, yi)])
    return f"M{xs[0]:.0f} {base:.0f}V{ys[0]:.0f}{steps}H{x_end:.0f}V{base:.0f}z"


def memory_timeline_svg(timeline: Any, device: Optional[str] = None, width: int = 720, height: int = 160,
                        cells: Any = None, hovers: bool = True, px_per_column: int = 1) -> str:
    """The SVG of one device's rows of a MEMORY_TIMELINE table (the device with the highest peak
    when ``device`` is None); "" when there is nothing to draw."""
    if timeline is None or timeline.num_rows == 0:
        return ""
    import pyarrow.compute as pc

    dev_col = timeline.column("device")
    if device is None:
        names = pc.unique(dev_col).to_pylist()
        if len(names) == 1:
            device = names[0]
        else:
            live_all = pc.fill_null(timeline.column("live_bytes"), 0)
            best = [(-(pc.max(pc.filter(live_all, pc.equal(dev_col, d))).as_py() or 0), str(d), d) for d in names]
            device = min(best)[2]
    rows_of = np.flatnonzero(pc.fill_null(pc.equal(dev_col, device), False).to_numpy(zero_copy_only=False))
    if not len(rows_of):
        return ""
    sub = timeline.take(rows_of)
    live = np.stack([pc.fill_null(sub.column(f"{c}_bytes"), 0).to_numpy(zero_copy_only=False).astype(np.float64)
                     for c in CATEGORIES])
    peaks_at = np.flatnonzero(pc.fill_null(sub.column("is_peak"), False).to_numpy(zero_copy_only=False))
    peak_at = int(peaks_at[0]) if len(peaks_at) else int(np.argmax(live.sum(axis=0)))
    cols = {name: _At(sub.column(name)) for name in ("seq", "op", "phase", "module", "source_file", "source_line")}
    total = live.sum(axis=0)
    drawn = _columns(live, chart_columns(width, px_per_column))
    n = sub.num_rows
    return _draw(device, n, drawn, live[:, drawn], float(total.max()), peak_at, live[:, peak_at],
                 {name: cols[name][peak_at] for name in cols}, cols["seq"][0], cols["seq"][n - 1],
                 width, height, cells, hovers)


def chart_columns(width: int = 720, px_per_column: int = 1) -> int:
    """The pixel columns of a chart ``width`` wide, ``px_per_column`` pixels each."""
    return max((width - 64) // max(px_per_column, 1), 1)


def memory_digest_svg(digest: Any, ops: Any, device: Optional[str] = None, width: int = 720, height: int = 160,
                      cells: Any = None, hovers: bool = True) -> str:
    """``memory_timeline_svg`` of the same trace from its ``analyses.memory_digest.memory_digest``
    (computed for ``chart_columns(width, px_per_column)``): the same drawing, without the timeline."""
    devs = digest["devices"] if digest else []
    if not devs:
        return ""
    if device is None:
        p = devs[0] if len(devs) == 1 else min(devs, key=lambda d: (-d["peak_bytes"], str(d["device"])))
    else:
        found = [d for d in devs if d["device"] == device]
        if not found:
            return ""
        p = found[0]
    from ..analyses.memory_digest import digest_peaks

    peak_at = int(p["peak_seq"])
    row = next(r for r in digest_peaks({"n": digest["n"], "devices": [p]}, ops))
    return _draw(p["device"], digest["n"], np.asarray(p["drawn"], np.int64), np.asarray(p["drawn_live"], np.float64),
                 float(p["peak_bytes"]), peak_at, np.asarray(p["peak_categories"], np.float64), row, 0,
                 digest["n"] - 1, width, height, cells, hovers)


def _draw(device: str, n: int, drawn: np.ndarray, drawn_live: np.ndarray, top: float, peak_at: int,
          peak_live: np.ndarray, at_peak: dict[str, Any], first_seq: Any, last_seq: Any, width: int, height: int,
          cells: Any, hovers: bool) -> str:
    """The chart: ``drawn`` (the rows of each pixel column) with ``drawn_live`` (bytes per category of
    each), the peak row ``peak_at`` (its bytes per category, its op's columns ``at_peak``), of ``n`` rows."""
    if peak_at not in set(drawn.tolist()):
        k = int(np.searchsorted(drawn, peak_at))
        drawn = np.insert(drawn, k, peak_at)
        drawn_live = np.insert(drawn_live, k, peak_live, axis=1)
    top = top or 1.0
    left, right, top_pad, plot_h = 56, 8, 8, height
    plot_w = width - left - right
    xs = left + (drawn + 0.5) * plot_w / max(n, 1) if n > 1 else np.array([left + plot_w / 2.0])

    def y(v: np.ndarray) -> np.ndarray:
        return top_pad + plot_h - v / top * plot_h

    parts: list[str] = []
    used: list[str] = []
    drawn_cats = [(ci, c) for ci, c in enumerate(CATEGORIES) if drawn_live[ci].any()]
    if not drawn_cats:
        return ""
    cum = np.cumsum(drawn_live, axis=0)
    x_left = xs - (xs[1] - xs[0]) / 2 if len(xs) > 1 else xs - plot_w / 2.0
    x_end = left + plot_w
    areas = []
    for ci, c in drawn_cats:
        used.append(f"mem_{c}")
        ys = np.round(y(cum[ci]))
        title = f'<title>{_e(c.replace("_", " "))}: up to {_e(fmt_bytes(int(drawn_live[ci].max())))}</title>' \
            if hovers else ""
        areas.append(f'<path d="{_step(x_left, ys, top_pad + plot_h, x_end)}" fill="{_color(c)}">{title}</path>')
    parts.extend(reversed(areas))   # the running sum of all categories first: each next one covers the part below
    # the peak: a line at its op, with what it was
    total_peak = int(peak_live.sum())
    px = left + (peak_at + 0.5) * plot_w / max(n, 1) if n > 1 else left + plot_w / 2.0
    where = _where(at_peak["source_file"], at_peak["source_line"], cells)
    what = [f"peak {fmt_bytes(total_peak)} after op {at_peak['seq']} {at_peak['op'] or ''}",
            f"{at_peak['phase'] or ''}" + (f", module {at_peak['module']}" if at_peak["module"] else "")
            + (f", {where}" if where else "")]
    what += [f"{c.replace('_', ' ')} {fmt_bytes(int(peak_live[ci]))}" for ci, c in enumerate(CATEGORIES)
             if peak_live[ci]]
    parts.append(f'<line x1="{px:.1f}" y1="{top_pad}" x2="{px:.1f}" y2="{top_pad + plot_h}" stroke="#c00" '
                 f'stroke-width="1" stroke-dasharray="3,2">'
                 + (f"<title>{_e(chr(10).join(what))}</title>" if hovers else "") + "</line>")
    label = f"peak {fmt_bytes(total_peak)} ({at_peak['op'] or ''})"
    anchor = "end" if px > left + plot_w * 0.6 else "start"
    lx = px - 3 if anchor == "end" else px + 3
    parts.append(f'<text x="{lx:.1f}" y="{top_pad + 10}" {_FONT} fill="#c00" text-anchor="{anchor}">{_e(label)}</text>')
    # axes
    parts.append(f'<line x1="{left}" y1="{top_pad + plot_h}" x2="{left + plot_w}" y2="{top_pad + plot_h}" stroke="#999"/>')
    parts.append(f'<text x="{left - 4}" y="{top_pad + 9}" {_FONT} fill="#333" text-anchor="end">{_e(fmt_bytes(int(top)))}</text>')
    parts.append(f'<text x="{left - 4}" y="{top_pad + plot_h}" {_FONT} fill="#333" text-anchor="end">0</text>')
    parts.append(f'<text x="{left}" y="{top_pad + plot_h + 12}" {_FONT} fill="#333">op {_e(str(first_seq))}</text>')
    parts.append(f'<text x="{left + plot_w}" y="{top_pad + plot_h + 12}" {_FONT} fill="#333" text-anchor="end">'
                 f'op {_e(str(last_seq))} ({_e(device)})</text>')
    legend, lh = _legend(used, left, top_pad + plot_h + 20, plot_w)
    h = top_pad + plot_h + 20 + lh + 4
    return (f'<svg class="tensorscope-memory" width="{width}" height="{h:.0f}" viewBox="0 0 {width} {h:.0f}" '
            f'role="img"><title>{_e("live bytes by category after each op")}</title>{"".join(parts)}{legend}</svg>')


class _At:
    """One column read a value at a time (``col[i]``), without converting the column."""

    __slots__ = ("col",)

    def __init__(self, col: Any) -> None:
        self.col = col

    def __getitem__(self, i: int) -> Any:
        return self.col[i].as_py()


def _color(category: str) -> str:
    return COLORS[f"mem_{category}"][0]
