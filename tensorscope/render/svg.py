"""SVG views for the summary and the report: the timeline and an icicle of module → torch call → ATen op.

Plain SVG markup built as strings, no JavaScript, no matplotlib (``t.plot.*`` keeps matplotlib for
figures). Every text and every hover ``<title>`` goes through ``_e`` (HTML-escaped: op names, module
names, file names are user-controlled). Each colour used has a legend entry. Sizes are bounded by
the picture, not by the trace: each series (calls at one depth, forward ops, backward ops, a CUDA
stream) is one ``<path>`` of the pixel columns it covers (vectorised over the rows), so a 20,000-op
cell draws as many bytes as a 200-op one; ``hovers`` of the longest marks are drawn again on top,
each with its hover title (the standalone report; an ``<img>`` has no hovers, so the summary
asks for none). The icicle is computed by one group-by over the ops and drops nodes narrower than
a pixel. Locations read as everywhere else: ``Cell In[N], line M`` or ``file.py:L`` (_location.py).

``svg_img(svg)`` makes the ``<img>`` of an SVG data URI the summary shows: JupyterLab's sanitizer
keeps it in an untrusted output, where an inline ``<svg>`` is stripped down to its titles' text.
"""
from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .._common import esc as _e
from .._common import fmt_ns as _fmt_ns
from ..analyses.totals import root_label

_SVG_NS = "http://www.w3.org/2000/svg"   # a namespace name, never fetched: an SVG file needs it


def svg_img(svg: str, alt: str, encoding: str = "url") -> str:
    """``<img src="data:image/svg+xml,…">`` of an SVG (the namespace added where missing).

    ``encoding``: "url" (the markup percent-encoded where it must be: ``%``, ``&``, ``#``, ``<``, ``>``, and
    its double quotes made single; ~10% larger than the SVG) or "base64" (33% larger)."""
    if "xmlns=" not in svg[:200]:
        svg = svg.replace("<svg ", f'<svg xmlns="{_SVG_NS}" ', 1)
    w = _attr(svg, "width")
    size = f' width="{w}"' if w else ""
    if encoding == "base64":
        src = "data:image/svg+xml;base64," + base64.b64encode(svg.encode("utf-8")).decode("ascii")
    else:
        # text is escaped with quote=True (no raw ' or " in it), so every " is an attribute quote
        src = "data:image/svg+xml," + (svg.replace("%", "%25").replace("&", "%26").replace("#", "%23").replace("<", "%3C")
                                       .replace(">", "%3E").replace('"', "'")
                                       # the namespace name is no address to fetch: encoded, the page holds none
                                       .replace(_SVG_NS, "http%3A%2F%2Fwww.w3.org%2F2000%2Fsvg"))
    return f'<img class="ts-img" alt="{_e(alt)}"{size} src="{src}"/>'


def _attr(svg: str, name: str) -> Optional[str]:
    head = svg[: svg.find(">")]
    i = head.find(f' {name}="')
    if i < 0:
        return None
    j = head.find('"', i + len(name) + 3)
    return head[i + len(name) + 3: j]


#: one place for the colours of the views, with the legend text of each
COLORS: dict[str, tuple[str, str]] = {
    "call": ("#8c8c8c", "torch-level call"),
    "forward": ("#3b75af", "ATen op, forward"),
    "backward": ("#ef8636", "ATen op, backward"),
    "compiled": ("#8e5bb5", "ATen op in a compiled region"),
    "kernel": ("#519e3e", "GPU kernel"),
    "module": ("#9fbfdf", "nn.Module (rolled up: children included)"),
    "cell": ("#e4e4e4", "the whole cell"),
    "noop": ("#d9d9d9", "ops outside any torch-level call"),
    # the memory timeline (render/svg_memory.py), one per tensors.category
    "mem_parameter": ("#4c72b0", "parameters"),
    "mem_buffer": ("#64b5cd", "buffers"),
    "mem_gradient": ("#dd8452", "gradients"),
    "mem_optimizer_state": ("#8172b3", "optimizer state"),
    "mem_input": ("#937860", "inputs"),
    "mem_activation": ("#55a868", "activations (saved for backward)"),
    "mem_temporary": ("#ccb974", "temporaries"),
    "mem_other": ("#a0a0a0", "other"),
}
_FONT = 'font-family="system-ui,sans-serif" font-size="10"'


