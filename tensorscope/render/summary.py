"""The cell summary: the headline first, one line of totals, then the sections, collapsed.

``summarize(t)`` builds a ``Summary`` (render/section.py) with a ``Head``: at most five findings
ranked by ``analyses.headline`` from what the analyses return (exceptions, NaN/Inf produced, leaks,
the advisor's findings), a clean cell saying so in one line, and the totals (``analyses.totals``
and the memory peaks). Then each section is a function ``trace -> Section | None``; ``SECTIONS``
lists every one explicitly, in display order: the cell's overview, the op and module tables (from
``analyses.totals``) and errors here, the rest one module per topic (``sections_*``). A broken
section never hides the others. ``full=True`` (``t.report(path)``) lists more rows and draws the
charts with their hover titles; the notebook summary keeps to the budget (docs/guide/summary.md).
A trace whose ``metadata["predicted"]`` is true (FakeTensorMode) says so first and in every title.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import pyarrow.compute as pc

from .._common import fmt_bytes, fmt_ns
from ..analyses.advisor import BUSY_SHARE
from . import sections_advice, sections_api, sections_compiled, sections_memory, sections_precision, sections_timing
from .section import Head, Section, Summary


def _location(file, line, cells=None) -> str:
    if file is None:
        return ""
    from .._location import format_location

    return format_location(file, line, cells)


def overview(t) -> Section:
    from ..analyses.totals import column_sum, count_equal, count_true, row_batches

    md = t.metadata
    ops = t.ops
    n = ops.num_rows
    rows = []
    # column by column, chunk by chunk (a spilled trace's columns are memory-mapped): no column copied
    noise = count_true(ops.column("is_noise")) if n else 0
    bwd = count_equal(ops.column("phase"), "backward") if n else 0
    rows.append(("ATen ops", f"{n} ({n - bwd} forward, {bwd} backward; {noise} bookkeeping ops hidden below)"))
    rows.append(("torch-level calls", str(t.calls.num_rows)))
    if n:
        cpu = column_sum(ops.column("cpu_ns")) or 0
        rows.append(("CPU time in ops", f"{fmt_ns(cpu)} of {fmt_ns(md.get('wall_ns'))} wall"))
        delay = max(int(md.get("run_delay_ns") or 0), int(md.get("worker_run_delay_ns") or 0))
        if delay:
            rows.append(("waiting for a CPU", f"{fmt_ns(delay)} (other processes' time: the op times and gaps "
                                              "hold it)"))
        rows.append(("bytes read / written", f"{fmt_bytes(column_sum(ops.column('bytes_read')))} / "
                                             f"{fmt_bytes(column_sum(ops.column('bytes_written')))}"))
        fl = column_sum(ops.column("flops"))
        if fl:
            rows.append(("FLOPs (ops with a formula)", f"{fl:,}"))
    tensors = t.tensors
    if tensors.num_rows:
        made, nb = 0, 0
        for b in row_batches(tensors, ["alloc_seq", "nbytes"]):
            created = pc.is_valid(b.column(0))
            made += int(pc.sum(created).as_py() or 0)
            nb += int(pc.sum(pc.filter(b.column(1), created)).as_py() or 0)
        rows.append(("storages created", f"{made} ({fmt_bytes(nb)})"))
    nat = md.get("native") or {}
    if nat:
        used = "native C++ hooks" if nat.get("used") else f"pure-Python fallback ({nat.get('reason') or nat.get('state')})"
        rows.append(("warning/error capture", used))
    if md.get("engine"):
        # the recording engine: one line, with the reason when it is the python fallback
        eng = md["engine"]
        rows.append(("recording engine", "native (C++ RecordFunction observer)" if eng == "native"
                     else f"python engine (TorchDispatchMode): {md.get('engine_reason') or 'fallback'}"))
    saved = getattr(t, "saved_to", None) or md.get("saved_to")   # a Trace says where it is kept
    if saved:
        rows.append(("saved to", saved))
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
    return Section("the cell in numbers", rows, None, notes)


def top_ops(t, k: int = 10, full: bool = False) -> Optional[Section]:
    """The ops by CPU time (``analyses.totals.op_totals``: what ``t.op_totals()`` returns)."""
    from ..analyses.totals import op_totals

    if t.ops.num_rows == 0:
        return None
    g = op_totals(t.ops)
    if g.num_rows == 0:
        return None
    k = 100 if full else k
    rows = [(r["op"], str(r["calls"]), fmt_ns(r["cpu_ns"]), f"{100 * r['share']:.1f}%", fmt_bytes(r["bytes_written"]))
            for r in g.slice(0, k).to_pylist()]
    notes = [f"{g.num_rows - k} more ops: t.op_totals()"] if g.num_rows > k else []
    return Section("top ops by CPU time", rows, ("op", "calls", "CPU", "share", "written"), notes)


def modules_section(t, k: int = 12, full: bool = False) -> Optional[Section]:
    """Time per module: the top-level modules by total time, each expanding to its children
    (``analyses.totals.module_totals``, deterministic: ties by name)."""
    from ..analyses.totals import module_totals

    if t.ops.num_rows == 0:
        return None
    mt = module_totals(t.ops, t.metadata.get("module_roots"))
    if mt.num_rows == 0:
        return None
    recs = mt.to_pylist()

    def row(r, indent=0):
        return ("  " * indent + r["module"], fmt_ns(r["total_ns"]), fmt_ns(r["self_ns"]), fmt_ns(r["forward_ns"]),
                fmt_ns(r["backward_ns"]), str(r["ops"]), f"{100 * r['share']:.1f}%")

    top = [r for r in recs if r["depth"] == 0]
    shown = top if full else top[:k]
    rows = [row(r) for r in shown]
    children = []
    for r in shown:
        kids = [c for c in recs if c["depth"] > 0 and c["module"].startswith(r["module"] + ".")]
        if kids:
            kids = kids if full else kids[:k]
            children.append((f"{r['module']}: {len(kids)} submodule{'s' * (len(kids) != 1)}",
                             [row(c, c["depth"]) for c in kids]))
    notes = [f"{len(top) - len(shown)} more top-level modules: t.sql(\"select module, sum(cpu_ns) from ops group by "
             "module\")"] if len(top) > len(shown) else []
    root = [r for r in recs if r["depth"] == -1]
    if root:
        notes.insert(0, f"{root[0]['module']}: {fmt_ns(root[0]['total_ns'])} in {root[0]['ops']} ops (the whole model)")
    return Section("time per module (children rolled up into parents)", rows,
                   ("module", "total", "self", "forward", "backward", "ops", "share"), notes, children=children)


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


def _advice_section(t, ctx: dict[str, Any]) -> Optional[Section]:
    if t.ops.num_rows == 0 or ctx.get("advice") is None:
        return None
    return sections_advice.advice_to_section(ctx["advice"])


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


def summarize(t, display=None, full: bool = False) -> Summary:
    """The headline and every section of ``t``; ``display`` (a ``DisplayOptions``, defaults when None)
    reaches the sections that take a ``display`` keyword (how a result is shown is never part of the
    trace); ``full``: the report's detail (more rows, charts with hover titles)."""
    from ..options import DisplayOptions

    display = display if display is not None else DisplayOptions()
    ctx: dict[str, Any] = {}
    release = getattr(t, "_release_pages", None)   # a long trace: what each pass read of its mapped tables
    if t.ops.num_rows and hasattr(t, "advice"):
        try:
            ctx["advice"] = t.advice(min_share=display.min_finding_share)
        except Exception as e:   # the advisor failing must not hide the summary
            ctx["advice_error"] = e
        if release is not None:
            release()
    out = []
    for fn in SECTIONS:
        try:
            if fn is sections_advice.advice_section:
                if "advice_error" in ctx:
                    raise ctx["advice_error"]
                sec = _advice_section(t, ctx)
            else:
                kw: dict[str, Any] = {}
                params = _params(fn)
                if "display" in params:
                    kw["display"] = display
                if "full" in params:
                    kw["full"] = full
                sec = fn(t, **kw)
        except Exception as e:  # a broken section must not hide the others
            sec = Section(getattr(fn, "__name__", "section"), [], None, [f"could not render: {type(e).__name__}: {e}"])
        if release is not None:
            release()
        if sec is not None:
            out.append(sec)
    summary = Summary(out, head=head(t, ctx, min_share=display.min_finding_share), inline_svg=full)
    if release is not None:
        release()
    return summary


