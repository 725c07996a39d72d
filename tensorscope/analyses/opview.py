"""Per-row numpy views of a slice of an ops table (op-name codes, noise, seq), a record batch at a time.

The ``op`` column is dictionary-encoded (schema 1.2): a predicate on op names runs once per
distinct name and is broadcast to the rows through the codes, so a pass over a 10k-op trace
costs a few numpy operations, not a string per row. ``views(ops)`` yields one ``OpView`` per
slice of at most ``BATCH_ROWS`` rows (zero-copy slices of a memory-mapped table): a pass over a
long trace holds one slice's arrays at a time, never a per-row array of the whole trace.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Callable, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from ..io.pages import passing


@functools.lru_cache(maxsize=8192)
def short_name(op: str) -> str:
    """``aten.nonzero.default`` -> ``nonzero``."""
    parts = op.split(".")
    return parts[1] if len(parts) > 1 else op


#: rows per slice of a batched pass (``views``): its per-row arrays are a few MB whatever the trace's length
BATCH_ROWS = 65_536


class OpView:
    """``names`` (distinct op names), ``codes`` (per row, -1 for null), ``noise`` and ``seq`` arrays.

    ``warm_only``: ``first_run`` rows count as bookkeeping (``noise``): every work-only mask leaves them
    out, as the timing findings do; ``offset``: the position of the view's first row in its table."""

    def __init__(self, ops: pa.Table, warm_only: bool = False, offset: int = 0) -> None:
        self.ops = ops
        self.offset = offset
        self.n = ops.num_rows
        names: list[str] = []
        where: dict[str, int] = {}
        parts = []
        col = ops.column("op")
        for chunk in col.chunks:
            if not pa.types.is_dictionary(chunk.type):
                chunk = pc.dictionary_encode(chunk)
            local = np.array([where.setdefault(v, len(where)) if v is not None else -1
                              for v in chunk.dictionary.to_pylist()] + [-1], dtype=np.int32)
            idx = pc.fill_null(chunk.indices, -1).to_numpy(zero_copy_only=False)
            parts.append(local[idx])
        names = list(where)
        self.names = names
        self.codes: np.ndarray = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        self.noise: np.ndarray = (pc.fill_null(ops.column("is_noise"), False).to_numpy(zero_copy_only=False)
                                  if self.n else np.zeros(0, bool))
        self.seq: np.ndarray = ops.column("seq").to_numpy(zero_copy_only=False) if self.n else np.zeros(0, np.int64)
        if warm_only and self.n:
            self.noise = self.noise | first_run(ops)

    def mask(self, pred: Callable[[str], bool], work_only: bool = True) -> np.ndarray:
        """Rows whose op name satisfies ``pred`` (``work_only``: and that are not bookkeeping)."""
        if self.n == 0:
            return np.zeros(0, bool)
        want = np.array([bool(pred(n)) for n in self.names] + [False], dtype=bool)
        m: np.ndarray = want[self.codes]
        if work_only:
            m &= ~self.noise
        return m

    def short_in(self, names: Any, work_only: bool = True) -> np.ndarray:
        return self.mask(lambda n: short_name(n) in names, work_only)

    def rows(self, mask: np.ndarray, cols: Sequence[str]) -> list[dict[str, Any]]:
        """The rows under ``mask`` as dicts of plain values (only for small selections)."""
        if not mask.any():
            return []
        idx = pa.array(np.flatnonzero(mask))
        out: list[dict[str, Any]] = S.plain_strings(self.ops.select(list(cols)).take(idx)).to_pylist()
        return out


def views(ops: pa.Table, rows: Optional[int] = None, warm_only: bool = False) -> Iterator[OpView]:
    """One ``OpView`` per zero-copy slice of at most ``rows`` (``BATCH_ROWS``) rows of ``ops``, in order."""
    step = max(int(rows or BATCH_ROWS), 1)
    for off, part in passing(ops, ((off, ops.slice(off, step)) for off in range(0, ops.num_rows, step))):
        yield OpView(part, warm_only, off)   # a mapped table's pages given back slice by slice


def window_views(win: Mapping[str, Any], warm_only: bool = False) -> Sequence[OpView] | Iterator[OpView]:
    """``views`` of an advised window's ops (``win["ops"]``, ``win.get("batch_rows")``). A window that is
    one slice (a small trace) keeps its view in the window (``_views`` in the advisor's own copy of the
    window, a mutable dict): the findings read it several times, and each ``OpView`` decodes the op names
    and reads three columns. A bigger window is read a slice at a time each time, as ``views``: nothing
    per row is kept (a view holds 13 B a row)."""
    ops, rows = win["ops"], win.get("batch_rows")
    if ops.num_rows > max(int(rows or BATCH_ROWS), 1) or not isinstance(win, MutableMapping):
        return views(ops, rows, warm_only)
    cache = win.setdefault("_views", {})
    got: Optional[list[OpView]] = cache.get(warm_only)
    if got is None:
        got = cache[warm_only] = list(views(ops, rows, warm_only))
    return got