def _legend(keys: list[str], x: float, y: float, width: float) -> tuple[str, float]:
    """Swatches + labels, wrapped to ``width``; returns (markup, height)."""
    parts, cx, cy = [], x, y
    for k in keys:
        color, label = COLORS[k]
        w = 16 + 6 * len(label)
        if cx + w > x + width and cx > x:
            cx, cy = x, cy + 14
        parts.append(f'<rect x="{cx:.1f}" y="{cy:.1f}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{cx + 13:.1f}" y="{cy + 9:.1f}" {_FONT} fill="#333">{_e(label)}</text>')
        cx += w + 10
    return "".join(parts), cy - y + 14


def _where(file, line, cells: Optional[Mapping[str, int]] = None) -> str:
    """``Cell In[N], line M`` / ``file.py:L`` (the one location format; ``cells``: a trace's cell map)."""
    if not file:
        return ""
    from .._location import format_location

    return format_location(file, line, cells)


def _cells(trace) -> Optional[Mapping[str, int]]:
    from .._location import trace_cells

    return trace_cells(trace)


def _shape_txt(shapes) -> str:
    if not shapes:
        return ""
    txt = ", ".join("[" + ", ".join(str(d) for d in s) + "]" for s in shapes[:4])
    return txt + (", …" if len(shapes) > 4 else "")


# -- timeline ----------------------------------------------------------------------------------------------

#: rows of a table drawn at a time: the timeline reads the ops a record batch at a time (a long
#: trace's columns are memory-mapped: an int64 copy of a column costs 8 bytes per op)
TIMELINE_ROWS = 1 << 16


class _Series:
    """One series of marks [start, start + dur), drawn as the runs of pixel columns they cover: the
    coverage is a difference array over the columns, summed a batch of marks at a time."""

    __slots__ = ("key", "n", "tot", "diff")

    def __init__(self, key: str, n_cols: int) -> None:
        self.key, self.n, self.tot = key, 0, 0
        self.diff = np.zeros(n_cols + 1, np.int64)

    def add(self, s0: np.ndarray, d0: np.ndarray, scale: float) -> None:
        if not len(s0):
            return
        n_cols = len(self.diff) - 1
        self.n += len(s0)
        self.tot += int(d0.sum())
        x0 = s0 * scale
        x1 = x0 + d0 * scale
        c0 = np.clip(np.floor(x0).astype(np.int64), 0, n_cols - 1)
        c1 = np.clip(np.maximum(np.ceil(x1).astype(np.int64), c0 + 1), 1, n_cols)
        self.diff += np.bincount(c0, minlength=n_cols + 1) - np.bincount(c1, minlength=n_cols + 1)

    def runs(self) -> list[tuple[int, int]]:
        """The runs of pixel columns (start, end) the marks cover."""
        if not self.n:
            return []
        cov = np.cumsum(self.diff[:-1]) > 0
        edges = np.flatnonzero(np.diff(np.concatenate(([0], cov.astype(np.int8), [0]))))
        return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def _series_path(runs: list[tuple[int, int]], x: float, y: float, h: float, color: str, title: str) -> str:
    d = "".join(f"M{x + a:g} {y:g}h{b - a}v{h:g}h{a - b}z" for a, b in runs)
    return f'<path d="{d}" fill="{color}"><title>{_e(title)}</title></path>' if d else ""


def _np(col: Any, fill: int = 0) -> np.ndarray:
    return pc.fill_null(col, fill).to_numpy(zero_copy_only=False).astype(np.int64)


def _marks(table: pa.Table, start: str, dur: str, extra: tuple[str, ...] = ()) -> Any:
    """Per record batch of ``table`` (``TIMELINE_ROWS`` rows at most): the rows with a start, as
    (start, max(dur, 0), the ``extra`` columns' values of those rows as numpy)."""
    cols = [start, dur] + [c for c in extra if c in table.column_names]
    for b in table.select(cols).to_batches(max_chunksize=TIMELINE_ROWS):
        ok = pc.invert(pc.is_null(b.column(0))).to_numpy(zero_copy_only=False)
        yield (_np(b.column(0))[ok], np.maximum(_np(b.column(1))[ok], 0),
               {c: b.column(2 + i) for i, c in enumerate(cols[2:])}, ok)


