"""The summary's timing sections: CUDA time, kernels, the inline SVG timeline, and the icicle.

Role: one ``Section`` (see render/summary.py) with the GPU side of the trace
— CUDA time in ops, kernel count / how many are linked to an op / how many
failed their timestamp check — a note on CPU-only machines that the kernels
table is empty and why, and the timeline as inline SVG (``render.svg``: no
matplotlib on the display path, no JavaScript). A second, image-only section
draws the icicle of module → torch call → ATen op (width = CPU time).
"""
from __future__ import annotations

from typing import Optional

import pyarrow.compute as pc

from .._common import fmt_ns
from .section import Section


def timing_section(t, full: bool = False) -> Optional[Section]:
    ops = t.ops
    kernels = t.kernels
    md = t.metadata or {}
    if ops.num_rows == 0 and kernels.num_rows == 0:
        return None
    rows = []
    notes = []
    cuda = ops.column("cuda_ns")
    n_cuda = ops.num_rows - cuda.null_count
    if n_cuda:
        rows.append(("CUDA time in ops", f"{fmt_ns(pc.sum(cuda).as_py())} over {n_cuda} op(s) (event pairs)"))
    if kernels.num_rows:
        linked = kernels.num_rows - kernels.column("seq").null_count
        placed = kernels.num_rows - kernels.column("start_ns").null_count
        gpu = pc.sum(kernels.column("dur_ns")).as_py()
        rows.append(("GPU kernels", f"{kernels.num_rows} ({linked} linked to their op, {fmt_ns(gpu)} on the GPU)"))
        if placed < kernels.num_rows:
            notes.append(f"{kernels.num_rows - placed} kernel(s) failed the timestamp check and are not drawn; "
                         "see the notes above")
    elif (md.get("options") or {}).get("kernels"):
        env = md.get("device") or {}
        already = any("CPU-only" in str(n) for n in md.get("notes") or [])
        if not env.get("cuda_available", False) and not already:
            notes.append("CPU-only: no CUDA device, so the kernels table is empty")
    svg = None
    if ops.num_rows or kernels.num_rows:
        from .svg import timeline_svg

        # SVG, drawn only when HTML is rendered (no matplotlib on the display path); hovers in the report
        svg = lambda: timeline_svg(t, hovers=200 if full else 0)  # noqa: E731
    if not rows and svg is None and not notes:
        return None
    alt = None
    if ops.num_rows:
        end = (md.get("wall_ns") or 0)
        alt = f"timeline chart: {ops.num_rows} ops" + (f" over {fmt_ns(end)}" if end else "") + \
            "; the longest: t.op_totals(), every op: t.ops"
    return Section("timeline", rows, None, notes, svg=svg, text_alt=alt)


def icicle_section(t, full: bool = False) -> Optional[Section]:
    """Where the time went: module → torch call → ATen op, width = CPU time (HTML only; the text
    summary has the module and op tables). In the report (``full``) only: the notebook summary's module
    and op tables say the same in numbers, within its budget (docs/guide/summary.md)."""
    if t.ops.num_rows == 0 or not full:
        return None
    from .svg import icicle_svg

    title = "where the time went (module → torch call → ATen op; hover for details)"
    return Section(title, [], None, [], svg=lambda: icicle_svg(t, hovers=True, min_px=1.0),
                   text_alt="icicle chart: module → torch call → ATen op, width = CPU time; in numbers: the "
                            "module and op tables above")
