"""The roofline as inline SVG: log-log FLOP/byte against FLOP/s, the roofs, one dot per op group.

Hand-built markup like render/svg.py (no matplotlib, no JavaScript); every label and hover
``<title>`` is escaped. Roofs: ``min(peak[dtype], intensity * bandwidth)`` for each measured
dtype of each device; dots: the ``op`` rows of the ROOFLINE table with FLOPs and bytes
(colour = bound: compute, memory, overhead, below the roof), at most ``max_dots`` (the longest).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import pyarrow as pa

from .._common import esc as _e
from .._common import fmt_ns

BOUND_COLORS = {"compute": ("#3b75af", "compute-bound"), "memory": ("#ef8636", "memory-bound"),
                "overhead": ("#c0392b", "overhead-bound"), "below_roof": ("#8e6bb8", "below the roof"),
                None: ("#8c8c8c", "no roof (no peaks)")}
_FONT = 'font-family="system-ui,sans-serif" font-size="10"'


def roofline_svg(roof: pa.Table, peaks: Optional[dict[str, dict[str, Any]]], width: int = 640, height: int = 320,
                 max_dots: int = 200) -> str:
    rows = [r for r in roof.to_pylist() if r["level"] == "op" and r["flops"] and r["bytes"] and r["flops_per_s"]]
    rows = sorted(rows, key=lambda r: -(r["time_ns"] or 0))[:max_dots]
    ml, mr, mt, mb = 56, 150, 12, 34
    pw, ph = width - ml - mr, height - mt - mb
    xs = [r["intensity"] for r in rows] or [1.0]
    ys = [r["flops_per_s"] for r in rows] or [1e9]
    roofs = []
    for dev, p in sorted((peaks or {}).items()):
        bw = p.get("bytes_per_s")
        for dt, pf in sorted((p.get("flops") or {}).items()):
            if bw and pf:
                roofs.append((dev, dt, float(pf), float(bw)))
                ys.append(float(pf))
                xs.append(float(pf) / float(bw))
    x0 = 10 ** math.floor(math.log10(max(min(xs), 1e-3)) - 0.5)
    x1 = 10 ** math.ceil(math.log10(max(xs)) + 0.5)
    y0 = 10 ** math.floor(math.log10(max(min(ys), 1.0)) - 0.5)
    y1 = 10 ** math.ceil(math.log10(max(ys)) + 0.3)

    def px(x: float) -> float:
        return ml + pw * (math.log10(max(x, x0)) - math.log10(x0)) / (math.log10(x1) - math.log10(x0))

    def py(y: float) -> float:
        return mt + ph * (1 - (math.log10(max(y, y0)) - math.log10(y0)) / (math.log10(y1) - math.log10(y0)))

    parts: list[str] = [f'<svg class="tensorscope-roofline" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">',
                        f'<title>{_e("roofline: achieved FLOP/s against arithmetic intensity")}</title>',
                        f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>']
    e = math.floor(math.log10(x0))
    while 10 ** e <= x1 * 1.0001:
        x = px(10 ** e)
        parts.append(f'<line x1="{x:.1f}" y1="{mt}" x2="{x:.1f}" y2="{mt + ph}" stroke="#eee"/>'
                     f'<text x="{x:.1f}" y="{mt + ph + 12}" text-anchor="middle" {_FONT}>{_e(f"1e{e}")}</text>')
        e += 1
    e = math.floor(math.log10(y0))
    while 10 ** e <= y1 * 1.0001:
        y = py(10 ** e)
        parts.append(f'<line x1="{ml}" y1="{y:.1f}" x2="{ml + pw}" y2="{y:.1f}" stroke="#eee"/>'
                     f'<text x="{ml - 4}" y="{y + 3:.1f}" text-anchor="end" {_FONT}>{_e(f"1e{e}")}</text>')
        e += 1
    parts.append(f'<text x="{ml + pw / 2}" y="{height - 4}" text-anchor="middle" {_FONT}>'
                 f'{_e("arithmetic intensity (FLOP/byte)")}</text>'
                 f'<text x="12" y="{mt + ph / 2}" transform="rotate(-90 12 {mt + ph / 2})" text-anchor="middle" '
                 f'{_FONT}>{_e("FLOP/s")}</text>')
    for dev, dt, pf, bw in roofs:
        ridge = pf / bw
        pts = [(x0, x0 * bw), (ridge, pf), (x1, pf)]
        d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        dash = "" if dt == "float32" else ' stroke-dasharray="4 3"'
        parts.append(f'<polyline points="{d}" fill="none" stroke="#444" stroke-width="1.2"{dash}>'
                     f'<title>{_e(f"{dev} {dt}: peak {pf / 1e9:.1f} GFLOP/s, {bw / 1e9:.1f} GB/s")}</title></polyline>'
                     f'<text x="{ml + pw - 2}" y="{py(pf) - 3:.1f}" text-anchor="end" {_FONT}>{_e(f"{dev} {dt}")}</text>')
    for r in rows:
        color = BOUND_COLORS.get(r["bound"], BOUND_COLORS[None])[0]
        tip = (f"{r['name']} ({r['dtype']}, {r['n_ops']} ops, {fmt_ns(r['time_ns'])}): "
               f"{r['flops_per_s'] / 1e9:.2f} GFLOP/s at {r['intensity']:.2f} FLOP/byte; {r['bound'] or 'no roof'}")
        parts.append(f'<circle cx="{px(r["intensity"]):.1f}" cy="{py(r["flops_per_s"]):.1f}" r="4" fill="{color}" '
                     f'fill-opacity="0.8"><title>{_e(tip)}</title></circle>')
    ly = mt + 4
    for key in ("compute", "memory", "overhead", "below_roof", None):
        c, label = BOUND_COLORS[key]
        parts.append(f'<circle cx="{ml + pw + 14}" cy="{ly + 4}" r="4" fill="{c}"/>'
                     f'<text x="{ml + pw + 22}" y="{ly + 8}" {_FONT}>{_e(label)}</text>')
        ly += 16
    parts.append(f'<text x="{ml + pw + 10}" y="{ly + 8}" {_FONT}>{_e("lines: roofs (dashed: 16-bit)")}</text>')
    parts.append("</svg>")
    return "".join(parts)
