"""Rows and the table: one row per live storage, and ``leak_table`` (the end of a trace).

``leak_table(live)`` turns the storage tracker's live records into the LEAKS table:
one targeted search, rows for what it reached (in bulk for plain containers), the
unreached classified by ``unreached``, storages over one buffer merged, largest first.
"""
from __future__ import annotations

from itertools import chain, compress, groupby, repeat
from operator import attrgetter, itemgetter
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import pyarrow as pa

from ... import schema as S
from ..._common import fmt_bytes
from . import growth as _growth
from .classify import _DEV_STR, _DTYPE_STR, _T, _TENSOR, _dev_str, _GcPaused, _tensor_meta, _types
from .known import _KNOWN, _meta_from_known, remember
from .paths import STATE_KINDS, _Describer, _merge_fixes, _short_repr, _Steps
from .roots import _get_shell, _user_namespace
from .search import _run_search, _Search
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


#: the row fields: the LEAKS columns, then what grouping, merging and growth need
_EXTRA = ("data_ptr", "root_label", "root_fix")
_FIELDS = tuple(f.name for f in S.LEAKS) + _EXTRA
#: LEAKS columns a storage nobody recorded has no value for
_NO_SITE = ("storage_id", "alloc_seq", "alloc_op", "cell", "source_file", "source_line", "growth_bytes_per_cell")


class _RowSet:
    """Rows in columns, one Python list per field (``_FIELDS``).

    A report of 100k storages is built, merged, filtered, grouped and turned into a table
    with C-level passes over these lists (``map``, ``compress``, numpy, Arrow), never 100k
    row objects; the few rows that need the general path rules come in as ``_Row`` s.
    """

    __slots__ = ("cols",)

    def __init__(self, rows: Iterable["_Row"] = ()):
        self.cols: Dict[str, list] = {f: [] for f in _FIELDS}
        for r in rows:
            self.add(r)

    def __len__(self) -> int:
        return len(self.cols["nbytes"])

    def add(self, r: "_Row") -> None:
        for f, c in self.cols.items():
            c.append(getattr(r, f))

    def add_plain(self, holders: List[str], fixes: List[str], nbytes: List[int], ptrs: List[int], devices: List[str],
                  dtypes: List[Optional[str]], shapes: List[Optional[tuple]], kind: str, root_label: str,
                  root_fix: str) -> None:
        """Rows for storages no trace or discovery recorded (no creation site), all of one holder root."""
        c = self.cols
        n = len(holders)
        for f in _NO_SITE:
            c[f].extend(repeat(None, n))
        c["holder"].extend(holders)
        c["fix"].extend(fixes)
        c["nbytes"].extend(nbytes)
        c["data_ptr"].extend(ptrs)
        c["device"].extend(devices)
        c["dtype"].extend(dtypes)
        c["shape"].extend(shapes)
        c["holder_kind"].extend(repeat(kind, n))
        c["root_label"].extend(repeat(root_label, n))
        c["root_fix"].extend(repeat(root_fix, n))
        c["expected"].extend(repeat(kind in STATE_KINDS, n))
        c["growing"].extend(repeat(False, n))

    def extend(self, other: "_RowSet") -> None:
        for f, c in self.cols.items():
            c.extend(other.cols[f])

    def select(self, keep: Sequence[bool]) -> None:
        """Keep the rows whose ``keep`` is true, in order."""
        for f, c in self.cols.items():
            self.cols[f] = list(compress(c, keep))

    def clear(self) -> None:
        for c in self.cols.values():
            c.clear()


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


