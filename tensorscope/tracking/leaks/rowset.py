"""The row container of a leak report: ``_Row`` (one storage) and ``_RowSet`` (rows in columns).

Everything a report does to its rows once they are built goes through here in C-level passes
over the columns: merging storages over one buffer (``_merge_same_buffer``) and the LEAKS table,
largest first (``_rows_to_table``). Building the rows is ``holders`` (one at a time) and ``bulk``
(many at once); ``rows`` and ``report`` drive them.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import compress, repeat
from typing import Optional

import pyarrow as pa

from ... import schema as S
from .paths import STATE_KINDS, _merge_fixes


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
    def plain(cls, holder, holder_kind, fix, root_label, root_fix, nbytes, data_ptr, device, dtype, shape) -> _Row:
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

    def __init__(self, rows: Iterable[_Row] = ()):
        self.cols: dict[str, list] = {f: [] for f in _FIELDS}
        for r in rows:
            self.add(r)

    def __len__(self) -> int:
        return len(self.cols["nbytes"])

    def add(self, r: _Row) -> None:
        for f, c in self.cols.items():
            c.append(getattr(r, f))

    def add_plain(self, holders: list[str], fixes: list[str], nbytes: list[int], ptrs: list[int], devices: list[str],
                  dtypes: list[Optional[str]], shapes: list[Optional[tuple]], kind: str, root_label: str,
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

    def extend(self, other: _RowSet) -> None:
        for f, c in self.cols.items():
            c.extend(other.cols[f])

    def select(self, keep: Sequence[bool]) -> None:
        """Keep the rows whose ``keep`` is true, in order."""
        for f, c in self.cols.items():
            self.cols[f] = list(compress(c, keep))

    def clear(self) -> None:
        for c in self.cols.values():
            c.clear()


#: holder kind of a small value a name keeps (``loss`` after ``loss.backward()``): not a leak
VALUE_KIND = "value"
#: a value holds one element of at most this many bytes (a complex128 scalar)
VALUE_MAX_BYTES = 16


def _mark_values(rows: _RowSet, growing=None) -> None:
    """A one-element tensor a name binds itself (``global loss``, ``f() local total``), keeping no autograd
    graph (its holder has no ``autograd_graph`` row) and not growing, is a value the program uses, not
    a leak: kind ``value``, ``expected``. ``growing(root, kind)`` says whether a holder grows across
    cells (the whole-notebook report has no per-row growth)."""
    c = rows.cols
    kinds, roots, shapes, nbs, grow, exp, holders = (c["holder_kind"], c["root_label"], c["shape"], c["nbytes"],
                                                     c["growing"], c["expected"], c["holder"])
    graph_roots = {r for r, k in zip(roots, kinds) if k == "autograd_graph"}
    for i in range(len(rows)):
        if kinds[i] not in ("global", "local") or grow[i] or roots[i] in graph_roots:
            continue
        if holders[i].split("; also ", 1)[0] != roots[i]:
            continue   # an element of a container (a list of 10^6 detached losses is a leak): not a named value
        sh = shapes[i]
        if sh is None or (nbs[i] or 0) > VALUE_MAX_BYTES:
            continue
        n = 1
        for d in sh:
            n *= d
        if n <= 1 and not (growing is not None and growing(roots[i], kinds[i])):
            kinds[i] = VALUE_KIND
            exp[i] = True


def _int_array(col: list, dtype=None):
    """A numpy array of an integer column, None read as 0."""
    import numpy as np

    dtype = dtype or np.int64
    if None in col:
        return np.fromiter((v or 0 for v in col), dtype=dtype, count=len(col))
    return np.fromiter(col, dtype=dtype, count=len(col))


#: up to this many rows a table is built from reordered lists (``_rows_to_table``)
_SMALL_TABLE = 1000


def _rows_to_table(rows: _RowSet) -> pa.Table:
    """The LEAKS table, largest first (stable: ties keep discovery order)."""
    import numpy as np

    c = rows.cols
    nb = _int_array(c["nbytes"])
    perm = np.argsort(-nb, kind="stable")
    if len(perm) <= _SMALL_TABLE:
        # a trace's few rows: the lists in table order, then one array each (an Arrow take over every
        # column costs more); 100k rows are faster taken by Arrow than gathered as Python objects
        order = perm.tolist()
        return pa.Table.from_arrays([pa.array(list(map(c[f.name].__getitem__, order)), type=f.type)
                                     for f in S.LEAKS], schema=S.LEAKS)
    cols = [pa.array(c[f.name], type=f.type) for f in S.LEAKS]
    return pa.Table.from_arrays(cols, schema=S.LEAKS).take(pa.array(perm))


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
    by: dict[tuple[str, int, int], int] = {}
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
