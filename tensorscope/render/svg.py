"""Inline SVG views for the summary: the timeline and an icicle of module → torch call → ATen op.

Plain SVG markup built as strings (inline in HTML5, so no ``xmlns``: the summary
carries no URL at all): crisp at any zoom, no JavaScript, no
matplotlib (``t.plot.*`` keeps matplotlib for figures). Every text and every
hover ``<title>`` goes through ``_e`` (HTML-escaped: op names, module names,
file names are user-controlled). Each colour used has a legend entry. Sizes are
bounded: on the timeline, marks narrower than 2 px are merged per 2-px column and
colour into one mark whose title counts them (the picture is the same at that
resolution), and past ``max_bars`` only the longest ops are read (the SVG says
so); the icicle drops nodes narrower than a pixel.
"""
from __future__ import annotations

import os
from typing import Optional

import pyarrow.compute as pc

from .._common import esc as _e
from .._common import fmt_ns as _fmt_ns

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


def _where(file, line) -> str:
    if not file:
        return ""
    return f"{os.path.basename(file)}:{line}" if line is not None else os.path.basename(file)


def _shape_txt(shapes) -> str:
    if not shapes:
        return ""
    txt = ", ".join("[" + ", ".join(str(d) for d in s) + "]" for s in shapes[:4])
    return txt + (", …" if len(shapes) > 4 else "")


# -- timeline ----------------------------------------------------------------------------------------------

def _merge(bars, scale: float, min_px: float = 2.0):
    """Marks under ``min_px`` wide merged per ``min_px`` column and colour; wider marks kept as they are."""
    out: list = []
    buckets: dict = {}
    for start, dur, key, title in bars:
        if dur * scale >= min_px:
            out.append((start, dur, key, title))
            continue
        b = buckets.get((key, int(start * scale / min_px)))
        if b is None:
            buckets[(key, int(start * scale / min_px))] = [start, start + dur, key, 1, dur, title, dur]
            continue
        b[0], b[1] = min(b[0], start), max(b[1], start + dur)
        b[3] += 1
        b[4] += dur
        if dur > b[6]:
            b[5], b[6] = title, dur
    for start, end, key, n, total, title, _ in buckets.values():
        if n > 1:
            title = f"{n} marks here, {_fmt_ns(total)} in all; the longest: {title}"
        out.append((start, end - start, key, title))
    return out


