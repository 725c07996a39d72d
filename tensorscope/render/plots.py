"""Matplotlib plots of a Trace: ``t.plot.timeline()``, ``top_ops()``, ``memory()``, ``modules()``.

Role: draw, never compute anything the tables do not already hold (beyond a
group-by). Every plot returns a ``matplotlib.figure.Figure`` built with the
object-oriented API: no ``pyplot``, no global state, no ``plt.show()``. The
figure is a ``PlotFigure`` (a Figure with ``_repr_png_``), so in Jupyter it
displays as an ``image/png`` output whatever the matplotlib backend (no
``%matplotlib inline`` needed: a Figure made outside matplotlib's global
figure manager has no notebook display of its own);
elsewhere call ``fig.savefig(...)``. matplotlib is imported on first use only.

``PlotAccessor(trace)``:

* ``timeline(max_bars=20000)`` — torch-level calls by nesting depth, ATen ops
  (forward / backward colours) and, when the ``kernels`` table has rows, one
  row per (device, stream) of GPU kernels; x is ms since the trace start.
  Past ``max_bars`` ops only the longest are drawn (the title says so).
* ``top_ops(by="cpu_ns"|"cuda_ns"|"flops"|"bytes", n=15)`` — horizontal bars
  of the per-op-name total, largest on top.
* ``memory()`` — live bytes over op sequence per device, from the derived
  ``memory`` view; a figure saying so when the view is empty.
* ``modules(by="cpu_ns", n=15)`` — time per module path (each op counted in
  its innermost module).

``timeline_png(trace, width_px=640, height_px=None) -> bytes`` renders a
compact timeline to PNG in memory for the notebook summary (no file).
"""
from __future__ import annotations

import io
from typing import Optional

__all__ = ["PlotAccessor", "timeline_png", "TOP_BY"]

TOP_BY = ("cpu_ns", "cuda_ns", "flops", "bytes")
_COLORS = {"call": "#8da0cb", "forward": "#fc8d62", "backward": "#66c2a5", "kernel": "#e78ac3", "other": "#b3b3b3"}


_FIGURE_CLASS = None


def figure_class():
    """``PlotFigure``: a ``matplotlib.figure.Figure`` that IPython displays as ``image/png``
    (``_repr_png_``; ``%matplotlib inline``'s own Figure formatter, when registered, takes precedence
    and draws the same PNG). Made on first use, so importing this module imports no matplotlib."""
    global _FIGURE_CLASS
    if _FIGURE_CLASS is None:
        from matplotlib.figure import Figure

        class PlotFigure(Figure):
            """A tensorscope plot: a matplotlib Figure that displays itself in Jupyter."""

            def _repr_png_(self) -> bytes:
                buf = io.BytesIO()
                self.savefig(buf, format="png")
                return buf.getvalue()

            def __repr__(self) -> str:
                w, h = self.get_size_inches() * self.dpi
                return f"<tensorscope plot {w:.0f}x{h:.0f} px: {', '.join(a.get_title() for a in self.axes)}>"

        PlotFigure.__module__ = __name__
        _FIGURE_CLASS = PlotFigure
    return _FIGURE_CLASS


def _figure(w: float = 9.0, h: float = 3.5, dpi: int = 100):
    return figure_class()(figsize=(w, h), dpi=dpi, layout="constrained")


def _table(trace, name):
    try:
        fn = getattr(trace, "table", None)
        return fn(name) if callable(fn) else trace.tables.get(name)
    except Exception:
        return None


def _empty(fig, ax, text):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#555555")
    ax.set_xticks([])
    ax.set_yticks([])
    return fig


def _fmt_value(v: float, by: str) -> str:
    if by.endswith("_ns"):
        for unit, d in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
            if v >= d:
                return f"{v / d:.3g} {unit}"
        return f"{v:.0f} ns"
    if by == "bytes":
        for unit, d in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if v >= d:
                return f"{v / d:.3g} {unit}"
        return f"{v:.0f} B"
    for unit, d in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= d:
            return f"{v / d:.3g}{unit}"
    return f"{v:.0f}"