def report_html(t, display=None) -> str:
    """The standalone page of ``t.report``: the full summary, every section open."""
    from .ranks import html_document

    body = summarize(t, display, full=True).to_html().replace("<details>", "<details open>")
    cell = t.metadata.get("cell")
    return html_document(f"tensorscope report{f' of cell [{cell}]' if cell is not None else ''}", body)


def write_report(t, path) -> str:
    import os

    from ..errors import ExportError

    path = os.fspath(path)
    doc = report_html(t)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(doc)
    except OSError as e:
        raise ExportError(f"cannot write the report to {path!r}: {e.strerror or e}") from e
    return path


def head(t, ctx: Optional[dict[str, Any]] = None, min_share: float = 0.01) -> Head:
    """The headline (``analyses.headline``) and the totals line of ``t``; ``min_share``: the display's
    ``min_finding_share`` (the least cost of a performance finding, as a share of the op time)."""
    from .._location import trace_cells
    from ..analyses.headline import headline
    from ..analyses.nonfinite import nonfinite_verdicts
    from ..analyses.totals import cell_totals

    ctx = ctx if ctx is not None else {}
    md = t.metadata
    predicted = bool(md.get("predicted"))
    ops = t.ops
    tot = cell_totals(ops, md.get("wall_ns"))
    peaks = _peaks(t)
    peak = max((p["live_bytes"] for p in peaks), default=0)
    adv = ctx.get("advice")
    try:
        verdicts = nonfinite_verdicts(ops)
    except Exception:
        verdicts = []
    lines = headline(errors=t.errors, verdicts=verdicts, leaks=t.leaks,
                     findings=adv.findings if adv is not None else None, op_ns=tot["cpu_ns"], peak_bytes=peak,
                     predicted=predicted, cells=trace_cells(t), min_share=min_share)
    cell = md.get("cell")
    title = f"tensorscope trace of cell [{cell}]" if cell is not None else "tensorscope trace"
    return Head(title, lines, _totals_line(t, tot, peaks, predicted), predicted,
                clean="clean — no exception, no NaN/Inf produced, no leak, no performance finding above "
                      f"{100 * min_share:g}% of op time")


