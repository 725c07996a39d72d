"""Packed int64 columns and row buffers: what the recorder keeps of a long trace between spills.

``pack``/``unpack``: a frozen column as (base, narrowest unsigned array) and back. ``RowBuffer``: rows
of int64 fields interleaved in one ``array('q')``. ``CallStore``: the calls rows, a live tail and
packed chunks, spilled as ``calls-*.npz`` files with the op chunks and read back a field of a range
of calls at a time (``spilled_field`` keeps the last few chunks read mapped). ``recorder.py``
re-exports them.
"""
from __future__ import annotations

import os
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .spill import read_npz, spill_file

__all__ = ["Packed", "pack", "unpack", "unpack_all", "RowBuffer", "CallStore", "OPEN_CHUNKS"]

#: a frozen column: (base, narrow array) from ``pack``; ``unpack`` widens it back to int64
Packed = tuple[int, np.ndarray]


def pack(a: np.ndarray) -> Packed:
    """(base, narrow array): the column minus its minimum, in the smallest int type that holds it.

    Frozen chunks are most of a long trace's memory; ids, flags, times within a chunk
    and durations mostly fit in 1-4 bytes, so this is what keeps a row near 30 bytes.
    """
    if len(a) == 0:
        return 0, a.astype(np.int8)
    lo = int(a.min())
    span = int(a.max()) - lo
    for dt in (np.uint8, np.uint16, np.uint32):
        if span <= np.iinfo(dt).max:
            return lo, (a - lo).astype(dt)
    return 0, a


def unpack(packed: Packed) -> np.ndarray:
    base, a = packed
    out = a.astype(np.int64)
    if base:
        out += base
    return out


def unpack_all(parts: Sequence[Packed]) -> np.ndarray:
    """Packed parts of one column, in order, as one int64 array (no int64 copy of each part)."""
    out = np.empty(sum(len(a) for _, a in parts), dtype=np.int64)
    pos = 0
    for base, a in parts:
        part = out[pos:pos + len(a)]
        part[:] = a
        if base:
            part += base
        pos += len(a)
    return out


class RowBuffer:
    """Rows of int64 fields, interleaved in one ``array('q')``."""

    def __init__(self, fields: Sequence[str]) -> None:
        self.fields = fields
        self.width = len(fields)
        self.data = array("q")

    def __len__(self) -> int:
        return len(self.data) // self.width

    def matrix(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.int64).reshape(-1, self.width) if len(self.data) else \
            np.zeros((0, self.width), dtype=np.int64)

    def column(self, name: str) -> np.ndarray:
        return self.matrix()[:, self.fields.index(name)]

    def freeze(self) -> dict[str, np.ndarray]:
        m = self.matrix()
        chunk = {name: m[:, i].copy() for i, name in enumerate(self.fields)}
        self.data = array("q")
        return chunk


#: spilled calls chunks a store keeps open while it is read (``CallStore.spilled_field``): more than a
#: range of calls the decoder reads at once spans (columns.CALL_RANGE over the native engine's blocks)
OPEN_CHUNKS = 8