def timeline_svg(trace, width: int = 720, hovers: int = 0) -> Optional[str]:
    """Calls by nesting depth, ATen ops (forward/backward/compiled) and GPU kernels over time: one
    path per series; ``hovers``: the longest ops drawn again each with its hover title. Two passes
    over each table a record batch at a time: the end of the last mark, then each series' coverage."""
    ops, calls, kernels = trace.ops, trace.calls, trace.kernels
    label_w, row_h, top = 90, 16, 6
    plot_w = width - label_w - 10
    cells = _cells(trace)
    end = 0
    for table, st, du, n in ((calls, "start_ns", "dur_ns", calls.num_rows), (ops, "start_ns", "cpu_ns", ops.num_rows),
                             (kernels, "start_ns", "dur_ns", kernels.num_rows)):
        if n:
            for s0, d0, _x, _ok in _marks(table, st, du):
                if len(s0):
                    end = max(end, int((s0 + d0).max()))
    scale = plot_w / end if end > 0 else 0.0
    # rows: label, [series]
    rows: list[tuple[str, list[_Series]]] = []
    if calls.num_rows:
        depths: dict[int, _Series] = {}
        for s0, d0, x, ok in _marks(calls, "start_ns", "dur_ns", ("depth",)):
            dep = _np(x["depth"])[ok]
            for d in np.unique(dep).tolist():
                m = dep == d
                depths.setdefault(d, _Series("call", plot_w)).add(s0[m], d0[m], scale)
        for d in sorted(depths)[:4]:
            rows.append((f"calls (depth {d})", [depths[d]]))
    if ops.num_rows:
        by_key = {k: _Series(k, plot_w) for k in ("forward", "backward", "compiled")}
        for s0, d0, x, ok in _marks(ops, "start_ns", "cpu_ns", ("phase", "graph_id")):
            bwd = pc.fill_null(pc.equal(x["phase"], "backward"), False).to_numpy(zero_copy_only=False)[ok]
            comp = (pc.invert(pc.is_null(x["graph_id"])).to_numpy(zero_copy_only=False)[ok]
                    if "graph_id" in x else np.zeros(len(s0), dtype=bool))
            for key, m in (("forward", ~bwd & ~comp), ("backward", bwd & ~comp), ("compiled", comp)):
                if m.any():
                    by_key[key].add(s0[m], d0[m], scale)
        rows.append(("ATen ops", [v for v in by_key.values() if v.n]))
    if kernels.num_rows:
        streams: dict[tuple[int, int], _Series] = {}
        for s0, d0, x, ok in _marks(kernels, "start_ns", "dur_ns", ("device", "stream")):
            dev, stream = _np(x["device"])[ok], _np(x["stream"])[ok]
            for dv, sm in sorted(set(zip(dev.tolist(), stream.tolist()))):
                m = (dev == dv) & (stream == sm)
                streams.setdefault((dv, sm), _Series("kernel", plot_w)).add(s0[m], d0[m], scale)
        for dv, sm in sorted(streams):
            rows.append((f"cuda:{dv} stream {sm}", [streams[(dv, sm)]]))
    if not rows or end <= 0:
        return None
    used = set()
    parts = []
    op_row_y = None
    for i, (label, series) in enumerate(rows):
        y = top + i * (row_h + 4)
        if label == "ATen ops":
            op_row_y = y
        parts.append(f'<text x="{label_w - 6}" y="{y + row_h - 4}" text-anchor="end" {_FONT} fill="#333">'
                     f'{_e(label)}</text>')
        parts.append(f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{row_h}" fill="#f6f6f6"/>')
        for ser in series:
            runs = ser.runs()
            if runs:
                used.add(ser.key)
                n, tot = ser.n, ser.tot
                parts.append(_series_path(runs, label_w, y, row_h, COLORS[ser.key][0],
                                          f"{COLORS[ser.key][1]}: {n} mark{'s' * (n != 1)}, {_fmt_ns(tot)} in all"))
    if hovers and ops.num_rows and op_row_y is not None:
        parts.extend(_op_hovers(ops, hovers, scale, label_w, op_row_y, row_h, cells))
    axis_y = top + len(rows) * (row_h + 4) + 2
    parts.append(f'<line x1="{label_w}" y1="{axis_y}" x2="{label_w + plot_w}" y2="{axis_y}" stroke="#999"/>')
    for j in range(6):
        t = end * j / 5
        x = label_w + t * scale
        anchor = "start" if j == 0 else "end" if j == 5 else "middle"
        parts.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 3}" stroke="#999"/>'
                     f'<text x="{x:.1f}" y="{axis_y + 13}" text-anchor="{anchor}" {_FONT} fill="#555">'
                     f'{_e(_fmt_ns(t))}</text>')
    ly = axis_y + 20
    order: list[str] = [k for k in ("call", "forward", "backward", "compiled", "kernel") if k in used]
    legend, lh = _legend(order, label_w, ly, plot_w)
    parts.append(legend)
    height = ly + lh + 2
    return (f'<svg class="tensorscope-timeline" role="img" aria-label="timeline" width="{width}" '
            f'height="{height:.0f}" viewBox="0 0 {width} {height:.0f}">' + "".join(parts) + "</svg>")


