"""The cell summary: the sections a Trace's summary shows, in order, and ``summarize``.

Each section is a function ``trace -> Section | None`` (render/section.py draws them);
``SECTIONS`` lists every one explicitly, in display order: the overview, op and module
tables and errors here, the rest one module per topic (``sections_*``). A broken section
never hides the others.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import pyarrow.compute as pc

from .._common import fmt_bytes, fmt_ns
from . import sections_advice, sections_api, sections_compiled, sections_memory, sections_precision, sections_timing
from .section import Section, Summary


def _location(file, line, cells=None) -> str:
    if file is None:
        return ""
    from .._location import format_location

    return format_location(file, line, cells)


def overview(t) -> Section:
    md = t.metadata
    ops = t.ops
    n = ops.num_rows
    rows = []
    noise = pc.sum(pc.cast(ops.column("is_noise"), "int64")).as_py() or 0 if n else 0
    bwd = pc.sum(pc.cast(pc.equal(ops.column("phase"), "backward"), "int64")).as_py() or 0 if n else 0
    rows.append(("ATen ops", f"{n} ({n - bwd} forward, {bwd} backward; {noise} bookkeeping ops hidden below)"))
    rows.append(("torch-level calls", str(t.calls.num_rows)))
    if n:
        cpu = pc.sum(ops.column("cpu_ns")).as_py() or 0
        rows.append(("CPU time in ops", f"{fmt_ns(cpu)} of {fmt_ns(md.get('wall_ns'))} wall"))
        rows.append(("bytes read / written", f"{fmt_bytes(pc.sum(ops.column('bytes_read')).as_py())} / "
                                             f"{fmt_bytes(pc.sum(ops.column('bytes_written')).as_py())}"))
        fl = pc.sum(ops.column("flops")).as_py()
        if fl:
            rows.append(("FLOPs (ops with a formula)", f"{fl:,}"))
    tensors = t.tensors
    if tensors.num_rows:
        created = pc.invert(pc.is_null(tensors.column("alloc_seq")))
        nb = pc.sum(pc.filter(tensors.column("nbytes"), created)).as_py() or 0
        rows.append(("storages created", f"{pc.sum(pc.cast(created, 'int64')).as_py()} ({fmt_bytes(nb)})"))
    nat = md.get("native") or {}
    if nat:
        used = "native C++ hooks" if nat.get("used") else f"pure-Python fallback ({nat.get('reason') or nat.get('state')})"
        rows.append(("warning/error capture", used))
    if md.get("engine"):
        # the recording engine: one line, with the reason when it is the python fallback
        eng = md["engine"]
        rows.append(("recording engine", "native (C++ RecordFunction observer)" if eng == "native"
                     else f"python engine (TorchDispatchMode): {md.get('engine_reason') or 'fallback'}"))
    if md.get("saved_to"):
        rows.append(("saved to", md["saved_to"]))
    notes = []
    compiled = md.get("compiled_ops")
    if compiled is None:   # a trace saved before compiled ops were told apart
        compiled = md.get("opaque_ops") or 0
    if compiled and not t.graphs.num_rows:
        notes.append(f"{compiled} forward op(s) were dispatched by torch.compile'd code, which runs compiled and "
                     "opaque: only the ops the compiled artifact dispatches are visible, not what it fused.")
    direct = (md.get("opaque_ops") or 0) - compiled
    if direct > 0:
        notes.append(f"{direct} forward op(s) ran outside any torch-level call (called through torch.ops or from "
                     "C++): they have no call, and their line is unknown.")
    if md.get("spilled_rows"):
        notes.append(f"{md['spilled_rows']} rows were spilled to disk while recording (trace larger than spill_rows).")
    if md.get("tracer_errors"):
        notes.append(f"{md['tracer_errors']} internal tracer error(s) were contained; the trace may be incomplete.")
    for note in md.get("notes") or []:
        notes.append(note)
    cell = md.get("cell")
    return Section(f"tensorscope trace{f' of cell [{cell}]' if cell is not None else ''}", rows, None, notes)


def top_ops(t, k: int = 10) -> Optional[Section]:
    ops = t.ops
    if ops.num_rows == 0:
        return None
    work = ops.filter(pc.invert(ops.column("is_noise")))
    if work.num_rows == 0:
        return None
    g = work.group_by("op").aggregate([("cpu_ns", "sum"), ("cpu_ns", "count"), ("bytes_written", "sum")])
    g = g.sort_by([("cpu_ns_sum", "descending")]).slice(0, k)
    total = pc.sum(work.column("cpu_ns")).as_py() or 1
    rows = []
    for r in g.to_pylist():
        rows.append((r["op"], str(r["cpu_ns_count"]), fmt_ns(r["cpu_ns_sum"]), f"{100 * r['cpu_ns_sum'] / total:.1f}%",
                     fmt_bytes(r["bytes_written_sum"])))
    return Section("top ops by CPU time", rows, ("op", "calls", "CPU", "share", "written"))


def modules_section(t, k: int = 12) -> Optional[Section]:
    """Time per module, children rolled up into their parents (``layer4`` is its blocks' total)."""
    ops = t.ops
    if ops.num_rows == 0:
        return None
    with_mod = ops.filter(pc.invert(pc.is_null(ops.column("module"))))
    if with_mod.num_rows == 0:
        return None
    g = with_mod.group_by(["module", "phase"]).aggregate([("cpu_ns", "sum"), ("cpu_ns", "count")]).to_pylist()
    total: dict = {}
    own: dict = {}
    for r in g:
        name, ns, n, bwd = r["module"], r["cpu_ns_sum"] or 0, r["cpu_ns_count"], r["phase"] == "backward"
        own[name] = own.get(name, 0) + ns
        parts = name.split(".")
        for i in range(len(parts)):
            key = ".".join(parts[: i + 1])
            tot = total.setdefault(key, [0, 0, 0, 0])   # total ns, forward ns, backward ns, ops
            tot[0] += ns
            tot[2 if bwd else 1] += ns
            tot[3] += n
    grand = sum(own.values()) or 1
    roots = [key for key in total if key.startswith("<") and "." not in key]
    root = roots[0] if len(roots) == 1 else None   # the outermost module called: "<Net>"
    if root is not None:
        total[root] = [sum(v[i] for key, v in total.items() if "." not in key) for i in range(4)]
    children: dict = {}
    for key in total:
        parent = key.rsplit(".", 1)[0] if "." in key else (root if key != root else None)
        children.setdefault(parent, []).append(key)
    order = []

    def walk(parent):
        for key in sorted(children.get(parent, []), key=lambda c: -total[c][0]):
            order.append(key)
            walk(key)

    walk(None)
    rows = []
    for key in order[:k]:
        tot = total[key]
        rows.append((key, fmt_ns(tot[0]), fmt_ns(own.get(key, 0)), fmt_ns(tot[1]), fmt_ns(tot[2]), str(tot[3]),
                     f"{100 * tot[0] / grand:.1f}%"))
    notes = [f"{len(order) - k} more modules: t.sql(\"select module, sum(cpu_ns) from ops group by module\")"] \
        if len(order) > k else []
    return Section("time per module (children rolled up into parents)", rows,
                   ("module", "total", "self", "forward", "backward", "ops", "share"), notes)


def errors_section(t) -> Optional[Section]:
    err = t.errors
    if err.num_rows == 0:
        return None
    rows = []
    for r in err.to_pylist()[:30]:
        where = []
        if r.get("cpp_type"):
            where.append(f"from {r['cpp_type']}")
        if r.get("cpp_file"):
            import os

            where.append(f"at {os.path.basename(r['cpp_file'])}:{r.get('cpp_line')}")
        if r.get("op"):
            where.append(f"in {r['op']}")
        if r.get("source_line") is not None:
            from .._location import format_location, trace_cells

            where.append(format_location(r.get("source_file"), r["source_line"], trace_cells(t)))
        msg = (r.get("message") or "").strip().splitlines()
        rows.append((r["kind"], r.get("py_type") or "", " ".join(where), (msg[0] if msg else "")[:300],
                     str(r.get("count") or 1)))
    return Section("exceptions and warnings", rows, ("kind", "type", "where", "message", "count"))


SECTIONS: tuple[Callable[..., Optional[Section]], ...] = (
    overview, top_ops, modules_section, errors_section,
    sections_precision.layout_section, sections_precision.precision_section,
    sections_memory.memory_section, sections_memory.allocator_section, sections_memory.module_memory_section,
    sections_memory.leaks_section,
    sections_timing.timing_section, sections_timing.icicle_section,
    sections_compiled.compiled_section,
    sections_api.api_section,
    sections_advice.advice_section,
)


def summarize(t, display=None) -> Summary:
    """Every section of ``t``; ``display`` (a ``DisplayOptions``, defaults when None) reaches the
    sections that take a ``display`` keyword (how a result is shown is never part of the trace)."""
    from ..options import DisplayOptions

    display = display if display is not None else DisplayOptions()
    out = []
    for fn in SECTIONS:
        try:
            sec = fn(t, display=display) if _takes_display(fn) else fn(t)
        except Exception as e:  # a broken section must not hide the others
            sec = Section(getattr(fn, "__name__", "section"), [], None, [f"could not render: {type(e).__name__}: {e}"])
        if sec is not None:
            out.append(sec)
    return Summary(out)


def _takes_display(fn: Callable[..., Any]) -> bool:
    import inspect

    try:
        return "display" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
