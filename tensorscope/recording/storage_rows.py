"""The storage records of a trace (the ``tensors`` table's rows), finished ones spilled with the ops.

A storage's record is final once its storage was freed (its ``free_seq`` is known). Both engines
keep only the records of live storages while recording (the native engine in C++ slots, the
python engine's tracker in a dict) and move each finished record here as a row of
:data:`RECORD_FIELDS` (abi.h ``TensorColumn`` order: the storage id last). ``StorageRows`` holds
them as *parts*: each a set of records sorted by storage id, packed column by column (``pack``);
the parts in memory are written out with the op chunks (``spill``: one ``.npy`` file per column,
read back memory-mapped), so what stays resident grows with the storages alive, not with every
storage the trace made. At the end the still-live records come as one more part.

Every storage id ``0 .. len(self) - 1`` is in exactly one part. ``block(lo, hi)`` gives the rows of
ids ``[lo, hi)`` in id order (a ``searchsorted`` slice of each part), so the tensors decode builds
the table a block of ids at a time; ``values(name, ids)`` reads a few rows (the leak finder's).
"""
from __future__ import annotations

import os
from array import array
from collections.abc import Iterator, Sequence
from typing import Callable, Optional, Union

import numpy as np

from ..native import abi_layout as _abi
from .packed_rows import pack, unpack
from .spill import spill_file

#: a record's values, in the native engine's order (abi.h TensorColumn): the storage id last
RECORD_FIELDS: tuple[str, ...] = _abi.TENSOR_COLUMNS
_W = len(RECORD_FIELDS)
_SID = RECORD_FIELDS.index("sid")
#: the columns a block gives (every field but the id, which is the position)
COLUMNS: tuple[str, ...] = tuple(f for f in RECORD_FIELDS if f != "sid")

#: a packed column: (base, narrow array, possibly memory-mapped); value = base + array
_Col = tuple[int, np.ndarray]


def _bound(col: _Col, v: int) -> int:
    """``searchsorted(base + arr, v)`` (left) without widening the whole array."""
    base, arr = col
    x = v - base
    if x <= 0:
        return 0
    if x > int(np.iinfo(arr.dtype).max):
        return len(arr)
    return int(np.searchsorted(arr, arr.dtype.type(x)))


class _Part:
    """Records sorted by storage id: packed columns in memory, or their ``.npy`` files."""

    __slots__ = ("lo", "hi", "count", "cols", "paths", "bases", "mapped")

    def __init__(self, rows: np.ndarray) -> None:
        self._sorted(rows[:, _SID], lambda k: rows[:, k], len(rows))

    @classmethod
    def merged(cls, parts: Sequence[_Part]) -> _Part:
        """One part of the records of ``parts``, made a column at a time (never an int64 matrix of
        every record: a hand-over's parts merged at a spill cost 8 bytes a record at most)."""
        p = cls.__new__(cls)
        p._sorted(np.concatenate([unpack(q.columns()[_SID]) for q in parts]),
                  lambda k: np.concatenate([unpack(q.columns()[k]) for q in parts]), sum(q.count for q in parts))
        return p

    def _sorted(self, sid: np.ndarray, column: Callable[[int], np.ndarray], count: int) -> None:
        """The packed columns, sorted by id a column at a time (``column(k)``: field k, int64, in
        the order of ``sid``; a reordered copy of the whole matrix doubled a hand-over's peak)."""
        order: Optional[np.ndarray] = None   # records mostly finish in id order: no sort then
        if len(sid) > 1 and not bool((sid[1:] >= sid[:-1]).all()):
            order = np.argsort(sid, kind="stable")
        cols = (column(k) if order is None else column(k)[order] for k in range(_W))
        self.cols: Optional[list[_Col]] = [pack(np.ascontiguousarray(c)) for c in cols]
        sc = self.cols[_SID]
        self.lo, self.hi, self.count = sc[0] + int(sc[1][0]), sc[0] + int(sc[1][-1]), count
        self.paths: list[str] = []
        self.bases: list[int] = []
        self.mapped: Optional[list[_Col]] = None   # the spilled files, opened once

    def columns(self) -> list[_Col]:
        """The packed columns (a spilled part's memory-mapped: file pages, read as touched)."""
        if self.cols is not None:
            return self.cols
        if self.mapped is None:
            self.mapped = [(b, np.load(p, mmap_mode="r", allow_pickle=False)) for b, p in zip(self.bases, self.paths)]
        return self.mapped

    def write(self, directory: str, name: str) -> None:
        assert self.cols is not None
        paths = []
        for field, (_base, arr) in zip(RECORD_FIELDS, self.cols):
            fname = f"{name}-{field}.npy"
            with spill_file(directory, fname, arr.nbytes + 200) as f:
                np.save(f, arr, allow_pickle=False)   # numeric only: no pickle written or read
            paths.append(os.path.join(directory, fname))
        self.bases = [b for b, _ in self.cols]
        self.paths = paths
        self.cols = None


