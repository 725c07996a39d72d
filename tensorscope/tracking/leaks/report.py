"""The whole-notebook report as data: ``find_leaks()`` → ``LeakReport``.

Every live storage of the process, grouped by holder (a list of losses with all its
graphs is one group), bytes per device counted once per buffer. The report is plain
data (a LEAKS table, groups, totals, notes); ``render.leaks`` draws it as text or HTML.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import pyarrow as pa

from ..._common import Displayable
from ..._location import format_location
from . import boundary as _boundary
from . import growth as _growth
from .classify import _GcPaused
from .holders import _fallback_rows
from .known import _KNOWN
from .paths import STATE_KINDS, _merge_fixes
from .roots import _get_shell, _user_namespace
from .rows import _rows_for
from .rowset import VALUE_KIND, _int_array, _mark_values, _merge_same_buffer, _rows_to_table, _RowSet
from .search import _run_search, _Search
from .unreached import _heap_tensors


# -- public: the whole-notebook report -----------------------------------------------------------
@dataclass
class LeakGroup:
    """Storages with one holder and one fix (a list of losses and its graphs is one group)."""

    holder: str
    holder_kind: str
    fix: str
    n_storages: int
    nbytes: int
    by_device: dict[str, int]
    cells: list[int]
    sources: list[str]
    growth_bytes: Optional[int] = None   # bytes per cell while the holder grows across traced cells


class LeakReport(Displayable):
    """The live tensor storages of the notebook, grouped by holder; tensor-free and displayable.

    ``table`` is the LEAKS-schema table (one row per storage, largest first); ``groups`` the
    holders, largest first; ``totals`` the live bytes per device (each buffer counted once).
    """

    def __init__(self, table: pa.Table, groups: list[LeakGroup], totals: dict[str, int], elapsed_s: float,
                 visited: int, notes: list[str]):
        self.table = table
        self.groups = groups
        self.totals = totals
        self.elapsed_s = elapsed_s
        self.visited = visited
        self.notes = notes

    def __len__(self):
        return self.table.num_rows

    @property
    def nbytes(self) -> int:
        return sum(self.totals.values())

    def df(self):
        return self.table.to_pandas()

    def to_text(self, max_groups: int = 30) -> str:
        from ...render.leaks import report_text

        return report_text(self, max_groups)

    def to_html(self, max_groups: int = 100) -> str:
        from ...render.leaks import report_html

        return report_html(self, max_groups)

    def __repr__(self):
        return self.to_text()


def _totals(rows: _RowSet) -> dict[str, int]:
    """Live bytes per device, each byte once: intervals of overlapping buffers are merged (vectorised:
    after sorting by start, each interval adds what reaches past the furthest end before it)."""
    import numpy as np

    c = rows.cols
    n = len(rows)
    out: dict[str, int] = {}
    if not n:
        return out
    devs = c["device"]
    ptr = _int_array(c["data_ptr"], np.uint64)
    nb = _int_array(c["nbytes"], np.uint64)
    dev_of = {d: k for k, d in enumerate(dict.fromkeys(devs))}
    code = np.fromiter(map(dev_of.__getitem__, devs), dtype=np.int64, count=n)
    for dev, k in dev_of.items():
        mine = code == k
        unplaced = mine & (ptr == 0)   # no address: counted as is
        total = int(nb[unplaced].sum())
        placed = mine & (ptr != 0)
        if placed.any():
            s0 = ptr[placed]
            e0 = s0 + nb[placed]
            order = np.lexsort((e0, s0))
            s0, e0 = s0[order], e0[order]
            reach = np.maximum.accumulate(e0)
            prev = np.concatenate(([np.uint64(0)], reach[:-1]))
            lo = np.maximum(s0, prev)
            total += int(np.where(e0 > lo, e0 - np.minimum(lo, e0), np.uint64(0)).sum())
        out[dev] = total
    return out


def _groups(rows: _RowSet) -> list[LeakGroup]:
    """One group per (kind, root), largest first: a list of losses with all its graphs is one holder.

    Rows are grouped first (codes per group, numpy sums) and only each group's distinct fixes, cells
    and creation sites are formatted: 100k rows of one list cost a few C-level passes."""
    import numpy as np

    c = rows.cols
    n = len(rows)
    if not n:
        return []
    nb0 = _int_array(c["nbytes"])
    perm = np.argsort(-nb0, kind="stable").tolist()   # largest first; ties keep discovery order

    def take(f):
        return list(map(c[f].__getitem__, perm))

    kinds, labels = take("holder_kind"), take("root_label")
    keys = list(zip(kinds, labels))
    code_of = {k: g for g, k in enumerate(dict.fromkeys(keys))}
    codes = list(map(code_of.__getitem__, keys))
    del keys
    ng = len(code_of)
    codes_np = np.array(codes, dtype=np.int64)
    nbs = nb0[perm]
    sums = np.zeros(ng, dtype=np.int64)
    np.add.at(sums, codes_np, nbs)
    counts = np.bincount(codes_np, minlength=ng)
    first = np.full(ng, n, dtype=np.int64)
    np.minimum.at(first, codes_np, np.arange(n, dtype=np.int64))
    devs = take("device")
    dev_of = {d: k for k, d in enumerate(dict.fromkeys(devs))}
    nd = len(dev_of)
    cell_code = codes_np * nd + np.fromiter(map(dev_of.__getitem__, devs), dtype=np.int64, count=n)
    by_dev = np.zeros(ng * nd, dtype=np.int64)
    np.add.at(by_dev, cell_code, nbs)
    by_dev = by_dev.reshape(ng, nd)  # type: ignore[assignment]  # (ng*nd,) -> (ng, nd): numpy's shape-typed stubs
    on_dev = np.bincount(cell_code, minlength=ng * nd).reshape(ng, nd) > 0
    del cell_code
    dev_names = list(dev_of)
    # each group's rows (largest first), for its distinct fixes: one fix for all, or the first few
    by_code = np.argsort(codes_np, kind="stable")
    bounds = np.searchsorted(codes_np[by_code], np.arange(ng + 1))
    fix_col = c["fix"]
    cells: list[dict[int, None]] = [{} for _ in range(ng)]
    if c["cell"].count(None) != n:   # storages nobody recorded have none: skip the pass
        for g, cell in dict.fromkeys(zip(codes, take("cell"))):
            if cell is not None:
                cells[g][cell] = None
    sources: list[dict[str, None]] = [{} for _ in range(ng)]
    if c["alloc_op"].count(None) != n or c["source_line"].count(None) != n:
        for g, op, f, line in dict.fromkeys(zip(codes, take("alloc_op"), take("source_file"), take("source_line"))):
            if line is not None:
                sources[g][f"{op or 'created'} at {format_location(f or '?', line)}"] = None
            elif op:
                sources[g][op] = None
    holder_col, root_fix_col = c["holder"], c["root_fix"]
    groups = []
    for (kind, root_label), g in code_of.items():
        i0 = perm[int(first[g])]
        fl = list(map(fix_col.__getitem__, map(perm.__getitem__, by_code[bounds[g]:bounds[g + 1]].tolist())))
        if fl.count(fl[0]) == len(fl):
            fix = fl[0]
        elif kind == "global":
            fix = root_fix_col[i0]  # del losses[0], del losses[1] ... → del losses
        else:
            fs = list(dict.fromkeys(fl))
            fix = _merge_fixes(fs) if len(fs) <= 3 else _merge_fixes(fs[:3]) + f"; … ({len(fs) - 3} more, see .table)"
        del fl
        holder = root_label
        if kind == "autograd_graph":
            holder += " (autograd graphs)"
        elif counts[g] == 1:
            holder = holder_col[i0]
        groups.append(LeakGroup(
            holder=holder, holder_kind=kind, fix=fix, n_storages=int(counts[g]), nbytes=int(sums[g]),
            by_device={dev_names[d]: int(by_dev[g, d]) for d in np.flatnonzero(on_dev[g]).tolist()},
            cells=sorted(cells[g]), sources=list(sources[g]), growth_bytes=_growth.per_cell(root_label, kind)))
    # leaks first, model/optimizer state (not a leak: nothing to release) after them
    groups.sort(key=lambda g: (g.holder_kind in STATE_KINDS or g.holder_kind == VALUE_KIND, -g.nbytes))
    return groups


def find_leaks(*, min_bytes: int = 0, device: Optional[str] = None, shell=None, user_ns=None,
               frames: bool = True, max_nodes: int = _Search.MAX_NODES_DEFAULT) -> LeakReport:
    """Every live tensor storage the notebook holds, grouped by holder, with the fix for each.

    Reachable storages come from one search from the user's roots (globals, ``Out``, the last
    exception, user modules, live frames); storages only a trace or cell-boundary discovery saw,
    and Python tensors no root reaches, are classified as cycles or owners gc cannot see. Works
    with tracing off; with tracing on, rows carry the creating op, cell and line.
    """
    with _GcPaused():
        return _find_leaks(min_bytes, device, shell, user_ns, max_nodes, frames)


def _find_leaks(min_bytes, device, shell, user_ns, max_nodes, frames) -> LeakReport:
    t0 = time.perf_counter()
    if user_ns is None:  # an explicit namespace means: search that, not some running shell
        shell = _get_shell(shell)
    ns = _user_namespace(shell, user_ns)
    want: dict[int, Any] = {}
    search = None
    unreached: dict[int, Any] = {}
    tensors: dict[int, list[Any]] = {}
    notes: list[str] = []
    try:
        for key, k in list(_KNOWN.items()):
            s = k.ref()
            if s is not None:
                want[key] = s
            del s
        search = _run_search(shell, ns, want, True, max_nodes, frames)
        visited = len(search.order)
        if search.truncated:
            notes.append(f"search stopped after {max_nodes} objects: some holders may be missing")
        if search.errors:
            notes.append(f"{search.errors} objects could not be inspected")
        rows, reached = _rows_for(search, {})
        # Python tensors no root reaches (cycles, library state), and known storages no root reaches
        unreached, tensors = _heap_tensors(lambda k: k not in reached, search.idx, search.n_tensors)
        search.clear()
        for key, st in want.items():
            if key not in reached:
                unreached.setdefault(key, st)
        st = None
        for r in _fallback_rows(unreached, tensors, {}, {id(want)}):
            rows.add(r)
        _merge_same_buffer(rows)
        if min_bytes > 0 or device is not None:
            c = rows.cols
            rows.select([(nb or 0) >= min_bytes and (device is None or _device_match(d, device))
                         for nb, d in zip(c["nbytes"], c["device"])])
        _mark_values(rows, lambda root, kind: _growth.per_cell(root, kind) is not None)
        table = _rows_to_table(rows)
        groups = _groups(rows)
        totals = _totals(rows)
        d = _boundary.discovery()
        undated = sum(1 for c_, e in zip(rows.cols["cell"], rows.cols["expected"]) if c_ is None and not e)
        if d is not None and undated:
            since = f" (in cell {d.enabled_in})" if d.enabled_in is not None else ""
            notes.append(f"{undated} storage{'s' if undated != 1 else ''} with no creating cell: made before "
                         f"discovery was enabled{since} and never traced, so when is unknown")
        if d is None and not any(k.traced for k in _KNOWN.values()):
            notes.append("no trace or cell-boundary discovery saw these tensors being made: creating cell/op unknown "
                         "(trace cells, or turn on cell-boundary discovery: tensorscope.tracking.leaks.enable_discovery())")
        return LeakReport(table, groups, totals, time.perf_counter() - t0, visited, notes)
    finally:
        # nothing of ours may outlive the call, not even in a traceback's frames
        if search is not None:
            search.clear()
        want.clear()
        unreached.clear()
        tensors.clear()


def _device_match(dev: str, want: str) -> bool:
    want = str(want)
    return dev == want or dev.split(":")[0] == want