def _rows_for(search: _Search, key_meta: Dict[int, dict]) -> Tuple[_RowSet, Set[int]]:
    """Rows for every storage the search reached; returns the reached keys."""
    desc = _Describer(search)
    rows = _RowSet()
    try:
        generic, direct, nested = _by_parent(search)
        for p, keys in direct:
            if not _bulk_rows(search, desc, p, keys, key_meta, rows):
                generic.extend(keys)
        for gp, parents, keys, kowner in nested:
            if not _bulk_nested(search, desc, gp, parents, keys, kowner, key_meta, rows):
                generic.extend(keys)
        for key in generic:
            rows.add(_row_generic(search, desc, key, key_meta))
    finally:
        desc.clear()
    return rows, set(search.found)


#: a container with at least this many tensors (or small containers of tensors) gets bulk rows
_BULK_MIN = 16


def _by_parent(search: _Search):
    """``(generic, direct, nested)``: the storages that need a path of their own; ``[(parent node,
    storages)]`` for tensors side by side in one container (a list of 100k tensors); and
    ``[(grandparent node, parent nodes, storages, index of each storage's parent)]`` for tensors in
    many small tuples, lists or dicts of one container (a dataset of (x, y) pairs). Only a storage
    held by one tensor, whose node no other root reaches, is grouped. In C-level passes over
    ``found``; groups in order of first appearance, storages in discovery order."""
    import numpy as np

    found, par, cross, order = search.found, search.par, search.cross, search.order
    keys = list(found)
    if not keys:
        return [], [], []
    nodes = list(found.values())
    firsts = list(map(itemgetter(0), nodes))
    pars = np.fromiter(map(par.__getitem__, firsts), dtype=np.int64, count=len(keys))
    ok = (np.fromiter(map(len, nodes), dtype=np.int64, count=len(keys)) == 1) & (pars >= 0)
    if cross:
        ok &= ~np.fromiter(map(cross.__contains__, firsts), dtype=bool, count=len(keys))
    del nodes, firsts
    generic = list(compress(keys, (~ok).tolist()))
    pos = np.flatnonzero(ok)
    if not len(pos):
        return generic, [], []
    get = keys.__getitem__
    uniq, inv, counts = np.unique(pars[pos], return_inverse=True, return_counts=True)
    many = counts[inv] >= _BULK_MIN
    direct = []
    if many.any():
        dpos = pos[many]
        dpos = dpos[np.argsort(pars[dpos], kind="stable")]
        sp = pars[dpos]
        starts = np.flatnonzero(np.concatenate(([True], sp[1:] != sp[:-1])))
        ends = np.append(starts[1:], len(dpos))
        for _first, p, a, b in sorted(zip(dpos[starts].tolist(), sp[starts].tolist(), starts.tolist(),
                                          ends.tolist())):
            direct.append((p, list(map(get, dpos[a:b].tolist()))))
    few = pos[~many]
    if not len(few):
        return generic, direct, []
    # small containers: by grandparent, when the container is a plain tuple/list/dict no other root reaches
    fp = pars[few]
    cand = np.unique(fp).tolist()
    nestable = np.fromiter(map(_NESTABLE.__contains__, map(type, map(order.__getitem__, cand))), dtype=bool,
                           count=len(cand))
    if cross:
        nestable &= ~np.fromiter(map(cross.__contains__, cand), dtype=bool, count=len(cand))
    gps = np.fromiter(map(par.__getitem__, cand), dtype=np.int64, count=len(cand))
    nestable &= gps >= 0
    cand_np = np.array(cand, dtype=np.int64)
    at = np.searchsorted(cand_np, fp)
    kn = nestable[at]
    generic.extend(map(get, few[~kn].tolist()))
    few, fp, kgp = few[kn], fp[kn], gps[at[kn]]
    nested = []
    if len(few):
        o = np.lexsort((few, fp, kgp))
        few, fp, kgp = few[o], fp[o], kgp[o]
        starts = np.flatnonzero(np.concatenate(([True], kgp[1:] != kgp[:-1])))
        ends = np.append(starts[1:], len(few))
        for a, b in zip(starts.tolist(), ends.tolist()):
            ps_, kowner = np.unique(fp[a:b], return_inverse=True)
            ks = list(map(get, few[a:b].tolist()))
            if len(ps_) < _BULK_MIN:
                generic.extend(ks)
                continue
            nested.append((int(kgp[a]), ps_.tolist(), ks, kowner.tolist()))
    return generic, direct, nested


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


