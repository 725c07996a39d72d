"""Arrow helpers every builder and reader shares: nullable arrays, empty and conformed tables, dictionaries."""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from .tables import TABLES

_EMPTY: dict[str, pa.Table] = {}


_BOOL = pa.bool_()
_NP_OF = {pa.int64(): np.int64, pa.int32(): np.int32, pa.float64(): np.float64, pa.bool_(): np.bool_,
          pa.uint64(): np.uint64}


def dense_array(values: np.ndarray, typ: Any = pa.int64()) -> pa.Array:
    """``values`` (numpy) as an Arrow array of the numeric ``typ`` (not bool) with no nulls, over the
    same buffer: what ``pa.array`` makes, without its checks for pandas types (~0.5 µs a call)."""
    values = np.ascontiguousarray(values, dtype=_NP_OF[typ])
    return pa.Array.from_buffers(typ, len(values), [None, pa.py_buffer(values)], null_count=0)


def nullable_array(values: np.ndarray, null_mask: np.ndarray, typ: Any = pa.int64()) -> pa.Array:
    """``values`` (numpy) as an Arrow array of ``typ``, null where ``null_mask``: the validity bitmap is
    packed by numpy and the values buffer shared (``pa.array(mask=)`` converts row by row and
    imports pandas on first use)."""
    values = np.ascontiguousarray(values, dtype=_NP_OF[typ])
    nulls = int(np.count_nonzero(null_mask))
    is_bool = typ == _BOOL
    if nulls == 0:
        return pa.array(values, typ) if is_bool else dense_array(values, typ)
    if nulls == len(values):
        return pa.nulls(nulls, typ)
    valid = np.packbits(~null_mask, bitorder="little")
    data = np.packbits(values, bitorder="little") if is_bool else values
    return pa.Array.from_buffers(typ, len(values), [pa.py_buffer(valid), pa.py_buffer(data)], null_count=nulls)


def empty(name: str) -> pa.Table:
    """An empty table with the right schema: honest, never a placeholder row (one per table name:
    Arrow tables are immutable, and making one costs ~80 µs)."""
    t = _EMPTY.get(name)
    if t is None:
        t = _EMPTY[name] = TABLES[name].empty_table()
    return t


def conform(name: str, table: pa.Table) -> pa.Table:
    """Cast/complete ``table`` to the current schema of ``name``.

    Columns missing from an older minor version are filled with nulls; extra
    columns (from a newer minor) are dropped; order follows the schema.
    """
    schema = TABLES[name]
    cols = []
    n = table.num_rows
    for field in schema:
        if field.name in table.column_names:
            col = table.column(field.name)
            if col.type != field.type:
                col = col.cast(field.type)
            cols.append(col)
        else:
            cols.append(pa.nulls(n, field.type))
    return unify_dictionaries(pa.Table.from_arrays(cols, schema=schema))


def _dictionaries(chunk: Any) -> Any:
    if pa.types.is_dictionary(chunk.type):
        return chunk.dictionary
    if pa.types.is_list(chunk.type) and pa.types.is_dictionary(chunk.type.value_type):
        return chunk.values.dictionary
    return None


def unify_dictionaries(table: pa.Table) -> pa.Table:
    """One dictionary per column across the table's chunks (a table read from several files or
    row groups, or concatenated from several traces, may carry one per chunk): Arrow's
    ``group_by`` and hash kernels refuse differing dictionaries. A no-op, without copying,
    when the chunks already share theirs (every table one trace builds)."""
    for col in table.columns:
        if col.num_chunks < 2:
            continue
        first = _dictionaries(col.chunk(0))
        if first is None:
            continue
        for chunk in col.chunks[1:]:
            d = _dictionaries(chunk)
            if d is not first and not d.equals(first):
                return table.unify_dictionaries()
    return table


def plain_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_dictionary(t):
        return t.value_type
    if pa.types.is_list(t):
        inner = plain_type(t.value_type)
        return t if inner is t.value_type else pa.list_(inner)
    return t


def plain_strings(table: pa.Table) -> pa.Table:
    """``table`` with dictionary-encoded columns decoded to their plain values (``string``,
    ``list<string>``): for pandas, where a ``category`` column would sort and group by
    dictionary code, not by value."""
    schema = pa.schema([f.with_type(plain_type(f.type)) for f in table.schema], metadata=table.schema.metadata)
    return table if schema.equals(table.schema) else table.cast(schema)
