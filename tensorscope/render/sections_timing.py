"""The summary's timing section: CUDA time, kernels, and the small inline timeline image.

Role: one ``Section`` (see render/summary.py) with the GPU side of the trace
— CUDA time in ops, kernel count / how many are linked to an op / how many
failed their timestamp check — a note on CPU-only machines that the kernels
table is empty and why, and a compact timeline PNG (rendered in memory by
``render.plots.timeline_png``, embedded as a data URI by the HTML renderer;
no file is written). Without matplotlib the section keeps its rows and says
the image is unavailable.
"""
from __future__ import annotations

from typing import Optional

import pyarrow.compute as pc

from .summary import Section, fmt_ns, register_section


@register_section
def timing_section(t) -> Optional[Section]:
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
    png = None
    if ops.num_rows:
        try:
            import matplotlib  # noqa: F401  (only to know whether the image can be drawn)

            from .plots import timeline_png

            # drawn only when HTML is rendered (the text summary and the CLI never pay for it)
            png = lambda: timeline_png(t, width_px=640)  # noqa: E731
        except ImportError:
            notes.append("timeline image unavailable (matplotlib is not installed)")
    if not rows and png is None and not notes:
        return None
    return Section("timeline", rows, None, notes, image_png=png)
