"""The whole-notebook report as data: ``find_leaks()`` → ``LeakReport``.

Every live storage of the process, grouped by holder (a list of losses with all its
graphs is one group), bytes per device counted once per buffer. The report is plain
data (a LEAKS table, groups, totals, notes); ``render.leaks`` draws it as text or HTML.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import pyarrow as pa

from . import boundary as _boundary
from . import growth as _growth
from .classify import _GcPaused
from .known import _KNOWN
from .paths import _merge_fixes
from .roots import _get_shell, _user_namespace
from .rows import _Row, _fallback_rows, _merge_same_buffer, _rows_for, _rows_to_table
from .search import _Search, _run_search
from .unreached import _heap_tensors
from ..._common import Displayable
from ..._location import format_location


# -- public: the whole-notebook report -----------------------------------------------------------
@dataclass
class LeakGroup:
    """Storages with one holder and one fix (a list of losses and its graphs is one group)."""

    holder: str
    holder_kind: str
    fix: str
    n_storages: int
    nbytes: int
    by_device: Dict[str, int]
    cells: List[int]
    sources: List[str]
    growth_bytes: Optional[int] = None   # bytes per cell while the holder grows across traced cells


class LeakReport(Displayable):
    """The live tensor storages of the notebook, grouped by holder; tensor-free and displayable.

    ``table`` is the LEAKS-schema table (one row per storage, largest first); ``groups`` the
    holders, largest first; ``totals`` the live bytes per device (each buffer counted once).
    """

    def __init__(self, table: pa.Table, groups: List[LeakGroup], totals: Dict[str, int], elapsed_s: float,
                 visited: int, notes: List[str]):
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


def _totals(rows: List[_Row]) -> Dict[str, int]:
    """Live bytes per device, each byte once: intervals of overlapping buffers are merged (vectorised:
    after sorting by start, each interval adds what reaches past the furthest end before it)."""
    import numpy as np

    by_dev: Dict[str, Tuple[List[int], List[int]]] = {}
    out: Dict[str, int] = {}
    for r in rows:
        if r.data_ptr:
            st = by_dev.get(r.device)
            if st is None:
                st = by_dev[r.device] = ([], [])
            st[0].append(r.data_ptr)
            st[1].append(r.nbytes)
        else:
            out[r.device] = out.get(r.device, 0) + r.nbytes
    for dev, (starts, sizes) in by_dev.items():
        s0 = np.array(starts, dtype=np.uint64)
        e0 = s0 + np.array(sizes, dtype=np.uint64)
        order = np.lexsort((e0, s0))
        s0, e0 = s0[order], e0[order]
        reach = np.maximum.accumulate(e0)
        prev = np.concatenate(([np.uint64(0)], reach[:-1]))
        lo = np.maximum(s0, prev)
        total = int(np.where(e0 > lo, e0 - np.minimum(lo, e0), np.uint64(0)).sum())
        out[dev] = out.get(dev, 0) + total
    return out


def _groups(rows: List[_Row]) -> List[LeakGroup]:
    """One group per (kind, root): a list of losses with all its graphs is one holder."""
    by: Dict[Tuple[str, str], List[_Row]] = {}
    for r in rows:
        by.setdefault((r.holder_kind, r.root_label), []).append(r)
    groups = []
    for (kind, root_label), rs in by.items():
        fixes = list(dict.fromkeys(r.fix for r in rs))
        if len(fixes) == 1:
            fix = fixes[0]
        elif kind == "global":
            fix = rs[0].root_fix  # del losses[0], del losses[1] ... → del losses
        elif len(fixes) <= 3:
            fix = _merge_fixes(fixes)
        else:
            fix = _merge_fixes(fixes[:3]) + f"; … ({len(fixes) - 3} more, see .table)"
        holder = root_label
        if kind == "autograd_graph":
            holder += " (autograd graphs)"
        elif len(rs) == 1:
            holder = rs[0].holder
        g = LeakGroup(holder=holder, holder_kind=kind, fix=fix, n_storages=0, nbytes=0, by_device={}, cells=[],
                      sources=[], growth_bytes=_growth.per_cell(root_label))
        cells: Dict[int, None] = {}
        sources: Dict[str, None] = {}
        by_device = g.by_device
        nbytes = 0
        for r in rs:
            nb = r.nbytes
            nbytes += nb
            by_device[r.device] = by_device.get(r.device, 0) + nb
            if r.cell is not None:
                cells[r.cell] = None
            if r.source_line is not None:
                sources[f"{r.alloc_op or 'created'} at {format_location(r.source_file or '?', r.source_line)}"] = None
            elif r.alloc_op:
                sources[r.alloc_op] = None
        g.n_storages = len(rs)
        g.nbytes = nbytes
        g.cells = sorted(cells)
        g.sources = list(sources)
        groups.append(g)
    groups.sort(key=lambda g: -g.nbytes)
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
    want: Dict[int, Any] = {}
    search = None
    unreached: Dict[int, Any] = {}
    tensors: Dict[int, List[Any]] = {}
    notes: List[str] = []
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
        unreached, tensors = _heap_tensors(lambda k: k not in reached, search.idx)
        search.clear()
        for key, st in want.items():
            if key not in reached:
                unreached.setdefault(key, st)
        st = None
        rows += _fallback_rows(unreached, tensors, {}, {id(want)})
        rows = [r for r in _merge_same_buffer(rows) if r.nbytes >= min_bytes
                and (device is None or _device_match(r.device, device))]
        table = _rows_to_table(rows)
        groups = _groups(sorted(rows, key=lambda r: -r.nbytes))
        totals = _totals(rows)
        if _boundary.discovery() is None and not any(k.traced for k in _KNOWN.values()):
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