class StorageRows:
    """The trace's storage records as parts sorted by id (see the module docstring)."""

    def __init__(self) -> None:
        self.parts: list[_Part] = []
        #: the python engine's finished records since the last ``freeze``, ``_W`` values each
        self.buffer = array("q")
        self.n_spilled = 0   # records in spilled parts
        #: the python engine's tracker: gives the live records once (``seal``)
        self.live_source: Optional[Callable[[], Sequence[tuple[int, ...]]]] = None

    def __len__(self) -> int:
        return sum(p.count for p in self.parts) + len(self.buffer) // _W

    @property
    def resident_records(self) -> int:
        """Records held in memory (parts not spilled, the buffer)."""
        return sum(p.count for p in self.parts if p.cols is not None) + len(self.buffer) // _W

    def add(self, rows: Union[bytes, np.ndarray]) -> None:
        """Finished records as a ``(k, len(RECORD_FIELDS))`` int64 matrix (or its bytes): one part."""
        a = np.frombuffer(rows, dtype=np.int64) if isinstance(rows, (bytes, bytearray, memoryview)) else rows
        a = np.asarray(a, dtype=np.int64).reshape(-1, _W)
        if len(a):
            self.parts.append(_Part(a))

    def seal(self) -> None:
        """The records of the storages still alive (the python engine's tracker holds them) join as
        the last part, once; the native engine's came with its ``take()``."""
        src, self.live_source = self.live_source, None
        if src is not None:
            live = src()
            self.freeze()
            if live:
                self.add(np.array(live, dtype=np.int64))

    def freeze(self) -> None:
        """The buffered records (python engine) become a part."""
        if len(self.buffer):
            buf, self.buffer = self.buffer, array("q")
            self.add(np.frombuffer(buf, dtype=np.int64).copy())

    def spill(self, directory: str) -> None:
        """The parts in memory, merged into one, written to ``directory`` (one ``.npy`` a column)
        and dropped from memory. A ``SpillError`` leaves them in memory."""
        self.freeze()
        mem = [p for p in self.parts if p.cols is not None]
        if not mem:
            return
        if len(mem) > 1:
            merged = _Part.merged(mem)
            self.parts = [p for p in self.parts if p.cols is None] + [merged]
        else:
            merged = mem[0]
        spilled = sum(1 for p in self.parts if p.cols is None)
        merged.write(directory, f"storages-{spilled:06d}")
        self.n_spilled += merged.count

    def block(self, lo: int, hi: int, names: Sequence[str] = COLUMNS) -> dict[str, np.ndarray]:
        """Columns ``names`` of the records of ids ``[lo, hi)``, in id order, as int64 arrays."""
        self.freeze()
        m = hi - lo
        out = {k: np.empty(m, np.int64) for k in names}
        idx = [RECORD_FIELDS.index(k) for k in names]
        found = 0
        for p in self.parts:
            if p.hi < lo or p.lo >= hi:
                continue
            cols = p.columns()
            a, b = _bound(cols[_SID], lo), _bound(cols[_SID], hi)
            if a == b:
                continue
            base, sids = cols[_SID]
            first = int(sids[a]) + base - lo
            # ids a..b of a part are usually consecutive (storages freed in the order they were
            # made): a slice; else the positions
            pos: Union[slice, np.ndarray] = slice(first, first + b - a)
            if int(sids[b - 1]) - int(sids[a]) != b - a - 1:
                pos = sids[a:b].astype(np.int64) + (base - lo)
            for k, i in zip(names, idx):
                cb, ca = cols[i]
                out[k][pos] = ca[a:b]
                if cb:
                    out[k][pos] += cb
            found += b - a
        if found != m:
            raise RuntimeError(f"storage records {lo}..{hi}: {found} of {m} found")
        return out

    def values(self, name: str, ids: Union[Sequence[int], np.ndarray]) -> np.ndarray:
        """Field ``name`` of the records of storage ``ids`` (any order), as int64."""
        want = np.asarray(ids, dtype=np.int64)
        out = np.zeros(len(want), np.int64)
        if not len(want):
            return out
        i = RECORD_FIELDS.index(name)
        order = np.argsort(want, kind="stable")
        sw = want[order]
        for p in self.parts:
            sel = np.nonzero((sw >= p.lo) & (sw <= p.hi))[0]
            if not len(sel):
                continue
            cols = p.columns()
            base, sids = cols[_SID]   # base: the part's smallest id, so every wanted id - base fits
            key = (sw[sel] - base).astype(sids.dtype)
            k = np.minimum(np.searchsorted(sids, key), len(sids) - 1)
            hit = sids[k] == key
            cb, ca = cols[i]
            out[order[sel[hit]]] = ca[k[hit]].astype(np.int64) + cb
        return out

    def blocks(self, step: int, names: Sequence[str] = COLUMNS) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
        """``(lo, hi, block(lo, hi))`` over every id, ``step`` ids at a time."""
        n = len(self)
        for lo in range(0, n, max(int(step), 1)):
            hi = min(lo + step, n)
            yield lo, hi, self.block(lo, hi, names)


assert RECORD_FIELDS[-1] == "sid" and len(set(RECORD_FIELDS)) == _W, RECORD_FIELDS
