"""Summary sections "memory" and "leaks": how live bytes moved during the cell, and what it left behind.

"memory" reads the trace's memory digest (``analyses.memory_digest``: one bounded sweep of the ops
a block at a time, never the ``memory`` or ``memory_timeline`` table): the peak per device, the op
(and source line) after which it happened, the bytes at the start and end, and the high-water
mark that also counts what ops allocated and freed within themselves.
"memory" also says what was alive at each peak by category (``tensors.category``) and draws the
timeline stacked by category (render/svg_memory.py, HTML only); "memory per module" reads
``t.module_memory`` (built a block of ops at a time, a few numbers per module): activations each
module saved for backward and its forward/backward peaks.
"CUDA allocator" reads ``t.allocator`` (CUDA only): allocated vs reserved, the fragmentation (reserved −
allocated at our peak, or at the end), retries and OOMs, and the snapshot's tables when recorded.
"leaks" groups ``t.leaks`` (storages the cell created that are still alive) by
holder: bytes, kind, the path and the fix, largest first.
Both return None when there is nothing to say.
"""
from __future__ import annotations

import re
from typing import Optional

from .._common import fmt_bytes
from .section import Section
from .svg_memory import memory_digest_svg

_TOP = 10


def digest(t, columns: Optional[int] = None) -> dict:
    """The trace's ``memory_digest`` for a chart of ``columns`` pixel columns (None: any one already
    made, else the notebook chart's), kept with the trace's other views: one sweep of the ops serves
    the memory section, its chart and the headline's peaks, in bounded memory."""
    from ..analyses.memory_digest import memory_digest
    from .svg_memory import chart_columns

    cache = getattr(t, "_derived", None)
    cache = cache if isinstance(cache, dict) else {}
    made = cache.setdefault("memory_digest", {})
    if columns is None:
        if made:
            return next(iter(made.values()))
        columns = chart_columns(px_per_column=_NOTEBOOK_PX)
    got = made.get(columns)
    if got is None:
        got = made[columns] = memory_digest(t.tensors, t.ops, columns)
    return got


#: pixels per column of the notebook's memory chart (the report draws every pixel column)
_NOTEBOOK_PX = 3


def memory_section(t, full: bool = False) -> Optional[Section]:
    from ..analyses.memory import memory_peak
    from ..analyses.memory_digest import digest_memory_peak
    from .svg_memory import chart_columns

    if t.ops.num_rows == 0 or t.tensors.num_rows == 0:   # the memory table is empty
        return None
    px = 1 if full else _NOTEBOOK_PX
    dg = digest(t, chart_columns(px_per_column=px))
    peaks = digest_memory_peak(dg, t.ops, t.tensors)
    if peaks is None:   # storages naming ops past the last (not a trace this package records)
        peaks = memory_peak(t.memory, t.ops, t.tensors)
    if not peaks or all(p["peak_bytes"] == 0 and p.get("high_water_bytes", 0) == 0 for p in peaks.values()):
        return None
    rows = []
    ops = t.ops
    made_of = _made_of(t, dg)
    for dev, p in peaks.items():
        at = f"after op {p['peak_seq']}"
        if p.get("peak_op"):
            at += f" ({p['peak_op']}"
            try:
                line = ops.column("source_line")[p["peak_seq"]].as_py()
                f = ops.column("source_file")[p["peak_seq"]].as_py()
            except Exception:
                line = f = None
            if line is not None:
                from .._location import format_location, trace_cells

                at += f" at {format_location(f, line, trace_cells(t))}"
            at += ")"
        hw = p.get("high_water_bytes")
        row = (dev, fmt_bytes(p["peak_bytes"]), at, f"{fmt_bytes(p['start_bytes'])} → {fmt_bytes(p['end_bytes'])}",
               fmt_bytes(hw) if hw is not None else "-")
        rows.append(row + (made_of.get(dev, ""),) if made_of else row)
    header: tuple = ("device", "peak live", "when", "start → end", "high water (incl. temporaries)")
    if not made_of:   # a trace older than tensors.category (schema 1.3)
        return Section("memory (storages this trace saw)", rows, header)
    notes = ["by category and module at the peak: t.memory_at(); per op: t.memory_timeline; "
             "per module: t.module_memory"]
    from .._location import trace_cells
    from .svg_memory import MIN_CHART_BYTES

    top = max(p["peak_bytes"] for p in peaks.values())
    if top < MIN_CHART_BYTES:   # a chart of a few bytes says nothing the table does not
        return Section("memory (storages this trace saw)", rows, header + ("at the peak",), notes)
    alt = "memory chart: live bytes after each op by category; " + "; ".join(
        f"{dev} peak {fmt_bytes(p['peak_bytes'])} after op {p['peak_seq']}" for dev, p in peaks.items())
    return Section("memory (storages this trace saw)", rows, header + ("at the peak",), notes,
                   svg=lambda: memory_digest_svg(dg, t.ops, cells=trace_cells(t), hovers=full),
                   text_alt=alt)