def _timeline_rows(trace, max_bars: int):
    """[(label, [(start_ms, dur_ms)], colors)] and a note, from calls/ops/kernels."""
    rows: list[tuple[str, list[tuple[float, float]], list[str]]] = []
    note = None
    calls = _table(trace, "calls")
    if calls is not None and calls.num_rows:
        c = calls.select(["start_ns", "dur_ns", "depth"]).to_pydict()
        by_depth: dict[int, list[tuple[float, float]]] = {}
        for s, d, dep in zip(c["start_ns"], c["dur_ns"], c["depth"]):
            if s is None:
                continue
            by_depth.setdefault(dep or 0, []).append((s / 1e6, max(d or 0, 0) / 1e6))
        for dep in sorted(by_depth)[:6]:
            bars = by_depth[dep]
            rows.append((f"calls d{dep}", bars, [_COLORS["call"]] * len(bars)))
    ops = _table(trace, "ops")
    if ops is not None and ops.num_rows:
        o = ops.select(["start_ns", "cpu_ns", "phase"]).to_pydict()
        items = [(s, d or 0, ph) for s, d, ph in zip(o["start_ns"], o["cpu_ns"], o["phase"]) if s is not None]
        if len(items) > max_bars:
            items = sorted(items, key=lambda x: -x[1])[:max_bars]
            note = f"longest {max_bars} of {ops.num_rows} ops"
        bars = [(s / 1e6, d / 1e6) for s, d, _ in items]
        cols = [_COLORS.get(ph or "other", _COLORS["other"]) for _, _, ph in items]
        rows.append(("ATen ops", bars, cols))
    kernels = _table(trace, "kernels")
    if kernels is not None and kernels.num_rows:
        k = kernels.select(["device", "stream", "start_ns", "dur_ns"]).to_pydict()
        tracks: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for dev, st, s, d in zip(k["device"], k["stream"], k["start_ns"], k["dur_ns"]):
            if s is None:
                continue   # failed its timestamp check: not drawn at a wrong place
            tracks.setdefault((dev or 0, st or 0), []).append((s / 1e6, max(d or 0, 0) / 1e6))
        for (dev, st) in sorted(tracks):
            bars = tracks[(dev, st)]
            rows.append((f"cuda:{dev} s{st}", bars, [_COLORS["kernel"]] * len(bars)))
    return rows, note


def _draw_timeline(fig, ax, rows, note, title: Optional[str], compact: bool = False):
    if not rows:
        return _empty(fig, ax, "no ops, calls or kernels to draw")
    n = len(rows)
    for i, (label, bars, colors) in enumerate(rows):
        y = n - 1 - i
        # bars narrower than a pixel still show: matplotlib draws a hairline for zero width
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colors, edgecolors="none", label=label)
    ax.set_yticks(range(n))
    ax.set_yticklabels([r[0] for r in reversed(rows)], fontsize=7 if compact else 8)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlabel("ms since trace start", fontsize=7 if compact else 9)
    ax.tick_params(axis="x", labelsize=7 if compact else 8)
    ax.set_xlim(left=0)
    t = title or "timeline"
    if note:
        t += f" ({note})"
    ax.set_title(t, fontsize=8 if compact else 10)
    return fig