def first_run(ops: Any) -> np.ndarray:
    """Per row, whether it is a ``first_run`` row (False where the column is missing or null)."""
    if "first_run" not in ops.column_names:
        return np.zeros(ops.num_rows, dtype=bool)
    out: np.ndarray = np.asarray(pc.fill_null(ops.column("first_run"), False).to_numpy(zero_copy_only=False), bool)
    return out


def string_mask(col: Any, pred: Callable[[str], bool]) -> np.ndarray:
    """Rows of a (dictionary-encoded or plain) string column whose value satisfies ``pred``; null is False."""
    parts = []
    for chunk in (col.chunks if isinstance(col, pa.ChunkedArray) else [col]):
        if not pa.types.is_dictionary(chunk.type):
            chunk = pc.dictionary_encode(chunk)
        want = np.array([v is not None and bool(pred(v)) for v in chunk.dictionary.to_pylist()] + [False], dtype=bool)
        parts.append(want[pc.fill_null(chunk.indices, -1).to_numpy(zero_copy_only=False)])
    return np.concatenate(parts) if parts else np.zeros(0, bool)


def first_of(col: Any, raw: bool = False) -> pa.Array:
    """The first element of each row of a list column (null for an empty or null list), as strings
    (``raw``: in the values' own type, a dictionary for dictionary-encoded lists)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if len(arr) == 0:
        return pa.array([], pa.string())
    offsets = arr.offsets.to_numpy(zero_copy_only=False)
    lens = np.diff(offsets)
    values = arr.values
    if len(values) == 0:
        return pa.nulls(len(arr), pa.string())
    starts = offsets[:-1].astype(np.int64)
    empty = lens <= 0
    if arr.null_count:
        empty |= ~np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    if empty.any():
        idx = pa.array(np.where(empty, 0, np.minimum(starts, len(values) - 1)), mask=empty)
    else:
        idx = pa.array(starts)
    out = pc.take(values, idx)
    return out if raw else out.cast(pa.string())


def codes_of(arr: Any) -> tuple[np.ndarray, list[Any]]:
    """(per-row code, -1 for null; the distinct values) of a string or dictionary column."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if not pa.types.is_dictionary(arr.type):
        arr = pc.dictionary_encode(arr)
    codes = pc.fill_null(arr.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    return codes, arr.dictionary.to_pylist()


def add_exact(acc: np.ndarray, codes: np.ndarray, v: np.ndarray) -> None:
    """``acc[codes] += v`` as exact int64 sums: ``np.bincount``'s float64 sums where no partial sum can
    pass 2**53 (exact then), else ``np.add.at`` (~10x slower; FLOPs can pass 2**53)."""
    if not len(v):
        return
    if int(np.abs(v).max()) * len(v) < 1 << 53:
        acc += np.bincount(codes, weights=v.astype(np.float64), minlength=len(acc)).astype(np.int64)
    else:
        np.add.at(acc, codes, v)


def take_table_rows(table: pa.Table, rows: Union[Sequence[int], np.ndarray]) -> pa.Table:
    """``table.take(rows)`` record batch by record batch: Arrow's take over a chunked column
    concatenates the whole column first (a memory-mapped table's column copied into anonymous
    memory for a handful of rows: ~57 MB of a 1 M-op ops table); here each batch gives its own
    rows, and only the few rows taken are put in the order asked."""
    idx = np.asarray(rows, dtype=np.int64)
    batches = table.to_batches()
    if len(batches) <= 1 or not len(idx):
        return table.take(pa.array(idx, pa.int64()))
    offsets = np.cumsum([0] + [b.num_rows for b in batches])
    if idx.min() < 0 or idx.max() >= offsets[-1]:
        raise IndexError(f"row index out of bounds for a table of {offsets[-1]} rows")
    which = np.searchsorted(offsets, idx, side="right") - 1
    order = np.argsort(which, kind="stable")   # grouped by batch, each group in the order asked
    parts = [batches[k].take(pa.array(idx[which == k] - offsets[k])) for k in np.unique(which).tolist()]
    inverse = np.empty(len(idx), np.int64)
    inverse[order] = np.arange(len(idx))
    return pa.Table.from_batches(parts, schema=table.schema).take(pa.array(inverse))
