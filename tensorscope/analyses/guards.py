"""Cell guards: ``expect=(...)`` and ``max_casts=N`` checked against a finished trace.

``check_guards(trace) -> list[str]`` returns one readable failure per broken expectation
(``channels_last``, ``no_nonfinite``, ``no_hidden_copies``, ``no_leaks``, ``no_syncs``,
``max_casts``), empty when all hold; ``session.raise_for_guards`` raises them as a
``GuardError``. The options come from the trace's metadata, so a loaded trace can be re-checked.

Rules and details: docs/development/analyses.md#cell-guards-analysesguardspy
"""
from __future__ import annotations

import os
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, Callable, Optional

import pyarrow.compute as pc

from .._common import fmt_bytes

CL = ("channels_last", "channels_last_3d")
_MAX_LISTED = 5


def _where(r: dict[str, Any]) -> str:
    parts = []
    f, line = r.get("source_file"), r.get("source_line")
    if f is not None or line is not None:
        parts.append(f"{os.path.basename(f) if f else '?'}:{line if line is not None else '?'}")
    if r.get("module"):
        parts.append(f"module {r['module']}")
    return ", ".join(parts) if parts else "location unknown"


def group_rows(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], Hashable]) -> list[list[Any]]:
    """[[first row, count, total bytes]] grouped by ``key(row)``, in order of first appearance."""
    groups: OrderedDict[Hashable, list[Any]] = OrderedDict()
    for r in rows:
        k = key(r)
        g = groups.get(k)
        if g is None:
            groups[k] = [r, 1, r.get("bytes") or 0]
        else:
            g[1] += 1
            g[2] += r.get("bytes") or 0
    return list(groups.values())


def _grouped(rows: list[dict[str, Any]], key_fields: Sequence[str],
             limit: int = _MAX_LISTED) -> list[tuple[Any, ...]]:
    groups = group_rows(rows, lambda r: tuple(r.get(f) for f in key_fields))
    return [tuple(v) for v in groups[:limit]] + ([("more", len(groups) - limit, 0)] if len(groups) > limit else [])


def _listing(groups: list[tuple[Any, ...]]) -> str:
    lines = []
    for r, n, nb in groups:
        if r == "more":
            lines.append(f"    … and {n} more place(s)")
            continue
        call = f" in {r['call']}()" if r.get("call") else ""
        lines.append(f"    {r['op']}{call}: {r.get('from_format')} -> {r.get('to_format')}, "
                     f"{n}x, {fmt_bytes(nb)} ({_where(r)})")
    return "\n".join(lines)


def _check_channels_last(t: Any) -> Optional[str]:
    lc = t.layout_changes
    # a hidden copy that dropped the format is one row of kind hidden_copy (layout: one event, one row)
    rows = [r for r in lc.to_pylist() if r["kind"] in ("format_change", "hidden_copy") and r["from_format"] in CL
            and r["to_format"] not in CL]
    if rows:
        groups = _grouped(rows, ("op", "call", "source_file", "source_line", "module"))
        total = sum(r.get("bytes") or 0 for r in rows)
        return (f"expect channels_last: {len(rows)} op(s) returned a channels_last input in another format "
                f"({fmt_bytes(total)} written that way; later convolutions then run on the wrong layout):\n"
                + _listing(groups))
    ops = t.ops
    if ops.num_rows == 0:
        return None
    from .layout import drop_noise, rows_with_any

    if len(rows_with_any(ops.column("in_formats"), CL)) or len(rows_with_any(ops.column("out_formats"), CL)):
        return None
    # no channels_last anywhere: did 4-d/5-d dense data run at all?
    idx = drop_noise(ops, rows_with_any(ops.column("in_formats"), ("contiguous",)))   # never a bookkeeping row
    for r in ops.select(["op", "in_shapes", "in_formats", "in_ambiguous", "source_file", "source_line", "module"]) \
            .take(idx[:2000]).to_pylist():
        for sh, f, a in zip(r["in_shapes"] or [], r["in_formats"] or [], r["in_ambiguous"] or []):
            if len(sh) in (4, 5) and f == "contiguous" and not a:
                return (f"expect channels_last: no tensor in this cell was channels_last, but 4-d/5-d data ran "
                        f"contiguous (first: {r['op']} on shape {tuple(sh)}, {_where(r)}); convert the model "
                        f"and its input with .to(memory_format=torch.channels_last)")
    return None


def _check_nonfinite(t: Any) -> Optional[str]:
    ops = t.ops
    if ops.num_rows == 0:
        return None
    col = ops.column("nonfinite")
    if col.null_count == ops.num_rows:
        return ("expect no_nonfinite: cannot check, the non-finite screen was off for this trace "
                "(drop --no-nonfinite / nonfinite=False)")
    held = pc.fill_null(pc.greater(col, 0), False)
    if "is_noise" in ops.column_names:   # eager's bookkeeping (torch.tensor's detach_) holds, never outputs, a value
        held = pc.and_(held, pc.invert(pc.fill_null(ops.column("is_noise"), False)))
    bad = ops.filter(held)
    if bad.num_rows == 0:
        return None
    rows = bad.select(["seq", "op", "nonfinite", "nonfinite_produced", "module", "source_file", "source_line"]).to_pylist()
    produced = [r for r in rows if r["nonfinite_produced"]]
    first = produced[0] if produced else rows[0]
    head = (f"first produced by {first['op']} (seq {first['seq']}, {first['nonfinite']} value(s), {_where(first)})"
            if produced else f"none was produced inside the cell: they came from its inputs "
                             f"(first seen in {first['op']}, seq {first['seq']}, {_where(first)})")
    return (f"expect no_nonfinite: {len(rows)} op(s) output NaN/Inf ({len(produced)} produced them, "
            f"{len(rows) - len(produced)} propagated); {head}")