def _plain_top(desc: "_Describer", p: int):
    """The path state of ``p`` when it is a plain container under a global name (``tensors``,
    ``data['train']``): what it holds is named by index and key steps alone. None otherwise."""
    ps = desc.state(p)
    root = ps.root
    if root.group != "global" or ps.flags or ps.marks or ps.moddict is not None or ps.inst or ps.run:
        return None
    return ps


def _child_steps(search: _Search, desc: "_Describer", p: int, objs: List[Any]) -> Optional[List[str]]:
    """The path step (``[3]``, ``['x']``) from node ``p`` to each of ``objs`` (children of ``p``); None
    when an edge is not a plain index or key."""
    o = search.order[p]
    if type(o) is list:
        # the edge labels of a list are its indices (the first, for an item listed twice)
        ids = list(map(id, o))
        where = dict(zip(reversed(ids), range(len(ids) - 1, -1, -1)))
        del ids, o
        at = list(map(where.get, map(id, objs)))
        if None in at:
            return None
        return [f"[{n}]" for n in at]
    del o
    m = desc.lab.cache.get(p)
    if m is None:
        desc.lab.label(search.idx[id(objs[0])])
        m = desc.lab.cache.get(p) or {}
    labs: List[Any] = list(map(m.get, map(id, objs)))
    if None in labs or not {lab[0] for lab in labs} <= {"index", "key"}:
        return None
    return [f"[{lab[1]}]" for lab in labs]


def _tensors_of(search: _Search, keys: List[int]) -> Optional[List[Any]]:
    """The tensor holding each storage (its first node); None unless all are tensors."""
    order, found = search.order, search.found
    ts = list(map(order.__getitem__, map(itemgetter(0), map(found.__getitem__, keys))))
    if any(_types.get(tp) != _TENSOR for tp in set(map(type, ts))):
        return None
    return ts


def _bulk_rows(search: _Search, desc: "_Describer", p: int, keys: List[int], key_meta, rows: _RowSet) -> bool:
    """Many plain tensors directly in one global container (a list of 100k tensors): one description
    of the container, then each column in one C-level pass. False (nothing added) when the path
    needs the general rules."""
    ps = _plain_top(desc, p)
    if ps is None:
        return False
    ts = _tensors_of(search, keys)
    if ts is None:
        return False
    steps = _child_steps(search, desc, p, ts)
    if steps is None:
        return False
    return _emit_plain(search, ps, keys, ts, steps, key_meta, rows)


#: small containers whose items a nested bulk row names by position: ``pairs[3][0]``
_SMALL_SEQ = (tuple, list)
#: small containers a nested bulk row looks through
_NESTABLE = frozenset((tuple, list, dict))