def _op_hovers(ops: pa.Table, k: int, scale: float, x: float, y: float, h: float,
               cells: Optional[Mapping[str, int]]) -> list[str]:
    """The ``k`` longest ops as marks with their hover title (op, phase, time, module, shapes, line)."""
    idx = pc.array_sort_indices(pc.fill_null(ops.column("cpu_ns"), 0), order="descending")
    cols = ["start_ns", "cpu_ns", "phase", "op", "module", "in_shapes", "out_shapes", "source_file", "source_line"]
    out = []
    for r in ops.select(cols).take(idx.slice(0, k)).to_pylist():
        if r["start_ns"] is None:
            continue
        d = max(r["cpu_ns"] or 0, 0)
        key = "backward" if r["phase"] == "backward" else "forward"
        title = (f"{r['op']} · {r['phase']} · {_fmt_ns(d)}"
                 + (f" · module {r['module']}" if r["module"] else "")
                 + (f" · in {_shape_txt(r['in_shapes'])}" if r["in_shapes"] else "")
                 + (f" → out {_shape_txt(r['out_shapes'])}" if r["out_shapes"] else ""))
        w = _where(r["source_file"], r["source_line"], cells)
        out.append(f'<rect x="{x + r["start_ns"] * scale:.1f}" y="{y}" width="{max(d * scale, 1.0):.1f}" '
                   f'height="{h}" fill="{COLORS[key][0]}"><title>{_e(title + (f" · {w}" if w else ""))}</title></rect>')
    return out


# -- icicle ------------------------------------------------------------------------------------------------

class _Node:
    __slots__ = ("name", "kind", "ns", "count", "children", "info")

    def __init__(self, name, kind):
        self.name, self.kind, self.ns, self.count, self.children, self.info = name, kind, 0, 0, {}, None

    def child(self, name, kind):
        n = self.children.get((kind, name))
        if n is None:
            n = self.children[(kind, name)] = _Node(name, kind)
        return n


def icicle_tree(trace) -> Optional[_Node]:
    """module path (each level of the qualified name) → torch call → ATen op; weights are op CPU time.
    One group-by over the ops (module, call name, op, colour), then a tree of the groups."""
    ops = trace.ops
    if ops.num_rows == 0:
        return None
    # the columns read, then the rows (a filter copies what it keeps: not every column of a big trace)
    need = [c for c in ("call_id", "phase", "graph_id", "module", "op", "cpu_ns", "in_shapes", "source_file",
                        "source_line") if c in ops.column_names]
    work = ops.select(need).filter(pc.invert(pc.fill_null(ops.column("is_noise"), False)))
    if work.num_rows == 0:
        return None
    calls = trace.calls
    if calls.num_rows:
        pos = pc.index_in(work.column("call_id"), value_set=calls.column("call_id"))
        cname = pc.take(calls.column("name"), pos)
    else:
        cname = pa.nulls(work.num_rows, pa.string())
    bwd = pc.fill_null(pc.equal(work.column("phase"), "backward"), False)
    key = pc.if_else(bwd, "backward", "forward")
    if "graph_id" in work.column_names:
        key = pc.if_else(pc.is_null(work.column("graph_id")), key, "compiled")

    def plain(c):
        return c.cast(c.type.value_type) if pa.types.is_dictionary(c.type) else c

    g = pa.table({"module": plain(work.column("module")), "call": plain(cname), "op": plain(work.column("op")),
                  "key": key, "ns": pc.max_element_wise(pc.fill_null(work.column("cpu_ns"), 0), 0),
                  "i": pa.array(np.arange(work.num_rows))}
                 ).group_by(["module", "call", "op", "key"], use_threads=False).aggregate(
        [("ns", "sum"), ([], "count_all"), ("i", "min")])
    first = work.select(["in_shapes", "source_file", "source_line"]).take(g.column("i_min")).to_pylist()
    cells = _cells(trace)
    mods = [m for m in pc.unique(g.column("module")).to_pylist() if m]
    top = root_label(mods, trace.metadata.get("module_roots"))   # the outermost module called ("<Net>") holds the others
    root = _Node("cell", "root")
    order = sorted(range(g.num_rows), key=lambda j: first_seq[j]) if (first_seq := g.column("i_min").to_pylist()) \
        else []
    cols = g.select(["module", "call", "op", "key", "ns_sum", "count_all"]).to_pydict()
    for j in order:
        ns, n = int(cols["ns_sum"][j] or 0), int(cols["count_all"][j])
        node = root
        node.ns += ns
        node.count += n
        mod = cols["module"][j]
        if mod:
            if top is not None and mod != top:
                node = node.child(top, "module")
                node.ns += ns
                node.count += n
            parts = mod.split(".")
            for i in range(len(parts)):
                node = node.child(".".join(parts[: i + 1]), "module")
                node.ns += ns
                node.count += n
        call = cols["call"][j]
        node = node.child(call or "(no call)", "call" if call else "noop")
        node.ns += ns
        node.count += n
        node = node.child(cols["op"][j], cols["key"][j])
        node.ns += ns
        node.count += n
        if node.info is None:
            f = first[j]
            node.info = (f["in_shapes"], _where(f["source_file"], f["source_line"], cells))
    return root


