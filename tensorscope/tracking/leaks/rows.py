"""Rows and the table: one row per live storage, and ``leak_table`` (the end of a trace).

``leak_table(live)`` turns the storage tracker's live records into the LEAKS table:
one targeted search, rows for what it reached (in bulk for plain containers), the
unreached classified by ``unreached``, storages over one buffer merged, largest first.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import pyarrow as pa

from ... import schema as S
from ..._common import fmt_bytes
from . import growth as _growth
from .classify import _DEV_STR, _DTYPE_STR, _GcPaused, _TENSOR, _dev_str, _tensor_meta, _types
from .known import _KNOWN, _meta_from_known, remember
from .paths import STATE_KINDS, _Describer, _Steps, _merge_fixes
from .roots import _get_shell, _user_namespace
from .search import _Search, _run_search
from .unreached import _classify_groups, _heap_tensors


# -- results -------------------------------------------------------------------------------------
class _Row:
    """One storage of a report: plain values only."""

    __slots__ = ("storage_id", "nbytes", "device", "dtype", "shape", "alloc_seq", "alloc_op", "cell", "source_file",
                 "source_line", "holder", "holder_kind", "fix", "root_label", "root_fix", "data_ptr", "expected",
                 "growing", "growth_bytes_per_cell")

    def __init__(self, holder: str, holder_kind: str, fix: str, root_label: str, root_fix: str, meta: dict):
        self.holder = holder
        self.holder_kind = holder_kind
        self.fix = fix
        self.root_label = root_label
        self.root_fix = root_fix
        self.expected = holder_kind in STATE_KINDS
        self.growing = False
        self.growth_bytes_per_cell = None
        g = meta.get
        self.storage_id = g("storage_id")
        self.nbytes = g("nbytes", 0)
        self.device: str = meta["device"]   # every row's meta names its device
        self.dtype = g("dtype")
        self.shape = g("shape")
        self.alloc_seq = g("alloc_seq")
        self.alloc_op = g("alloc_op")
        self.cell = g("cell")
        self.source_file = g("source_file")
        self.source_line = g("source_line")
        self.data_ptr = g("data_ptr", 0)

    @classmethod
    def plain(cls, holder, holder_kind, fix, root_label, root_fix, nbytes, data_ptr, device, dtype, shape) -> "_Row":
        """A row for a storage no trace or discovery recorded: no creation site."""
        r = cls.__new__(cls)
        r.holder, r.holder_kind, r.fix, r.root_label, r.root_fix = holder, holder_kind, fix, root_label, root_fix
        r.expected, r.growing, r.growth_bytes_per_cell = holder_kind in STATE_KINDS, False, None
        r.nbytes, r.data_ptr, r.device, r.dtype, r.shape = nbytes, data_ptr, device, dtype, shape
        r.storage_id = r.alloc_seq = r.alloc_op = r.cell = r.source_file = r.source_line = None
        return r


def _view_of(t, s) -> Optional[Tuple[int, int]]:
    """(view bytes, storage bytes) when a tensor is a small window on a big storage."""
    if _types.get(type(t)) != _TENSOR:
        return None
    try:
        vb = t.nbytes
        sb = s.nbytes()
    except Exception:
        return None
    return (vb, sb) if vb * 2 < sb else None


def _below(search: _Search, n: int, top: int) -> bool:
    while n >= 0:
        if n == top:
            return True
        n = search.par[n]
    return False


def _holders(search: _Search, desc: "_Describer", key: int) -> Tuple[_Steps, str, str]:
    """(main description, holder text, complete fix) for a storage the search reached."""
    nodes = search.found[key]
    j = nodes[0]
    main = desc.describe(j, _view_of(search.order[j], search.storages[key]))
    extra_text: List[str] = []
    fixes = [main.fix]
    cross = search.cross
    if cross:
        # roots that also reach the path at or below the cut: the fix must name them too
        others: Set[int] = set()
        k, pos = j, desc.state(j).pos
        while k >= 0 and pos >= main.cut:
            c = cross.get(k)
            if c:
                others |= c
            k = search.par[k]
            pos -= 1
        for r in sorted(others):
            root = search.roots[r]
            if root.label != main.root_label:
                extra_text.append(root.label)
                fixes.append(root.fix)
    for n in nodes[1:]:
        if _below(search, n, nodes[0]):
            continue  # reached through the main holder (a view's ._base): the main fix covers it
        st = desc.describe(n)
        if st.text not in extra_text and st.text != main.text:
            extra_text.append(st.text)
            fixes.append(st.fix)
    text = main.text
    if extra_text:
        shown = extra_text[:3]
        more = f" (+{len(extra_text) - 3} more)" if len(extra_text) > 3 else ""
        text += "; also " + "; ".join(shown) + more
    return main, text, (_merge_fixes(fixes) if len(fixes) > 1 else main.fix)


def _rows_for(search: _Search, key_meta: Dict[int, dict]) -> Tuple[List["_Row"], Set[int]]:
    """Rows for every storage the search reached; returns the reached keys."""
    desc = _Describer(search)
    rows: List[_Row] = []
    try:
        generic: List[int] = []
        by_parent: Dict[int, List[int]] = {}
        par, cross = search.par, search.cross
        for key, nodes in search.found.items():
            j = nodes[0]
            if len(nodes) == 1 and j not in cross and par[j] >= 0:
                by_parent.setdefault(par[j], []).append(key)
            else:
                generic.append(key)
        for p, keys in by_parent.items():
            if len(keys) < 16 or not _bulk_rows(search, desc, p, keys, key_meta, rows):
                generic.extend(keys)
        for key in generic:
            rows.append(_row_generic(search, desc, key, key_meta))
    finally:
        desc.clear()
    return rows, set(search.found)


def _row_generic(search: _Search, desc: "_Describer", key: int, key_meta: Dict[int, dict]) -> "_Row":
    s = search.storages[key]
    try:
        main, text, fix = _holders(search, desc, key)
        kind, root_label, root_fix = main.kind, main.root_label, main.root_fix
    except Exception as e:  # a path we cannot render must not hide the storage
        text, kind, fix = f"(path unavailable: {type(e).__name__}: {e})", "unknown", ""
        root_label, root_fix = text, ""
    return _make_row(search, key, s, key_meta.get(key), text, kind, fix, root_label, root_fix)


def _make_row(search, key, s, meta, text, kind, fix, root_label, root_fix) -> "_Row":
    if meta is None:
        first = search.order[search.found[key][0]]
        dev, dt, shape = _tensor_meta(first) if _types.get(type(first)) == _TENSOR else (_dev_str(s), None, None)
        k = _KNOWN.get(key)
        if k is not None and k.ref() is s:
            meta = _meta_from_known(k, s, dev, dt, shape)
        else:
            return _Row.plain(text, kind, fix, root_label, root_fix, s.nbytes(), s.data_ptr(), dev, dt, shape)
    row = _Row(text, kind, fix, root_label, root_fix, meta)
    _own_shape(row, search.order[search.found[key][0]])
    return row


def _own_shape(row: "_Row", t) -> None:
    """The storage's own shape: the holding tensor's when it spans the whole storage. The recorded
    shape is the allocating op's output, which can be another view of it (a bias ``.grad`` made
    as ``[1, 256]`` and kept as ``(256,)``)."""
    if _types.get(type(t)) != _TENSOR:
        return
    try:
        if t.nbytes == row.nbytes and t.storage_offset() == 0:
            row.shape = tuple(t.shape)
    except Exception:
        pass


def _bulk_rows(search: _Search, desc: "_Describer", p: int, keys: List[int], key_meta, rows) -> bool:
    """Many plain tensors directly in one global container (a list of 100k tensors): one description
    of the container, then a string per element. False when the path needs the general rules."""
    ps = desc.state(p)
    root = ps.root
    if root.group != "global" or ps.flags or ps.marks or ps.moddict is not None or ps.inst or ps.run:
        return False
    m = desc.lab.cache.get(p)
    if m is None:
        desc.lab.label(search.found[keys[0]][0])
        m = desc.lab.cache.get(p) or {}
    order, storages, found = search.order, search.storages, search.found
    base_text, base_expr = ps.text, ps.expr
    tensor_h = _TENSOR
    types_get = _types.get
    known_get = _KNOWN.get
    plain = _Row.plain
    dtype_str, dev_str = _DTYPE_STR, _DEV_STR
    rlabel, rfix = root.label, root.fix
    out = []
    for key in keys:
        t = order[found[key][0]]
        if types_get(type(t)) != tensor_h:
            return False
        lab = m.get(id(t))
        if lab is None or (lab[0] != "index" and lab[0] != "key"):
            return False
        step = f"[{lab[1]}]"
        s = storages[key]
        expr = base_expr + step if base_expr is not None else None
        try:
            vb, sb = t.nbytes, s.nbytes()
        except Exception:
            return False
        if expr is None:
            fix = rfix
        elif vb * 2 < sb:
            fix = (f"{expr} = {expr}.clone()  (a {fmt_bytes(vb)} view pins the whole {fmt_bytes(sb)} storage; "
                   f"or del {expr})")
        else:
            fix = f"del {expr}"
        meta = key_meta.get(key)
        if meta is None and known_get(key) is None:
            # the common case of a big report: a storage nobody recorded; inline _make_row/_tensor_meta
            try:
                dt, dv = t.dtype, t.device
                ds, dvs = dtype_str.get(dt), dev_str.get(dv)
                if ds is None:
                    ds = dtype_str[dt] = str(dt).replace("torch.", "")
                if dvs is None:
                    dvs = dev_str[dv] = str(dv)
                out.append(plain(base_text + step, "global", fix, rlabel, rfix, sb, s.data_ptr(), dvs, ds,
                                 tuple(t.shape)))
                continue
            except Exception:
                pass
        out.append(_make_row(search, key, s, meta, base_text + step, "global", fix, rlabel, rfix))
    rows.extend(out)
    return True


def _fallback_rows(storages: Dict[int, Any], tensors: Dict[int, List[Any]], key_meta: Dict[int, dict],
                   ours: Set[int]) -> List[_Row]:
    """Rows for storages no root reached; ``storages``/``tensors`` (from ``_heap_tensors``) are consumed."""
    rows: List[_Row] = []
    if not storages:
        return rows
    keys = list(storages)
    metas = []
    groups: List[List[Any]] = []
    for key in keys:
        ts = tensors.pop(key, None) or []
        s = storages[key]
        meta = key_meta.get(key)
        if meta is None:
            dev, dt, shape = _tensor_meta(ts[0]) if ts else (str(s.device), None, None)
            meta = _meta_from_known(_KNOWN.get(key), s, dev, dt, shape)
        metas.append(meta)
        ts.append(s)
        groups.append(ts)
        del ts, s
    storages.clear()
    tensors.clear()
    fbs = _classify_groups(groups, ours | {id(storages), id(tensors), id(keys)})
    for meta, fb in zip(metas, fbs):
        rows.append(_Row(fb.text, fb.kind, fb.fix, fb.text, fb.fix, meta))
    return rows


# -- public: the per-trace leak table ------------------------------------------------------------
def _rows_to_table(rows: List[_Row]) -> pa.Table:
    from operator import attrgetter

    rows = sorted(rows, key=attrgetter("nbytes"), reverse=True)  # stable: ties keep discovery order
    cols = [pa.array(list(map(attrgetter(f.name), rows)), type=f.type) for f in S.LEAKS]
    return pa.Table.from_arrays(cols, schema=S.LEAKS)


def _merge_same_buffer(rows: List[_Row]) -> List[_Row]:
    """Two storages over one buffer (two ``from_numpy`` of one array) are one row, bytes once."""
    by: Dict[Tuple[str, int, int], _Row] = {}
    out: List[_Row] = []
    for r in rows:
        if not r.data_ptr:
            out.append(r)
            continue
        k = (r.device, r.data_ptr, r.nbytes)
        first = by.get(k)
        if first is None:
            by[k] = r
            out.append(r)
        elif r.holder not in first.holder:
            first.holder += f"; also {r.holder} (same buffer)"
            first.fix = _merge_fixes([first.fix, r.fix])
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
    want: Dict[int, Any] = {}
    key_meta: Dict[int, dict] = {}
    search = None
    unreached: Dict[int, Any] = {}
    tensors: Dict[int, List[Any]] = {}
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
            _growth.observe([])
            return S.empty("leaks")
        search = _run_search(shell, ns, want, False, frames=frames)
        rows, reached = _rows_for(search, key_meta)
        missing = {k for k in want if k not in reached}
        if missing:
            unreached, tensors = _heap_tensors(missing.__contains__, search.idx)
        search.clear()
        if missing:
            for k in missing:
                unreached.setdefault(k, want[k])
            rows += _fallback_rows(unreached, tensors, key_meta, {id(want)})
        rows = _merge_same_buffer(rows)
        by_ptr = {m["data_ptr"]: want[k] for k, m in key_meta.items() if k in want}
        try:
            _growth.observe(rows, lambda r: by_ptr.get(r.data_ptr))
        finally:
            by_ptr.clear()
        return _rows_to_table(rows)
    finally:
        # nothing of ours may outlive the call, not even in a traceback's frames
        if search is not None:
            search.clear()
        want.clear()
        unreached.clear()
        tensors.clear()