def timeline_png(trace, width_px: int = 640, height_px: Optional[int] = None, dpi: int = 100) -> bytes:
    """A compact timeline as PNG bytes (for the inline summary image; nothing touches the disk)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    rows, note = _timeline_rows(trace, max_bars=5000)
    if height_px is None:
        height_px = int(70 + 22 * max(len(rows), 1))
    fig = _figure(width_px / dpi, height_px / dpi, dpi)
    ax = fig.add_subplot()
    _draw_timeline(fig, ax, rows, note, "timeline", compact=True)
    canvas = FigureCanvasAgg(fig)
    buf = io.BytesIO()
    canvas.print_png(buf)
    return buf.getvalue()


class PlotAccessor:
    """``t.plot``: each method returns a ``matplotlib.figure.Figure``."""

    def __init__(self, trace):
        self._t = trace

    def __call__(self, **kw):
        return self.timeline(**kw)

    def timeline(self, *, max_bars: int = 20000, width: float = 10.0):
        rows, note = _timeline_rows(self._t, max_bars)
        fig = _figure(width, 1.2 + 0.35 * max(len(rows), 1))
        ax = fig.add_subplot()
        return _draw_timeline(fig, ax, rows, note, "CPU ops" + (" and GPU kernels" if any(r[0].startswith("cuda:") for r in rows) else ""))

    def top_ops(self, by: str = "cpu_ns", n: int = 15):
        if by not in TOP_BY:
            raise ValueError(f"by must be one of {', '.join(TOP_BY)}, not {by!r}")
        import pyarrow.compute as pc

        fig = _figure(8.0, 1.0 + 0.28 * max(min(n, 15), 3))
        ax = fig.add_subplot()
        ops = _table(self._t, "ops")
        if ops is None or ops.num_rows == 0:
            return _empty(fig, ax, "no ops in this trace")
        if "is_noise" in ops.column_names:
            ops = ops.filter(pc.invert(pc.fill_null(ops.column("is_noise"), False)))
        if by == "bytes":
            val = pc.add(pc.fill_null(ops.column("bytes_read"), 0), pc.fill_null(ops.column("bytes_written"), 0))
        elif by == "flops":
            fl = ops.column("flops")
            val = pc.if_else(pc.less(pc.fill_null(fl, -1), 0), None, fl)  # -1: no formula
        else:
            val = ops.column(by)
        import pyarrow as pa

        t = pa.table({"op": ops.column("op"), "v": pc.cast(val, pa.int64())})
        g = t.group_by("op").aggregate([("v", "sum"), ("v", "count")])
        g = g.filter(pc.greater(pc.fill_null(g.column("v_sum"), 0), 0))
        if g.num_rows == 0:
            what = {"cuda_ns": "no CUDA timings (no op ran on a CUDA device)", "flops": "no op has a FLOP formula"}
            return _empty(fig, ax, what.get(by, f"no {by} recorded"))
        g = g.sort_by([("v_sum", "descending")]).slice(0, n)
        names = g.column("op").to_pylist()[::-1]
        vals = [float(v) for v in g.column("v_sum").to_pylist()[::-1]]
        scale, unit = (1e6, f"{by[:-3]} ms") if by.endswith("_ns") else ((2**20, "MiB") if by == "bytes" else (1.0, by))
        bars = ax.barh(range(len(names)), [v / scale for v in vals], color=_COLORS["forward"])
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        for rect, v in zip(bars, vals):
            ax.text(rect.get_width(), rect.get_y() + rect.get_height() / 2, " " + _fmt_value(v, by),
                    va="center", fontsize=7)
        ax.set_xlabel(unit)
        ax.set_title(f"top ops by {by}", fontsize=10)
        ax.margins(x=0.15)
        return fig

    def memory(self, device: Optional[str] = None):
        """Live bytes over the op sequence: stacked by category (``tensors.category``) for the device
        with the highest peak (or ``device``), the peak marked; one line per device for a trace
        without categories (older files)."""
        fig = _figure(8.0, 3.0)
        ax = fig.add_subplot()
        mem = _table(self._t, "memory")
        if mem is None or mem.num_rows == 0:
            return _empty(fig, ax, "no memory view in this trace (storage tracking off, or nothing allocated)")
        cats = self._t.tensors.column("category")
        if cats.null_count < len(cats):
            return _memory_stacked(fig, ax, self._t.memory_timeline, device)
        m = mem.select(["seq", "device", "live_bytes"]).to_pydict()
        by_dev: dict[str, tuple[list[int], list[int]]] = {}
        for s, d, v in zip(m["seq"], m["device"], m["live_bytes"]):
            if s is None or v is None:
                continue
            xs, ys = by_dev.setdefault(d or "?", ([], []))
            xs.append(s)
            ys.append(v)
        for dev in sorted(by_dev):
            xs, ys = by_dev[dev]
            order = sorted(range(len(xs)), key=xs.__getitem__)
            ax.step([xs[i] for i in order], [ys[i] / 2**20 for i in order], where="post", label=dev)
        ax.set_xlabel("op seq")
        ax.set_ylabel("live MiB")
        ax.set_title("live bytes over ops", fontsize=10)
        ax.legend(fontsize=8)
        return fig

    def modules(self, by: str = "cpu_ns", n: int = 15):
        if by not in ("cpu_ns", "cuda_ns"):
            raise ValueError(f"by must be 'cpu_ns' or 'cuda_ns', not {by!r}")
        import pyarrow as pa
        import pyarrow.compute as pc

        fig = _figure(8.0, 1.0 + 0.28 * max(min(n, 15), 3))
        ax = fig.add_subplot()
        ops = _table(self._t, "ops")
        if ops is None or ops.num_rows == 0:
            return _empty(fig, ax, "no ops in this trace")
        t = pa.table({"module": pc.fill_null(ops.column("module"), "(no module)"),
                      "v": pc.cast(ops.column(by), pa.int64())})
        g = t.group_by("module").aggregate([("v", "sum")])
        g = g.filter(pc.greater(pc.fill_null(g.column("v_sum"), 0), 0))
        if g.num_rows == 0:
            return _empty(fig, ax, f"no {by} recorded")
        g = g.sort_by([("v_sum", "descending")]).slice(0, n)
        names = [s if s else "(root)" for s in g.column("module").to_pylist()[::-1]]
        vals = [float(v) for v in g.column("v_sum").to_pylist()[::-1]]
        ax.barh(range(len(names)), [v / 1e6 for v in vals], color=_COLORS["call"])
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        ax.set_xlabel(f"{by[:-3]} ms (ops in their innermost module)")
        ax.set_title("time per module", fontsize=10)
        return fig


def _memory_stacked(fig, ax, tl, device):
    from ..schema import MEMORY_CATEGORIES
    from .svg import COLORS

    cols = tl.to_pydict()
    if device is None:
        peaks = {d: v for d, v, p in zip(cols["device"], cols["live_bytes"], cols["is_peak"]) if p}
        device = max(peaks, key=peaks.__getitem__) if peaks else cols["device"][0]
    idx = [i for i, d in enumerate(cols["device"]) if d == device]
    if not idx:
        return _empty(fig, ax, f"no memory on device {device!r} in this trace")
    xs = [cols["seq"][i] for i in idx]
    ys, labels, colors = [], [], []
    for c in MEMORY_CATEGORIES:
        v = [(cols[f"{c}_bytes"][i] or 0) / 2**20 for i in idx]
        if any(v):
            ys.append(v)
            labels.append(COLORS[f"mem_{c}"][1])
            colors.append(COLORS[f"mem_{c}"][0])
    ax.stackplot(xs, ys, labels=labels, colors=colors, step="post")
    peak = next((i for i in idx if cols["is_peak"][i]), None)
    if peak is not None:
        ax.axvline(cols["seq"][peak], color="#c00", linestyle="--", linewidth=1)
        where = f" {cols['module'][peak]}" if cols["module"][peak] else ""
        ax.annotate(f"peak {cols['live_bytes'][peak] / 2**20:.2f} MiB: {cols['op'][peak]}{where}",
                    (cols["seq"][peak], cols["live_bytes"][peak] / 2**20), fontsize=7, color="#c00",
                    xytext=(4, -10), textcoords="offset points")
    ax.set_xlabel("op seq")
    ax.set_ylabel("live MiB")
    ax.set_title(f"live bytes by category over ops ({device})", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    return fig
