"""The tensors table's per-storage columns read a block of rows at a time, and the column readers
the memory categories share: a long trace's tensors table is memory-mapped (one row per storage),
so a pass keeps per-block arrays, never an int64 array of every storage."""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .memory_columns import _array, _filled


def _flat(col: Any) -> tuple[np.ndarray, np.ndarray]:
    """(values, row of each value) of a list<int64> column."""
    arr = _array(col)
    if len(arr) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if arr.null_count == 0 and arr.values.null_count == 0:
        # from the offsets: two compute calls fewer (a null list may own values, so not then)
        offsets = _filled(arr.offsets, 0)
        vals = _filled(arr.values.slice(offsets[0], offsets[-1] - offsets[0]), -1)
        rows = np.repeat(np.arange(len(arr), dtype=np.int64), offsets[1:] - offsets[:-1])
        return vals, rows
    vals = np.asarray(pc.list_flatten(arr).to_numpy(zero_copy_only=False), dtype=np.int64)
    rows = np.asarray(pc.list_parent_indices(arr).to_numpy(zero_copy_only=False), dtype=np.int64)
    return vals, rows


def _ints(col: Any, fill: int) -> np.ndarray:
    """An integer column as one new int64 array, nulls as ``fill``, filled chunk by chunk (a chunked
    column is never combined into one Arrow array first: a memory-mapped table stays mapped)."""
    if not isinstance(col, pa.ChunkedArray):
        return _filled(col, fill)
    out = np.empty(len(col), np.int64)
    pos = 0
    for chunk in col.chunks:
        out[pos:pos + len(chunk)] = _filled(chunk, fill)
        pos += len(chunk)
    return out


def read_column(tensors: pa.Table, name: str, lo: int, hi: int, rows: Optional[np.ndarray] = None,
                moved: Optional[tuple[np.ndarray, np.ndarray]] = None) -> np.ndarray:
    """Integer column ``name`` (nulls -1) of rows ``[lo, hi)``, or of ``rows`` (any order; each chunk
    gives its own: ``take`` over a chunked column would concatenate it first). ``moved``: (sorted
    rows, values) that replace what the table says."""
    col = tensors.column(name)
    if rows is None:
        out = _filled(_array(col.slice(lo, hi - lo)), -1)
    else:
        out, start = np.full(len(rows), -1, np.int64), 0
        for chunk in col.chunks:
            sel = np.nonzero((rows >= start) & (rows < start + len(chunk)))[0]
            if len(sel):
                out[sel] = _filled(chunk.take(pa.array(rows[sel] - start)), -1)
            start += len(chunk)
    if moved is not None and len(moved[0]):
        m, vals = moved
        at = np.arange(lo, hi) if rows is None else rows
        k = np.minimum(np.searchsorted(m, at), len(m) - 1)
        hit = m[k] == at
        out[hit] = vals[k[hit]]
    return out


def rows_where(tensors: pa.Table, name: str, pred: Callable[[np.ndarray], np.ndarray], step: int,
               moved: Optional[tuple[np.ndarray, np.ndarray]] = None) -> np.ndarray:
    """Rows whose ``name`` (nulls -1) satisfies ``pred``, ``step`` rows at a time."""
    n = tensors.num_rows
    found = [np.nonzero(pred(read_column(tensors, name, lo, min(lo + step, n), None, moved)))[0] + lo
             for lo in range(0, n, step)]
    return np.concatenate(found) if found else np.zeros(0, np.int64)