def _check_hidden_copies(t: Any) -> Optional[str]:
    rows = [r for r in t.layout_changes.to_pylist() if r["kind"] == "hidden_copy"]
    if not rows:
        return None
    groups = _grouped(rows, ("op", "call", "source_file", "source_line", "module"))
    lines = []
    for r, n, nb in groups:
        if r == "more":
            lines.append(f"    … and {n} more place(s)")
        else:
            lines.append(f"    {r.get('reason') or r['op']}; {n}x, {fmt_bytes(nb)} ({_where(r)})")
    total = sum(r.get("bytes") or 0 for r in rows)
    return f"expect no_hidden_copies: {len(rows)} hidden cop(ies), {fmt_bytes(total)}:\n" + "\n".join(lines)


def _check_leaks(t: Any) -> Optional[str]:
    lk = t.leaks
    if lk.num_rows == 0:
        return None
    rows = [r for r in lk.to_pylist() if not r.get("expected")]   # model/optimizer state is not a leak
    if not rows:
        return None
    total = sum(r.get("nbytes") or 0 for r in rows)
    lines = []
    for r in rows[:_MAX_LISTED]:
        holder = r.get("holder") or "unknown holder"
        fix = f"; fix: {r['fix']}" if r.get("fix") else ""
        lines.append(f"    {fmt_bytes(r.get('nbytes'))} {r.get('dtype')} {tuple(r.get('shape') or ())} "
                     f"from {r.get('alloc_op') or '?'} (line {r.get('source_line')}), held by {holder}{fix}")
    if len(rows) > _MAX_LISTED:
        lines.append(f"    … and {len(rows) - _MAX_LISTED} more")
    return f"expect no_leaks: {len(rows)} storage(s) created by the cell are still alive ({fmt_bytes(total)}):\n" \
        + "\n".join(lines)


def _check_max_casts(t: Any, limit: int) -> Optional[str]:
    cs = t.casts
    n = cs.num_rows
    if n <= limit:
        return None
    rows = cs.to_pylist()
    kinds = Counter((r["kind"], r["direction"]) for r in rows)
    by = ", ".join(f"{k} {d} x{c}" for (k, d), c in kinds.most_common())
    places = Counter((r["op"], r.get("call"), r.get("source_file"), r.get("source_line"), r.get("module"))
                     for r in rows)
    lines = []
    for (op, call, f, line, mod), c in places.most_common(_MAX_LISTED):
        call_s = f" in {call}()" if call else ""
        lines.append(f"    {op}{call_s}: {c}x ({_where({'source_file': f, 'source_line': line, 'module': mod})})")
    from .casts import round_trip_pairs

    rt = round_trip_pairs(t.ops, t.calls)
    rts = f"; {rt} round trip(s) a->b->a" if rt else ""
    return f"max_casts={limit}: {n} casts ran ({by}{rts}):\n" + "\n".join(lines)


def _check_syncs(t: Any) -> Optional[str]:
    from .syncs import sync_table

    st = sync_table(t.ops, t.calls)
    if st.num_rows == 0:
        return None
    rows = st.to_pylist()
    places = Counter((r["call"] or r["op"], r["kind"], r.get("source_file"), r.get("source_line"), r.get("module"))
                     for r in rows)
    lines = []
    for (what, kind, f, line, mod), c in places.most_common(_MAX_LISTED):
        lines.append(f"    {what} ({kind.replace('_', ' ')}): {c}x "
                     f"({_where({'source_file': f, 'source_line': line, 'module': mod})})")
    if len(places) > _MAX_LISTED:
        lines.append(f"    … and {len(places) - _MAX_LISTED} more place(s)")
    return f"expect no_syncs: {len(rows)} op(s) force a device->host synchronisation:\n" + "\n".join(lines)


_CHECKS = {
    "channels_last": _check_channels_last,
    "no_nonfinite": _check_nonfinite,
    "no_hidden_copies": _check_hidden_copies,
    "no_leaks": _check_leaks,
    "no_syncs": _check_syncs,
}


def check_guards(trace: Any) -> list[str]:
    """Failures of the guards in ``trace.metadata['options']`` (empty list: all hold)."""
    opts: dict[str, Any] = (trace.metadata or {}).get("options") or {}
    failures: list[str] = []
    for e in opts.get("expect") or ():
        fn = _CHECKS.get(e)
        if fn is None:
            failures.append(f"unknown expectation {e!r}")
            continue
        msg = fn(trace)
        if msg:
            failures.append(msg)
    mc = opts.get("max_casts")
    if mc is not None:
        msg = _check_max_casts(trace, int(mc))
        if msg:
            failures.append(msg)
    return failures