def allocator_section(t) -> Optional[Section]:
    """The CUDA caching allocator beside our view: one row per device the trace touched."""
    al = t.allocator
    if al.num_rows == 0:
        return None
    devices = al.to_pylist()
    history = any(r["source"] == "history" for r in devices)
    rows = []
    for r in devices:
        frag = fmt_bytes(r["fragmentation_bytes"]) if r["fragmentation_bytes"] is not None else "-"
        frag += f" (at our peak, op {r['fragmentation_seq']})" if r["fragmentation_seq"] is not None else " (at the end)"
        peak = fmt_bytes(r["allocated_peak"]) + ("" if r["peak_in_trace"] else " (before the trace)")
        rows.append((r["device"], f"{fmt_bytes(r['allocated_start'])} → {fmt_bytes(r['allocated_end'])}", peak,
                     f"{fmt_bytes(r['reserved_start'])} → {fmt_bytes(r['reserved_end'])}",
                     fmt_bytes(r["reserved_peak"]), frag, str(r["num_alloc_retries"]), str(r["num_ooms"])))
    notes = ["the allocator's peaks are since the program last called torch.cuda.reset_peak_memory_stats "
             "(tensorscope resets nothing); fragmentation: reserved − allocated"]
    if any((r["num_ooms"] or 0) > 0 for r in devices):
        notes.append("out of memory during the trace" + (": t.allocator_events (action 'oom') and "
                     "t.allocator_blocks show the cache at that point" if history else
                     "; memory_history=True (--memory-history) keeps the allocator's snapshot"))
    if history:
        ev = t.allocator_events
        joined = ev.column("storage_id").null_count
        notes.append(f"history: {ev.num_rows} allocator events ({ev.num_rows - joined} joined to our storages), "
                     f"{t.allocator_segments.num_rows} segments: t.allocator_events, t.allocator_blocks, "
                     "t.allocator_timeline")
    return Section("CUDA caching allocator", rows, ("device", "allocated start → end", "allocated peak",
                                                    "reserved start → end", "reserved peak", "fragmentation",
                                                    "retries", "OOMs"), notes)


def _made_of(t, dg: dict) -> dict:
    """device -> "activation 1.2 MiB, parameter 800 KiB, …" at the timeline's peak (categorised traces)."""
    cats = t.tensors.column("category")
    if cats.null_count == len(cats):
        return {}
    from ..analyses.memory_digest import digest_peaks
    from ..schema import MEMORY_CATEGORIES

    out = {}
    for p in digest_peaks(dg, t.ops):
        parts = sorted(((p[f"{c}_bytes"], c) for c in MEMORY_CATEGORIES if p[f"{c}_bytes"]), reverse=True)
        out[p["device"]] = ", ".join(f"{c.replace('_', ' ')} {fmt_bytes(b)}" for b, c in parts)
    return out


def module_memory_section(t) -> Optional[Section]:
    """Per module: activations saved for backward and the forward/backward peaks (children rolled in)."""
    cats = t.tensors.column("category")
    if cats.null_count == len(cats):   # no categories (schema < 1.3): no activations to speak of
        return None
    mm = t.module_memory
    if mm.num_rows == 0:
        return None
    rows_all = [r for r in mm.to_pylist() if r["activation_bytes"] or r["fwd_peak_bytes"] is not None]
    if not rows_all:
        return None
    devices = {r["device"] for r in rows_all}

    def peak(b, s):
        return "-" if b is None else f"{fmt_bytes(b)} (op {s})"

    rows = [((r["module"] + (f" [{r['device']}]" if len(devices) > 1 else "")), fmt_bytes(r["activation_bytes"]),
             fmt_bytes(r["own_activation_bytes"]), peak(r["fwd_peak_bytes"], r["fwd_peak_seq"]),
             peak(r["bwd_peak_bytes"], r["bwd_peak_seq"])) for r in rows_all[:_TOP]]
    notes = [f"{len(rows_all) - _TOP} more modules in t.module_memory"] if len(rows_all) > _TOP else []
    notes.append("activations: storages the module's forward ops made and a backward freed (or an autograd "
                 "graph still holds); children rolled into parents by path")
    return Section("memory per module", rows, ("module", "activations saved", "own", "forward peak",
                                                "backward peak"), notes)


