"""Summary sections "memory" and "leaks": how live bytes moved during the cell, and what it left behind.

"memory" reads the derived ``memory`` table (live bytes per device after each op)
through ``analyses.memory.memory_peak``: the peak per device, the op (and source
line) after which it happened, the bytes at the start and end, and the high-water
mark that also counts what ops allocated and freed within themselves.
"leaks" groups ``t.leaks`` (storages the cell created that are still alive) by
holder: bytes, kind, the path and the fix, largest first.
Both return None when there is nothing to say.
"""
from __future__ import annotations

import re
from typing import Optional

from .._common import fmt_bytes
from .section import Section

_TOP = 10


def memory_section(t) -> Optional[Section]:
    from ..analyses.memory import memory_peak

    mem = t.memory
    if mem.num_rows == 0:
        return None
    peaks = memory_peak(mem, t.ops, t.tensors)
    if not peaks or all(p["peak_bytes"] == 0 and p.get("high_water_bytes", 0) == 0 for p in peaks.values()):
        return None
    rows = []
    ops = t.ops
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
        rows.append((dev, fmt_bytes(p["peak_bytes"]), at, f"{fmt_bytes(p['start_bytes'])} → {fmt_bytes(p['end_bytes'])}",
                     fmt_bytes(hw) if hw is not None else "-"))
    return Section("memory (storages this trace saw)", rows, ("device", "peak live", "when", "start → end",
                                                               "high water (incl. temporaries)"))


_ELEMENT = re.compile(r"^(.*)\[(\d+)\]$")


def _kind_text(kind, g) -> str:
    growth = g["growth"]
    if growth is None:
        return kind or ""
    # within one cell the growth is per loop step: the holder's bytes over its elements
    per_step = len(g["items"]) > 1 and growth == g["bytes"] // len(g["items"])
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
    n_leaks = lk.num_rows - n_state
    return Section(f"still alive after the cell: {fmt_bytes(total)} in {n_leaks} storage{'s' if n_leaks != 1 else ''}",
                   rows, ("bytes", "kind", "holder", "storages", "created", "fix"), notes)
