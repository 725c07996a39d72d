"""The leak table of a trace: ``leak_table`` (the end of a trace) and the rows of a search.

``leak_table(live)`` turns the storage tracker's live records into the LEAKS table:
one targeted search, rows for what it reached (``_rows_for``: in bulk for plain
containers, ``bulk``, the rest one at a time, ``holders``), the unreached classified
by ``unreached``, storages over one buffer merged, largest first (``rowset``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from ... import schema as S
from . import bulk as _bulk
from . import growth as _growth
from .classify import _GcPaused
from .holders import _fallback_rows, _row_generic
from .known import remember
from .paths import _Describer
from .roots import _get_shell, _user_namespace
from .rowset import _mark_values, _merge_same_buffer, _rows_to_table, _RowSet
from .search import _run_search, _Search
from .unreached import _heap_tensors


def _rows_for(search: _Search, key_meta: dict[int, dict]) -> tuple[_RowSet, set[int]]:
    """Rows for every storage the search reached; returns the reached keys."""
    desc = _Describer(search)
    rows = _RowSet()
    try:
        generic, direct, nested = _bulk._by_parent(search)
        for p, keys in direct:
            if not _bulk._bulk_rows(search, desc, p, keys, key_meta, rows):
                generic.extend(keys)
        for gp, parents, keys, kowner in nested:
            if not _bulk._bulk_nested(search, desc, gp, parents, keys, kowner, key_meta, rows):
                generic.extend(keys)
        for key in generic:
            rows.add(_row_generic(search, desc, key, key_meta))
    finally:
        desc.clear()
    return rows, set(search.found)


def _probe_roots(search: _Search, probe: dict[int, Any]) -> dict[int, set]:
    """id(storage) -> the root labels that reach it, for each probe the search found; the probes are then
    removed from the search (they get no row)."""
    out: dict[int, set] = {}
    if not probe:
        return out
    roots, own, cross, par = search.roots, search.own, search.cross, search.par
    for key in probe:
        nodes = search.found.pop(key, None)
        search.storages.pop(key, None)
        if not nodes:
            continue
        labels = set()
        for j in nodes:
            labels.add(roots[own[j]].label)
            k = j
            while k >= 0:   # other roots that reach the path (a second name for the same list)
                for r in cross.get(k, ()):
                    labels.add(roots[r].label)
                k = par[k]
        out[key] = labels
    return out


def leak_table(live: Sequence[Any], *, shell=None, user_ns=None, frames: bool = True) -> pa.Table:
    """The LEAKS table for ``live`` (the storage tracker's ``LiveStorage`` records), largest first.

    Each storage still alive gets the shortest path from a root that holds it, its kind and a fix.
    Storages no root reaches are classified as ``cycle``, ``hidden_cpp_owner`` or a library global.
    """
    with _GcPaused():
        remember(live)  # find_leaks can then name the op, cell and line of these storages
        return _leak_table(live, shell, user_ns, frames)


def _leak_table(live, shell, user_ns, frames) -> pa.Table:
    if user_ns is None:
        shell = _get_shell(shell)
    ns = _user_namespace(shell, user_ns)
    want: dict[int, Any] = {}
    key_meta: dict[int, dict] = {}
    search = None
    unreached: dict[int, Any] = {}
    tensors: dict[int, list[Any]] = {}
    try:
        for rec in live:
            try:
                s = rec.ref()
            except Exception:
                s = None
            if s is None:
                continue
            try:
                ptr, nb = int(s.data_ptr()), int(s.nbytes())
            except Exception:
                continue
            if ptr == 0:
                continue
            key = id(s)
            want[key] = s
            key_meta[key] = dict(storage_id=rec.storage_id, nbytes=nb, device=rec.device, dtype=rec.dtype,
                                 shape=tuple(rec.shape) if rec.shape is not None else None,
                                 alloc_seq=rec.alloc_seq, alloc_op=rec.alloc_op, cell=rec.cell,
                                 source_file=rec.source_file, source_line=rec.source_line, data_ptr=ptr)
            del s
        if not want:
            _growth.observe(_RowSet())
            return S.empty("leaks")
        # the old storages of growing-candidate holders, searched for with this trace's: is each still
        # held by the holder it was charged to? (found, they are dropped before any row is made)
        probe = {k: s for k, s in _growth.probes().items() if k not in want}
        search = _run_search(shell, ns, {**want, **probe} if probe else want, False, frames=frames)
        held = _probe_roots(search, probe)
        rows, reached = _rows_for(search, key_meta)
        missing = {k for k in want if k not in reached}
        if missing:
            unreached, tensors = _heap_tensors(missing.__contains__, search.idx, search.n_tensors)
        search.clear()
        if missing:
            for k in missing:
                unreached.setdefault(k, want[k])
            for r in _fallback_rows(unreached, tensors, key_meta, {id(want)}):
                rows.add(r)
        _merge_same_buffer(rows)
        by_ptr = {m["data_ptr"]: want[k] for k, m in key_meta.items() if k in want}
        try:
            _growth.observe(rows, by_ptr.get, lambda s: held.get(id(s), set()))
        finally:
            by_ptr.clear()
            held.clear()
            probe.clear()
        _mark_values(rows)
        return _rows_to_table(rows)
    finally:
        # nothing of ours may outlive the call, not even in a traceback's frames
        if search is not None:
            search.clear()
        want.clear()
        unreached.clear()
        tensors.clear()