def icicle_svg(trace, width: int = 720, max_depth: int = 9, hovers: bool = True, min_px: float = 1.0) -> Optional[str]:
    """The icicle; ``hovers``: each node with its hover title (off for an ``<img>``, which has none);
    nodes narrower than ``min_px`` are left out."""
    root = icicle_tree(trace)
    if root is None or root.ns <= 0:
        return None
    row_h, top = 18, 4
    total = root.ns
    scale = (width - 2) / total
    parts = []
    used = set()
    depth_seen = 0

    def title(n: _Node) -> str:
        share = f"{100 * n.ns / total:.1f}%"
        if n.kind == "module":
            return f"module {n.name} · {_fmt_ns(n.ns)} ({share}) · {n.count} ops, children included"
        if n.kind in ("call", "noop"):
            return f"{n.name} · {_fmt_ns(n.ns)} ({share}) · {n.count} ops"
        shapes, where = n.info or (None, "")
        return (f"{n.name} · {n.count}× · {_fmt_ns(n.ns)} ({share})"
                + (f" · in {_shape_txt(shapes)}" if shapes else "") + (f" · {where}" if where else ""))

    def draw(n: _Node, x: float, depth: int):
        nonlocal depth_seen
        if depth > max_depth:
            return
        w = n.ns * scale
        if w < min_px:
            return
        depth_seen = max(depth_seen, depth)
        y = top + depth * (row_h + 1)
        key = n.kind if n.kind != "root" else "cell"
        used.add(key)
        label = n.name   # modules keep their qualified name: features.0, not 0
        if n.kind == "root":
            label = f"cell: {_fmt_ns(n.ns)} in {n.count} ATen ops"
        rect = f'<rect x="{x:.1f}" y="{y}" width="{max(w - 0.5, 0.5):.1f}" height="{row_h}" fill="{COLORS[key][0]}"/>'
        parts.append(f'<g><title>{_e(title(n) if n.kind != "root" else label)}</title>{rect}' if hovers else rect)
        max_chars = int((w - 6) / 6)
        if max_chars >= 3:
            txt = label if len(label) <= max_chars else label[: max_chars - 1] + "…"
            parts.append(f'<text x="{x + 3:.1f}" y="{y + 13}" {_FONT} fill="#111">{_e(txt)}</text>')
        if hovers:
            parts.append("</g>")
        cx = x
        for c in sorted(n.children.values(), key=lambda c: (-c.ns, c.kind, c.name)):
            draw(c, cx, depth + 1)
            cx += c.ns * scale

    draw(root, 1.0, 0)
    ly = top + (depth_seen + 1) * (row_h + 1) + 6
    order = [k for k in ("cell", "module", "call", "forward", "backward", "compiled", "noop") if k in used]
    legend, lh = _legend(order, 1, ly, width - 2)
    parts.append(legend)
    height = ly + lh + 2
    return (f'<svg class="tensorscope-icicle" role="img" aria-label="icicle: module, call, op" '
            f'width="{width}" height="{height:.0f}" viewBox="0 0 {width} {height:.0f}">' + "".join(parts) + "</svg>")
