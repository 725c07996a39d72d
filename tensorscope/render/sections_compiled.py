"""Summary section "compiled": what torch.compile built in the cell and what ran it.

One row per compiled region (a Dynamo compile id: ``0/1`` is frame 0's second
compile, i.e. a recompile): the frame and its line, how many ATen ops the
AOTAutograd forward/backward graphs hold and how many kernels Inductor launches
for them ("6 ATen ops fused into 4 kernels"), compile time, and what ran of it
while tracing (ATen ops visible at run time, their CPU time). Recompiles are
listed with the guard that failed. Reads ``graphs``/``graph_nodes``/``ops``.
"""
from __future__ import annotations

from typing import Optional

import pyarrow.compute as pc

from .._common import fmt_ns
from .section import Section


def _first_line(s: Optional[str], n: int = 160) -> str:
    if not s:
        return ""
    line = s.strip().splitlines()[0]
    return line if len(line) <= n else line[: n - 1] + "…"


def compiled_section(t) -> Optional[Section]:
    graphs = t.graphs
    if graphs.num_rows == 0:
        return None
    g = graphs.to_pylist()
    ops = t.ops
    ran: dict[int, list] = {}
    if ops.num_rows and "graph_id" in ops.column_names:
        linked = ops.filter(pc.and_(pc.invert(pc.is_null(ops.column("graph_id"))),
                                    pc.invert(pc.fill_null(ops.column("is_noise"), False))))
        if linked.num_rows:
            agg = linked.group_by("graph_id").aggregate([("cpu_ns", "sum"), ("cpu_ns", "count")])
            for r in agg.to_pylist():
                ran[r["graph_id"]] = [r["cpu_ns_count"], r["cpu_ns_sum"]]
    regions: dict[str, dict] = {}
    for r in g:
        reg = regions.setdefault(r["compile_id"], dict(rows=[], compile_ns=0, in_trace=True))
        reg["rows"].append(r)
        reg["in_trace"] = reg["in_trace"] and bool(r["compiled_in_trace"])
        if r["compile_ns"] and r["kind"] in ("dynamo", "inductor") and not (r["kind"] == "inductor" and r["phase"] != "backward"):
            reg["compile_ns"] += r["compile_ns"]   # dynamo's covers the forward backend; backward compiles later
    rows = []
    recompiles = []
    for cid, reg in regions.items():
        by = {(r["kind"], r["phase"]): r for r in reg["rows"]}
        dyn = by.get(("dynamo", None))
        frame = next((r for r in reg["rows"] if r["frame"]), None)
        where = ""
        if frame is not None:
            from .._location import format_location, trace_cells

            where = f"{frame['frame']} ({format_location(frame['source_file'], frame['source_line'], trace_cells(t))})"
        parts = []
        n_run, ns_run = 0, 0
        for phase in ("forward", "inference", "backward"):
            aot = by.get(("aot_backward" if phase == "backward" else "aot_forward", phase))
            ind = by.get(("inductor", phase))
            if aot is None and ind is None:
                continue
            txt = f"{phase}: "
            if aot is not None:
                txt += f"{aot['n_ops']} ATen ops"
            if ind is not None and ind["n_kernels"] is not None:
                fused = sum(1 for k in ind["kernels"] or [] if not k.startswith(("extern_kernels.", "aten.")))
                nk = ind["n_kernels"]
                txt += (" fused into " if aot is not None else "") + \
                    f"{nk} kernel{'s' if nk != 1 else ''} ({fused} generated)"
                if ind["graph_id"] in ran:
                    n_run += ran[ind["graph_id"]][0]
                    ns_run += ran[ind["graph_id"]][1] or 0
            parts.append(txt)
        compile_txt = fmt_ns(reg["compile_ns"]) if reg["compile_ns"] else "-"
        if not reg["in_trace"]:
            compile_txt += " (in an earlier trace)"
        has_code = any(r["kind"] == "inductor" for r in reg["rows"])
        ran_txt = (f"{n_run} ATen op{'s' if n_run != 1 else ''} visible, {fmt_ns(ns_run)}" if n_run else
                   "no ATen op visible at run time (fully fused, or not run)" if has_code else
                   "not linked (only Inductor's generated code is linked to what ran)")
        rows.append((f"compiled region {cid}", where, "; ".join(parts), compile_txt, ran_txt,
                     str(len(dyn["guards"] or [])) if dyn is not None else "-"))
        if dyn is not None and dyn["recompile_reason"]:
            recompiles.append(f"recompile {cid} of {frame['frame'] if frame else '?'}: "
                              f"{_first_line(dyn['recompile_reason'])}")
    notes = list(recompiles)
    reasons = [r or "" for r in graphs.column("recompile_reason").to_pylist()]
    if any("check_torch_function_mode_stack" in r for r in reasons):
        notes.append("a recompile was caused by the trace's torch-function mode (Dynamo guards on the mode stack): "
                     "a region compiled outside a trace recompiles once inside one")
    notes.append("graphs: t.graphs; their ATen nodes with shapes and dtypes: t.graph_nodes; ops that ran in a region "
                 "carry its graph_id (the Inductor graph; its AOT graphs share its compile_id and phase)")
    return Section("compiled regions (torch.compile)", rows,
                   ("region", "frame", "graphs", "compile time", "ran", "guards"), notes)