_ELEMENT = re.compile(r"^(.*)\[(\d+)\]$")


def _kind_text(kind, g) -> str:
    growth = g["growth"]
    if growth is None:
        return kind or ""
    # within one cell the growth is per loop step: the holder's bytes over its elements
    # (the bytes of the container's own elements, joined into the group, grow as their own holder)
    n = len(g["items"])
    per_step = n > 1 and abs(growth * n - (g["bytes"] - g.get("elem_bytes", 0))) < n
    return f"{kind}, growing {fmt_bytes(growth)}/{'step' if per_step else 'cell'}"


def _holder_text(kind, holder, items) -> str:
    if kind != "autograd_graph":
        return holder
    if len(items) > 1:
        return f"{holder}[{min(items)}..{max(items)}] → grad_fn … ({len(items)} items)"
    if items:
        return f"{holder}[{next(iter(items))}] → grad_fn …"
    return f"{holder} → grad_fn …"


def leaks_section(t) -> Optional[Section]:
    lk = t.leaks
    if lk.num_rows == 0:
        return None
    from .._location import format_location, trace_cells
    from .leaks import state_line

    cells = trace_cells(t)
    groups: dict = {}
    state_bytes = n_state = 0
    for r in lk.to_pylist():
        if r.get("holder_kind") == "value":   # a small value a name keeps (loss): not a leak, not state
            continue
        if r.get("expected"):   # model/optimizer state: one line, not a leak
            state_bytes += r.get("nbytes") or 0
            n_state += 1
            continue
        holder = (r.get("holder") or "").split("; also ")[0]
        index = None
        kind = r.get("holder_kind")
        if kind == "autograd_graph":
            holder = holder.split(" → grad_fn")[0]
            m = _ELEMENT.match(holder)
            if m:   # the graphs of many elements of one container (losses[0], losses[1], ...): one holder
                holder, index = m.group(1), int(m.group(2))
        key = (kind, holder)
        g = groups.setdefault(key, {"n": 0, "bytes": 0, "fix": r.get("fix") or "", "line": r.get("source_line"),
                                    "items": set(), "growth": None,
                                    "file": r.get("source_file")})
        if r.get("growing"):
            g["growth"] = r.get("growth_bytes_per_cell")
        g["n"] += 1
        g["bytes"] += r.get("nbytes") or 0
        if index is not None:
            g["items"].add(index)
    # the elements themselves (`global losses[3]`, the scalar loss) join their container's graphs
    for (kind, holder), g in list(groups.items()):
        m = _ELEMENT.match(holder) if kind == "global" else None
        into = groups.get(("autograd_graph", m.group(1))) if m else None
        if into is not None and m is not None:
            del groups[(kind, holder)]
            into["n"] += g["n"]
            into["bytes"] += g["bytes"]
            into["elem_bytes"] = into.get("elem_bytes", 0) + g["bytes"]
            into["items"].add(int(m.group(2)))
    ordered = sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])
    rows = [(fmt_bytes(g["bytes"]), _kind_text(kind, g), _holder_text(kind, holder, g["items"]), str(g["n"]),
             (format_location(g["file"], g["line"], cells) if g["line"] is not None else ""), g["fix"])
            for (kind, holder), g in ordered[:_TOP]]
    total = sum(g["bytes"] for g in groups.values())
    notes = [f"{len(ordered) - _TOP} more holders in t.leaks"] if len(ordered) > _TOP else []
    if n_state:
        notes.append(state_line(state_bytes, n_state))
    if not groups:
        return Section("still alive after the cell: no leaks", [], None, notes)
    n_leaks = sum(g["n"] for g in groups.values())
    return Section(f"still alive after the cell: {fmt_bytes(total)} in {n_leaks} storage{'s' if n_leaks != 1 else ''}",
                   rows, ("bytes", "kind", "holder", "storages", "created", "fix"), notes)
