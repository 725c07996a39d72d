"""The columns the memory views read, as numpy arrays: integer columns with their nulls filled, string
columns as codes into their values (a piece at a time: no column is combined unless it is one chunk),
devices, categories, the ops that ran in autograd's engine, the ops' descriptive columns.

The lowest of the memory analyses (memory.py, live_sweep.py, memory_batches.py, memory_categories.py
read their columns through it).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from ..io.pages import passing

CATS = S.MEMORY_CATEGORIES
_CAT = {c: i for i, c in enumerate(CATS)}
#: torch-level calls that run autograd's engine: ops they make outside it belong to the backward
BACKWARD_CALLS = frozenset({"torch.Tensor.backward", "Tensor.backward", "torch.autograd.backward",
                            "torch.autograd.grad", "torch.autograd.__init__.backward", "torch.autograd.__init__.grad"})


def _array(col: Any) -> pa.Array:
    """One array of a column (a table's column is chunked; one chunk is taken as is, not copied)."""
    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col


def _filled(arr: pa.Array, fill: int) -> np.ndarray:
    """An integer array as a new int64 array, nulls as ``fill``: read from its buffers, a few numpy
    calls where ``pc.fill_null`` and ``to_numpy`` are heavier (the end of every trace converts a dozen)."""
    n, off = len(arr), arr.offset
    if n == 0:
        return np.zeros(0, np.int64)
    validity, data = arr.buffers()[:2]
    out = np.frombuffer(data, dtype=arr.type.to_pandas_dtype())[off:off + n].astype(np.int64)   # a copy
    if arr.null_count:
        valid = np.unpackbits(np.frombuffer(validity, np.uint8), bitorder="little")[off:off + n]
        out[valid == 0] = fill
    return out


def _int_column(table: pa.Table, name: str, fill: int) -> np.ndarray:
    """An integer column of ``table`` as a new int64 array, nulls as ``fill``."""
    return _filled(_array(table.column(name)), fill)


def _devices(tensors: pa.Table) -> tuple[list[str], np.ndarray]:
    """(device names in first-seen order, per-row device index)."""
    col = pc.fill_null(tensors.column("device"), "unknown").combine_chunks()
    enc = col.dictionary_encode()
    names = enc.dictionary.to_pylist()
    idx = np.asarray(enc.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
    return names, idx


def _codes(col: Any) -> tuple[np.ndarray, list[Optional[str]]]:
    """(per-row index into values, -1 for null; values) of a string or dictionary column."""
    arr = _array(col)
    if not pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_encode()
    return _filled(arr.indices, -1), arr.dictionary.to_pylist()


def _is(col: Any, pred: Callable[[str], bool]) -> np.ndarray:
    codes, values = _codes(col)
    hit = np.array([v is not None and bool(pred(v)) for v in values] + [False], dtype=bool)
    out: np.ndarray = hit[codes]   # code -1 reads the trailing False
    return out


def _batches(table: pa.Table, names: list[str]) -> Iterable[tuple[int, pa.RecordBatch]]:
    """(first row, batch) of ``names`` of ``table``, chunk by chunk (zero-copy slices)."""
    pos = 0
    for b in passing(table, table.select(names).to_batches()):   # a mapped table's pages back per batch
        yield pos, b
        pos += b.num_rows


def backward_calls(calls: Optional[pa.Table]) -> np.ndarray:
    """Sorted ids of the calls that run autograd's engine (``BACKWARD_CALLS``) or are nested in one."""
    if calls is None or calls.num_rows == 0:
        return np.zeros(0, np.int64)
    under: set[int] = set()
    for lo, b in _batches(calls, ["qualname", "parent_id"]):
        flag = _is(b.column(0), lambda v: v in BACKWARD_CALLS)
        under.update((np.nonzero(flag)[0] + lo).tolist())
        parent = _filled(b.column(1), -1)
        for i in np.nonzero((parent >= 0) & ~flag)[0].tolist():   # nested calls are rare; parents precede children
            if int(parent[i]) in under:
                under.add(lo + i)
    return np.array(sorted(under), np.int64)


def _backward_rows(phase: Any, call_id: Any, under: np.ndarray) -> np.ndarray:
    """Per op of one batch: ran in autograd's engine, or under one of the calls ``under``."""
    bwd = _is(phase, lambda v: v == "backward")
    if len(under):
        bwd |= np.isin(_filled(call_id, -1), under)
    return bwd


def _category_codes(tensors: pa.Table) -> np.ndarray:
    """Index into CATS per row (``other`` where null: a trace of an older schema)."""
    if "category" not in tensors.column_names:
        return np.full(tensors.num_rows, _CAT["other"], np.int64)
    codes, values = _codes(tensors.column("category"))
    lut = np.array([_CAT.get(v or "other", _CAT["other"]) for v in values] + [_CAT["other"]], dtype=np.int64)
    out: np.ndarray = lut[codes]
    return out


#: the ops' descriptive columns a memory view shows for its rows (``_op_columns``)
OP_COLUMNS = ("op", "phase", "module", "source_file", "source_line")


def _op_columns(ops: pa.Table, n: int, rows: np.ndarray) -> dict[str, Any]:
    """The op's columns of each timeline row (``rows``: its seq); read in place, not gathered, when the
    rows are every op once (one device), else taken chunk by chunk (``take_plain``), all columns at once."""
    sub = ops.select(list(OP_COLUMNS))
    got = S.plain_strings(sub) if len(rows) == n else take_plain(sub, rows)
    return {name: got.column(name) if len(rows) == n else got.column(name).chunk(0) for name in OP_COLUMNS}


def take_plain(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """``table.take(rows)`` with its strings decoded (``S.plain_strings``), one chunk a column, each record
    batch giving its own rows: Arrow's take over a chunked column combines the chunks first (a
    memory-mapped column copied into anonymous memory, its dictionaries unified, for a handful of rows).
    Every column is taken and decoded together: a few Arrow calls per batch the rows are in, whatever
    the number of columns (a small trace is one batch: one take, one cast)."""
    rows = np.asarray(rows, np.int64)
    batches = table.to_batches()
    if len(batches) <= 1:
        got = table.take(pa.array(rows)) if batches else table.slice(0, 0)
        return S.plain_strings(got).combine_chunks()
    offsets = np.cumsum([0] + [b.num_rows for b in batches])
    which = np.searchsorted(offsets, rows, side="right") - 1
    parts, order = [], []
    for k in np.unique(which).tolist():
        sel = np.nonzero(which == k)[0]
        parts.append(pa.Table.from_batches([batches[k].take(pa.array(rows[sel] - offsets[k]))]))
        order.append(sel)
    if not parts:
        return S.plain_strings(table.slice(0, 0)).combine_chunks()
    inverse = np.empty(len(rows), np.int64)
    inverse[np.concatenate(order)] = np.arange(len(rows))
    return S.plain_strings(pa.concat_tables(parts)).combine_chunks().take(pa.array(inverse))


def live_mask(alloc: np.ndarray, free: np.ndarray, s: Union[int, np.ndarray]) -> np.ndarray:
    """The storages live while op ``s`` runs (``alloc``/``free``: ``alloc_seq``/``free_seq``, nulls as -1;
    ``s``: one op, or one per storage). The one rule every live-bytes view here follows."""
    return (alloc <= s) & ((free < 0) | (free >= s))