def _bulk_nested(search: _Search, desc: "_Describer", gp: int, parents: List[int], keys: List[int],
                 kowner: List[int], key_meta, rows: _RowSet) -> bool:
    """Tensors in many small plain containers (``parents``) of one global container (a dataset as a
    list of ``(x, y)`` tuples, a list of ``{'x': x, 'y': y}`` dicts): ``data[3][0]``, without a path
    per tensor. ``kowner[k]`` indexes the parent of ``keys[k]``. False (nothing added) when some
    path needs the general rules."""
    ps = _plain_top(desc, gp)
    if ps is None:
        return False
    order = search.order
    pobjs = list(map(order.__getitem__, parents))
    psteps = _child_steps(search, desc, gp, pobjs)
    if psteps is None:
        return False
    ts = _tensors_of(search, keys)
    if ts is None:
        return False
    if all(type(o) in _SMALL_SEQ for o in pobjs):
        # all tuples and lists: each item's position from one flat (container, item) -> index map
        lens = list(map(len, pobjs))
        item_ids = list(map(id, chain.from_iterable(pobjs)))
        pos = list(chain.from_iterable(map(range, lens)))
        where: Dict[Any, int] = dict(zip(reversed(item_ids), reversed(pos)))   # first occurrence
        if len(where) == len(item_ids):   # every item in one place (the usual dataset): by id alone
            del pobjs, item_ids, pos
            at: List[Any] = list(map(where.get, map(id, ts)))
        else:   # an item in several containers: by (container, item)
            owners = list(chain.from_iterable(map(repeat, range(len(pobjs)), lens)))
            where = dict(zip(zip(reversed(owners), reversed(item_ids)), reversed(pos)))
            del pobjs, owners, item_ids, pos
            at = list(map(where.get, zip(kowner, map(id, ts))))
        del where
        if None in at:
            return False
        steps = [f"{psteps[o]}[{n}]" for o, n in zip(kowner, at)]
        del at
        return _emit_plain(search, ps, keys, ts, steps, key_meta, rows)
    if all(type(o) is dict for o in pobjs):
        # all dicts with string keys (records): the same, the step being the key's text
        dkeys = list(chain.from_iterable(map(dict.keys, pobjs)))
        if set(map(type, dkeys)) <= {str}:
            lens = list(map(len, pobjs))
            owners = list(chain.from_iterable(map(repeat, range(len(pobjs)), lens)))
            val_ids = list(map(id, chain.from_iterable(map(dict.values, pobjs))))
            where2: Dict[Any, int] = dict(zip(zip(reversed(owners), reversed(val_ids)), range(len(val_ids) - 1, -1, -1)))
            texts = [f"[{t}]" for t in map(_short_repr, dkeys)]
            del pobjs, owners, val_ids, dkeys
            at2: List[Any] = list(map(where2.get, zip(kowner, map(id, ts))))
            del where2
            if None in at2:
                return False
            steps = [psteps[o] + texts[n] for o, n in zip(kowner, at2)]
            del at2, texts
            return _emit_plain(search, ps, keys, ts, steps, key_meta, rows)
    del pobjs
    steps = []
    k = 0
    for o, grp in groupby(kowner):   # keys come grouped by parent
        n = len(list(grp))
        mine = ts[k:k + n]
        cs = _child_steps(search, desc, parents[o], mine)
        if cs is None:
            return False
        steps.extend([psteps[o] + c for c in cs])
        k += n
    return _emit_plain(search, ps, keys, ts, steps, key_meta, rows)