def timeline_svg(trace, width: int = 720, max_bars: int = 20000) -> Optional[str]:
    """Calls by nesting depth, ATen ops (forward/backward/compiled) and GPU kernels over time."""
    ops, calls, kernels = trace.ops, trace.calls, trace.kernels
    label_w, row_h, top = 90, 16, 6
    plot_w = width - label_w - 10
    rows: list[tuple[str, list[tuple[int, int, str, str]]]] = []   # label, [(start, dur, colour key, title)]
    end = 0
    note = None
    if calls.num_rows:
        c = calls.select(["start_ns", "dur_ns", "depth", "name", "qualname", "source_file", "source_line"]).to_pylist()
        by_depth: dict[int, list] = {}
        for r in c:
            if r["start_ns"] is None:
                continue
            d = max(r["dur_ns"] or 0, 0)
            end = max(end, r["start_ns"] + d)
            title = f"{r['qualname'] or r['name']} · {_fmt_ns(d)}"
            w = _where(r["source_file"], r["source_line"])
            by_depth.setdefault(r["depth"] or 0, []).append((r["start_ns"], d, "call", title + (f" · {w}" if w else "")))
        for dep in sorted(by_depth)[:4]:
            rows.append((f"calls (depth {dep})", sorted(by_depth[dep], key=lambda b: -b[1])[:max_bars]))
    if ops.num_rows:
        cols = ["start_ns", "cpu_ns", "phase", "op", "module", "in_shapes", "out_shapes", "source_file", "source_line"]
        has_gid = "graph_id" in ops.column_names
        o = ops.select(cols + (["graph_id"] if has_gid else []))
        if o.num_rows > max_bars:
            idx = pc.sort_indices(o, sort_keys=[("cpu_ns", "descending")]).slice(0, max_bars)
            o = o.take(idx)
            note = f"the longest {max_bars} of {ops.num_rows} ops are drawn"   # reading more costs seconds
        bars = []
        for r in o.to_pylist():
            if r["start_ns"] is None:
                continue
            d = max(r["cpu_ns"] or 0, 0)
            end = max(end, r["start_ns"] + d)
            key = "compiled" if has_gid and r.get("graph_id") is not None else (
                "backward" if r["phase"] == "backward" else "forward")
            title = (f"{r['op']} · {r['phase']} · {_fmt_ns(d)}"
                     + (f" · module {r['module']}" if r["module"] else "")
                     + (f" · in {_shape_txt(r['in_shapes'])}" if r["in_shapes"] else "")
                     + (f" → out {_shape_txt(r['out_shapes'])}" if r["out_shapes"] else ""))
            w = _where(r["source_file"], r["source_line"])
            bars.append((r["start_ns"], d, key, title + (f" · {w}" if w else "")))
        rows.append(("ATen ops", bars))
    if kernels.num_rows:
        k = kernels.select(["device", "stream", "start_ns", "dur_ns", "name"]).to_pylist()
        tracks: dict[tuple[int, int], list] = {}
        for r in k:
            if r["start_ns"] is None:
                continue
            d = max(r["dur_ns"] or 0, 0)
            end = max(end, r["start_ns"] + d)
            tracks.setdefault((r["device"] or 0, r["stream"] or 0), []).append(
                (r["start_ns"], d, "kernel", f"{r['name']} · {_fmt_ns(d)}"))
        for (dev, st) in sorted(tracks):
            rows.append((f"cuda:{dev} stream {st}", sorted(tracks[(dev, st)], key=lambda b: -b[1])[:max_bars]))
    if not rows or end <= 0:
        return None
    scale = plot_w / end
    used = set()
    parts = []
    for i, (label, bars) in enumerate(rows):
        y = top + i * (row_h + 4)
        parts.append(f'<text x="{label_w - 6}" y="{y + row_h - 4}" text-anchor="end" {_FONT} fill="#333">'
                     f'{_e(label)}</text>')
        parts.append(f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{row_h}" fill="#f6f6f6"/>')
        for start, dur, key, title in _merge(bars, scale):
            used.add(key)
            x = label_w + start * scale
            w = max(dur * scale, 0.6)   # narrower than a pixel: still visible
            parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h}" fill="{COLORS[key][0]}">'
                         f'<title>{_e(title)}</title></rect>')
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
    order = [k for k in ("call", "forward", "backward", "compiled", "kernel") if k in used]
    legend, lh = _legend(order, label_w, ly, plot_w)
    parts.append(legend)
    height = ly + lh + (14 if note else 2)
    if note:
        parts.append(f'<text x="{label_w}" y="{height - 4}" {_FONT} fill="#a15c00">{_e(note)}</text>')
    return (f'<svg role="img" aria-label="timeline" width="{width}" '
            f'height="{height:.0f}" viewBox="0 0 {width} {height:.0f}">' + "".join(parts) + "</svg>")


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
    """module path (each level of the qualified name) → torch call → ATen op; weights are op CPU time."""
    ops = trace.ops
    if ops.num_rows == 0:
        return None
    work = ops.filter(pc.invert(pc.fill_null(ops.column("is_noise"), False)))
    if work.num_rows == 0:
        return None
    names = {}
    calls = trace.calls
    if calls.num_rows:
        names = dict(zip(calls.column("call_id").to_pylist(), calls.column("name").to_pylist()))
    has_gid = "graph_id" in work.column_names
    cols = ["module", "call_id", "op", "phase", "cpu_ns", "in_shapes", "source_file", "source_line"]
    mods = [m for m in work.column("module").unique().to_pylist() if m]
    tops = [m for m in mods if m.startswith("<") and "." not in m]
    top = tops[0] if len(tops) == 1 else None   # the outermost module called ("<Net>") holds the others
    root = _Node("cell", "root")
    for r in work.select(cols + (["graph_id"] if has_gid else [])).to_pylist():
        ns = max(r["cpu_ns"] or 0, 0)
        node = root
        node.ns += ns
        node.count += 1
        mod = r["module"]
        if mod:
            if top is not None and mod != top:
                node = node.child(top, "module")
                node.ns += ns
                node.count += 1
            parts = mod.split(".")
            for i in range(len(parts)):
                node = node.child(".".join(parts[: i + 1]), "module")
                node.ns += ns
                node.count += 1
        call = names.get(r["call_id"]) if r["call_id"] is not None else None
        node = node.child(call or "(no call)", "call" if call else "noop")
        node.ns += ns
        node.count += 1
        key = "compiled" if has_gid and r.get("graph_id") is not None else (
            "backward" if r["phase"] == "backward" else "forward")
        node = node.child(r["op"], key)
        node.ns += ns
        node.count += 1
        if node.info is None:
            node.info = (r["in_shapes"], _where(r["source_file"], r["source_line"]))
    return root


def icicle_svg(trace, width: int = 720, max_depth: int = 9) -> Optional[str]:
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
        if w < 1.0:
            return
        depth_seen = max(depth_seen, depth)
        y = top + depth * (row_h + 1)
        key = n.kind if n.kind != "root" else "cell"
        used.add(key)
        label = n.name   # modules keep their qualified name: features.0, not 0
        if n.kind == "root":
            label = f"cell: {_fmt_ns(n.ns)} in {n.count} ATen ops"
        parts.append(f'<g><title>{_e(title(n) if n.kind != "root" else label)}</title>'
                     f'<rect x="{x:.2f}" y="{y}" width="{max(w - 0.5, 0.5):.2f}" height="{row_h}" '
                     f'fill="{COLORS[key][0]}"/>')
        max_chars = int((w - 6) / 6)
        if max_chars >= 3:
            txt = label if len(label) <= max_chars else label[: max_chars - 1] + "…"
            parts.append(f'<text x="{x + 3:.2f}" y="{y + 13}" {_FONT} fill="#111">{_e(txt)}</text>')
        parts.append("</g>")
        cx = x
        for c in sorted(n.children.values(), key=lambda c: -c.ns):
            draw(c, cx, depth + 1)
            cx += c.ns * scale

    draw(root, 1.0, 0)
    ly = top + (depth_seen + 1) * (row_h + 1) + 6
    order = [k for k in ("cell", "module", "call", "forward", "backward", "compiled", "noop") if k in used]
    legend, lh = _legend(order, 1, ly, width - 2)
    parts.append(legend)
    height = ly + lh + 2
    return (f'<svg role="img" aria-label="icicle: module, call, op" '
            f'width="{width}" height="{height:.0f}" viewBox="0 0 {width} {height:.0f}">' + "".join(parts) + "</svg>")
