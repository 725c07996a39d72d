"""Summary sections "layout" and "precision": what moved data between layouts, what changed dtype.

Both are functions ``trace -> Section | None`` listed in the summary's
``SECTIONS``; they only read tables (``layout_changes``, ``casts``,
``ops``) and metadata, and return None when there is nothing to say, so a
clean cell shows no empty boxes.

"layout": format changes, hidden copies and non-dense inputs grouped by place
(op, torch-level call, source line, module), largest bytes first.
"precision": casts by kind and direction (round trips counted), the ops that
produced NaN/Inf (the first one called out), and, with ``numerics=``, the ops
whose relative error against the wide reference exceeds the threshold.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import pyarrow.compute as pc

from .._common import NoGC, fmt_bytes
from .._location import format_location, trace_cells
from ..analyses.guards import group_rows
from .section import Section

_TOP = 12
_KIND_LABEL = {"format_change": "format change", "hidden_copy": "hidden copy", "non_dense_input": "non-dense input"}
_PLURAL = {"format_change": "format changes", "hidden_copy": "hidden copies", "non_dense_input": "non-dense inputs"}


def _where(r, cells=None) -> str:
    # "Cell In[2], line 3 (module 7)": a bare module name ("7", a Sequential child) after the line
    # read as part of it ("Cell In[2], line 3 7")
    loc = format_location(r.get("source_file"), r.get("source_line"), cells)
    mod = f"module {r['module']}" if r.get("module") else ""
    return f"{loc} ({mod})" if loc and mod else (loc or mod)


_group = group_rows   # one grouping rule for guards and summary


def layout_section(t) -> Optional[Section]:
    cells = trace_cells(t)
    lc = t.layout_changes
    if lc.num_rows == 0:
        return None
    with NoGC():
        rows = lc.to_pylist()
    groups = _group(rows, lambda r: (r["kind"], r["op"], r.get("call"), r.get("from_format"), r.get("to_format"),
                                     r.get("source_file"), r.get("source_line"), r.get("module")))
    groups.sort(key=lambda e: -e[2])
    out = []
    for r, n, nb in groups[:_TOP]:
        detail = r.get("reason") or ""
        out.append((_KIND_LABEL.get(r["kind"], r["kind"]), r["op"], r.get("call") or "",
                    f"{r.get('from_format')} → {r.get('to_format')}", str(n), fmt_bytes(nb), _where(r, cells), detail))
    notes = []
    tot: dict = {}
    for r in rows:
        c = tot.setdefault(r["kind"], [0, 0])
        c[0] += 1
        c[1] += r.get("bytes") or 0
    parts = [f"{v[0]} {(_PLURAL if v[0] != 1 else _KIND_LABEL).get(k, k)} ({fmt_bytes(v[1])})" for k, v in tot.items()]
    notes.append("; ".join(parts))
    lost = sum(1 for r in rows if r["kind"] in ("format_change", "hidden_copy")
               and (r.get("from_format") or "").startswith("channels_last")
               and not (r.get("to_format") or "").startswith("channels_last"))
    if lost:
        notes.append(f"{lost} op(s) dropped channels_last; ops after them run contiguous "
                     "(guard this with %%tensorscope --expect channels_last)")
    if len(groups) > _TOP:
        notes.append(f"{len(groups) - _TOP} more place(s) in t.layout_changes")
    return Section("layout", out, ("kind", "op", "call", "change", "count", "bytes", "where", "detail"), notes)


def precision_section(t, display=None) -> Optional[Section]:
    cells = trace_cells(t)
    rows: list[tuple] = []
    notes: list[str] = []
    # -- casts by kind and direction
    cs = t.casts
    if cs.num_rows:
        with NoGC():
            crow = cs.to_pylist()
        def key(r):
            return (r["kind"], r["direction"], r["from_dtype"], r["to_dtype"])

        groups = _group(crow, key)
        groups.sort(key=lambda e: (-e[1], -e[2]))
        places: dict = {}
        for x in crow:
            places.setdefault(key(x), OrderedDict()).setdefault(
                (x.get("source_file"), x.get("source_line"), x.get("module")), x)
        for r, n, nb in groups[:_TOP]:
            pl = list(places[key(r)].values())
            where = ", ".join(_where(p, cells) for p in pl[:3]) + (" …" if len(pl) > 3 else "")
            rows.append((f"cast: {r['kind']}", f"{r['from_dtype']} → {r['to_dtype']} ({r['direction']})",
                         str(n), fmt_bytes(nb), where))
        from ..analyses.casts import round_trip_pairs

        rt = round_trip_pairs(t.ops, t.calls)
        if rt:
            rows.append(("cast: round trip", "a → b → a on the same data", str(rt), "", ""))
        if any(r["kind"] == "autocast" for r in crow):
            notes.append("autocast caches the casts of parameters (leaf tensors requiring grad) while its region is "
                         "open: a module's first call casts input, weight and bias, later calls only the input; "
                         "under inference_mode nothing is cached")
        if any(r["direction"] in ("int_narrowing", "float_to_int") for r in crow):
            notes.append("int_narrowing/float_to_int casts wrap or truncate silently: check the value range")
    # -- non-finite values: produced by an op, written on purpose (masks), or passed on
    ops = t.ops
    if ops.num_rows and ops.column("nonfinite").null_count < ops.num_rows:
        from ..analyses.nonfinite import nonfinite_verdicts

        b = nonfinite_verdicts(ops)
        if b:
            prod = [r for r in b if r["verdict"] == "produced"]
            for r in prod[:5]:
                first = " (first)" if r is prod[0] else ""
                rows.append((f"non-finite produced{first}", f"{r['op']} (seq {r['seq']})", str(r["nonfinite"]), "",
                             _where(r, cells)))
            nprop = sum(1 for r in b if r["verdict"] == "propagated")
            if nprop:
                rows.append(("non-finite propagated", f"{nprop} op(s) passed NaN/Inf on", str(nprop), "", ""))
            nconst = sum(1 for r in b if r["verdict"] == "constant")
            nfrom = sum(1 for r in b if r["verdict"] == "from_constant")
            if nconst and (prod or nprop):
                notes.append(f"±inf written on purpose by {nconst} op(s) (full/masked_fill/where with an infinite "
                             f"constant, e.g. attention masks) and carried on by {nfrom}: intentional, not an overflow")
            if nprop and not prod:
                notes.append("every other NaN/Inf came from the cell's inputs (no op inside it produced one)"
                             if nconst else "every NaN/Inf came from the cell's inputs (no op inside it produced one)")
    elif ops.num_rows:
        notes.append("non-finite screen off")
    # -- numerics shadow
    md = t.metadata or {}
    opts = md.get("options") or {}
    if opts.get("numerics"):
        thr = display.numerics_threshold if display is not None else 1e-2   # a DisplayOptions
        col = ops.column("num_rel_err")
        if col.null_count < ops.num_rows:
            over = ops.filter(pc.fill_null(pc.greater(col, thr), False))
            cand = over.select(["seq", "op", "num_rel_err", "num_max_abs_err", "in_dtypes", "module", "source_file",
                                "source_line"]).to_pylist()
            cand.sort(key=lambda r: -(r["num_rel_err"] if r["num_rel_err"] == r["num_rel_err"] else float("inf")))
            for r in cand[:_TOP]:
                rows.append(("numerics error", f"{r['op']} (seq {r['seq']}, {'/'.join(sorted(set(r['in_dtypes'] or [])))})",
                             f"rel {r['num_rel_err']:.3g}", f"max abs {r['num_max_abs_err']:.3g}", _where(r, cells)))
            n_cmp = ops.num_rows - col.null_count
            notes.append(f"numerics ({opts.get('numerics')}): {n_cmp} op(s) compared against a wide reference, "
                         f"{over.num_rows} above rel. error {thr:g}")
        nm = md.get("numerics") or {}
        skipped = nm.get("skipped") or {}
        if skipped:
            reasons = nm.get("skip_reasons") or {}
            notes.append("numerics skipped: " + ", ".join(
                f"{k} x{v} ({reasons.get(k, 'skipped')})" for k, v in sorted(skipped.items())))
    if not rows and not notes:
        return None
    if not rows and notes == ["non-finite screen off"]:
        return None
    return Section("precision", rows, ("what", "detail", "count", "bytes / error", "where"), notes)