def _emit_plain(search: _Search, ps, keys: List[int], ts: List[Any], steps: List[str], key_meta,
                rows: _RowSet) -> bool:
    """Rows for tensors named ``ps`` + a step each, all of kind ``global``: columns in C-level passes."""
    root = ps.root
    storage = _T().UntypedStorage
    try:
        ss = list(map(search.storages.__getitem__, keys))
        vbs = list(map(attrgetter("nbytes"), ts))
        sbs = list(map(storage.nbytes, ss))
        ptrs = list(map(storage.data_ptr, ss))
        dts = list(map(attrgetter("dtype"), ts))
        dvs = list(map(attrgetter("device"), ts))
        shapes = list(map(attrgetter("shape"), ts))   # torch.Size: a tuple, as Arrow takes it
    except Exception:
        return False
    base_text, base_expr = ps.text, ps.expr
    rlabel, rfix = root.label, root.fix
    holders = list(map(base_text.__add__, steps))
    if base_expr is None:
        fixes = [rfix] * len(steps)
    else:
        fixes = list(map(("del " + base_expr).__add__, steps))
        import numpy as np

        for n in np.flatnonzero(np.array(vbs, dtype=np.int64) * 2 < np.array(sbs, dtype=np.int64)).tolist():
            expr = base_expr + steps[n]
            fixes[n] = (f"{expr} = {expr}.clone()  (a {fmt_bytes(vbs[n])} view pins the whole "
                        f"{fmt_bytes(sbs[n])} storage; or del {expr})")
    del steps, vbs
    dtype_str, dev_str = _DTYPE_STR, _DEV_STR
    for dt in set(dts):
        if dt not in dtype_str:
            dtype_str[dt] = str(dt).replace("torch.", "")
    for dv in set(dvs):
        if dv not in dev_str:
            dev_str[dv] = str(dv)
    dts = list(map(dtype_str.__getitem__, dts))
    dvs = list(map(dev_str.__getitem__, dvs))
    # storages a trace or discovery recorded carry their creation site: the general row for those
    recorded = sorted({n for d in (key_meta, _KNOWN) if d
                       for n in compress(range(len(keys)), map(d.__contains__, keys))})
    if recorded:
        for n in recorded:
            rows.add(_make_row(search, keys[n], ss[n], key_meta.get(keys[n]), holders[n], "global", fixes[n],
                               rlabel, rfix))
        plain = [True] * len(keys)
        for n in recorded:
            plain[n] = False
        holders, fixes, sbs, ptrs, dvs, dts, shapes = (list(compress(c, plain))
                                                       for c in (holders, fixes, sbs, ptrs, dvs, dts, shapes))
    del ss, ts
    rows.add_plain(holders, fixes, sbs, ptrs, dvs, dts, shapes, "global", rlabel, rfix)
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


def _int_array(col: list, dtype=None):
    """A numpy array of an integer column, None read as 0."""
    import numpy as np

    dtype = dtype or np.int64
    if None in col:
        return np.fromiter((v or 0 for v in col), dtype=dtype, count=len(col))
    return np.fromiter(col, dtype=dtype, count=len(col))


# -- public: the per-trace leak table ------------------------------------------------------------
def _rows_to_table(rows: _RowSet) -> pa.Table:
    """The LEAKS table, largest first (stable: ties keep discovery order)."""
    import numpy as np

    c = rows.cols
    nb = _int_array(c["nbytes"])
    perm = pa.array(np.argsort(-nb, kind="stable"))
    cols = [pa.array(c[f.name], type=f.type) for f in S.LEAKS]
    return pa.Table.from_arrays(cols, schema=S.LEAKS).take(perm)


def _merge_same_buffer(rows: _RowSet) -> None:
    """Two storages over one buffer (two ``from_numpy`` of one array) are one row, bytes once.

    Candidates (a data pointer met twice) are found with numpy; only they are compared in Python."""
    import numpy as np

    c = rows.cols
    n = len(rows)
    if n < 2:
        return
    ptr = _int_array(c["data_ptr"], np.uint64)
    o = np.argsort(ptr, kind="stable")
    sp = ptr[o]
    same = (sp[1:] == sp[:-1]) & (sp[1:] != 0)
    if not same.any():
        return
    cand = np.zeros(n, dtype=bool)
    cand[o[1:][same]] = True
    cand[o[:-1][same]] = True
    by: Dict[Tuple[str, int, int], int] = {}
    keep = [True] * n
    dev, ptrs, nbs, holder, fix = c["device"], c["data_ptr"], c["nbytes"], c["holder"], c["fix"]
    for i in np.flatnonzero(cand).tolist():   # in row order: the first row of a buffer keeps it
        k = (dev[i], ptrs[i], nbs[i])
        first = by.get(k)
        if first is None:
            by[k] = i
        else:
            keep[i] = False
            if holder[i] not in holder[first]:
                holder[first] += f"; also {holder[i]} (same buffer)"
                fix[first] = _merge_fixes([fix[first], fix[i]])
    rows.select(keep)


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
            _growth.observe(_RowSet())
            return S.empty("leaks")
        search = _run_search(shell, ns, want, False, frames=frames)
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
            _growth.observe(rows, by_ptr.get)
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