class CallStore(RowBuffer):
    """Calls rows: the live tail is a RowBuffer; finished rows below every active call are packed.

    A call row is updated when the call returns, so only rows older than the
    oldest call still on the stack may be frozen. ``base`` is the call id of
    the first live row: live index = call_id - base. Frozen chunks spill with the op chunks
    (``spill``: one ``calls-*.npz`` file each in the recorder's spill directory) and are read back
    a column at a time.
    """

    def __init__(self, fields: Sequence[str]) -> None:
        super().__init__(fields)
        self.base = 0
        self.frozen: list[dict[str, Packed]] = []
        self.spilled: list[tuple[str, int]] = []   # (file, rows) of the chunks written out, in order
        #: the spilled chunks being read (``spilled_field``): path -> its arrays, memory-mapped
        self._reading: dict[str, dict[str, np.ndarray]] = {}

    def freeze_below(self, keep_from: int) -> None:
        n = keep_from - self.base
        if n <= 0:
            return
        m = self.matrix()
        self.frozen.append({name: pack(m[:n, i].copy()) for i, name in enumerate(self.fields)})
        rest = m[n:].copy()
        self.data = array("q")
        self.data.frombytes(rest.tobytes())
        self.base = keep_from

    def spill(self, directory: str) -> None:
        """Write the frozen chunks to ``directory`` and drop them from memory."""
        while self.frozen:
            chunk = self.frozen[0]
            name = f"calls-{len(self.spilled):06d}.npz"
            arrays: dict[str, Any] = {k: v for k, (_, v) in chunk.items()}
            arrays["__bases__"] = np.array([chunk[k][0] for k in self.fields], dtype=np.int64)
            with spill_file(directory, name, _npz_bytes(chunk)) as f:
                np.savez(f, **arrays)   # numeric arrays only: no pickle is written or read
            self.spilled.append((os.path.join(directory, name), len(chunk[self.fields[0]][1])))
            self.frozen.pop(0)

    def spilled_field(self, i: int, name: str) -> Packed:
        """Field ``name`` of spilled chunk ``i`` (``pack``ed), read from its file. The calls are read a
        range of every field at a time, a field over the chunks the range spans: the last
        :data:`OPEN_CHUNKS` chunks read stay mapped (``read_npz``: file pages, no copy), so a chunk's
        file is opened once, not once per field of each range (it was most of a spilled trace's calls
        table); ``close_reads`` lets them go."""
        path = self.spilled[i][0]
        z = self._reading.get(path)
        if z is None:
            if len(self._reading) >= OPEN_CHUNKS:
                del self._reading[next(iter(self._reading))]   # the oldest
            z = self._reading[path] = read_npz(path)
        return int(z["__bases__"][self.fields.index(name)]), z[name]

    def close_reads(self) -> None:
        """Let go of the spilled chunks ``spilled_field`` keeps mapped."""
        self._reading.clear()

    def _frozen_columns(self, name: str) -> Iterator[Packed]:
        """Column ``name`` of every frozen chunk in call order (``pack``ed), spilled ones read back."""
        for i in range(len(self.spilled)):
            yield self.spilled_field(i, name)
        for ch in self.frozen:
            yield ch[name]

    def full_matrix(self) -> np.ndarray:
        if not self.spilled and not self.frozen:
            return self.matrix()
        return np.stack([self.column(name) for name in self.fields], axis=1)

    def column(self, name: str) -> np.ndarray:
        """One field of every row as a contiguous int64 column: each frozen chunk's packed column
        widened straight into place, then the live rows' (column-wise: stacking rows into one
        matrix and slicing strided columns from it costs several times more)."""
        live = self.matrix()[:, self.fields.index(name)]
        packed = list(self._frozen_columns(name))
        col = np.empty(sum(len(a) for _, a in packed) + len(live), dtype=np.int64)
        pos = 0
        for base, a in packed:   # no temporaries
            part = col[pos:pos + len(a)]
            part[:] = a
            if base:
                part += base
            pos += len(a)
        col[pos:] = live
        return col

    def field(self, call_id: int, k: int) -> int:
        i = call_id - self.base
        if i >= 0:
            return self.data[i * self.width + k]
        start = 0   # a frozen row: read its chunk's column only
        counts = [n for _, n in self.spilled] + [len(ch[self.fields[0]][1]) for ch in self.frozen]
        for (base, a), n in zip(self._frozen_columns(self.fields[k]), counts):
            if call_id < start + n:
                return int(a[call_id - start]) + base
            start += n
        raise IndexError(call_id)


def _npz_bytes(chunk: dict[str, Packed]) -> int:
    """About the bytes a frozen chunk's ``.npz`` file takes: its columns, their bases, and ~250
    bytes of zip and ``.npy`` headers per array."""
    return sum(a.nbytes for _, a in chunk.values()) + 8 * len(chunk) + 250 * (len(chunk) + 1)