def _peaks(t) -> list[dict[str, Any]]:
    """Each device's peak row of ``t.memory_timeline``, read from the memory digest the memory section
    made (``sections_memory.digest``: the timeline itself is not built)."""
    try:
        from ..analyses.memory_digest import digest_peaks

        if t.ops.num_rows == 0 or t.tensors.num_rows == 0:
            return []
        return digest_peaks(sections_memory.digest(t), t.ops)
    except Exception:
        return []


def _totals_line(t, tot: dict[str, Any], peaks: list[dict[str, Any]], predicted: bool) -> str:
    from ..schema import MEMORY_CATEGORIES

    parts = [f"{tot['ops']:,} ops ({tot['forward']:,} forward, {tot['backward']:,} backward)"]
    if tot["ops"]:
        when = "predicted " if predicted else ""
        wall = f" of {fmt_ns(tot['wall_ns'])} wall" if tot.get("wall_ns") and not predicted else ""
        parts.append(f"{fmt_ns(tot['cpu_ns'])} {when}in ops{wall}")
    delay = max(int(t.metadata.get("run_delay_ns") or 0), int(t.metadata.get("worker_run_delay_ns") or 0))
    if delay >= BUSY_SHARE * (tot.get("wall_ns") or 0) > 0 and not predicted:
        parts.append(f"waited {fmt_ns(delay)} for a CPU (a busy machine)")
    for p in peaks:
        cats = sorted(((p.get(f"{c}_bytes") or 0, c) for c in MEMORY_CATEGORIES), reverse=True)
        made = ", ".join(f"{c.replace('_', ' ')} {fmt_bytes(b)}" for b, c in cats if b)[:200]
        dev = f" on {p['device']}" if len(peaks) > 1 else ""
        parts.append(f"peak {fmt_bytes(p['live_bytes'])}{dev}" + (f" ({made})" if made else ""))
    lk = t.leaks
    if lk.num_rows:
        exp = pc.fill_null(lk.column("expected"), False)
        alive = lk.filter(pc.invert(exp))
        if alive.num_rows:
            nb = pc.sum(alive.column("nbytes")).as_py() or 0
            parts.append(f"still alive {fmt_bytes(nb)} in {alive.num_rows} storage{'s' * (alive.num_rows != 1)}")
    return " · ".join(parts)


@functools.cache
def _params(fn: Callable[..., Any]) -> frozenset[str]:
    import inspect

    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _takes_display(fn: Callable[..., Any]) -> bool:
    return "display" in _params(fn)
