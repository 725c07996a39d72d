"""Totals a trace is read by, computed once and shared: per op (``key_averages()``), per module, and the cell.

Pure functions of the trace tables (Arrow in, Arrow or plain values out), vectorised: the summary,
the plots, ``t.report(path)`` and users (``t.op_totals(by=...)``) read the same numbers.

* ``op_totals(ops, by)``: one row per group of ATen ops (by op name by default; any ``ops``
  column, or several; shape columns are grouped by their text): calls, CPU time (total, mean, max,
  share of the cell's op time), CUDA time, FLOPs and bytes. Eager's bookkeeping rows (``is_noise``)
  are left out unless asked for. Sorted by CPU time, ties by the key: the same trace gives the
  same rows in the same order.
* ``module_totals(ops)``: one row per module path, children rolled into their parents (total,
  self, forward, backward, ops), with its parent and depth, in display order: top-level modules by
  total time (ties by name), each followed by its children the same way. The outermost module
  called (``<Net>``) is the root: its children are the top level, when the trace called no other
  outermost module (``root_label``: a loss module called beside the model is not its parent).
* ``cell_totals(ops, wall_ns)``: ops, forward/backward/bookkeeping counts, CPU time, bytes, FLOPs.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..io.pages import passing
from .opview import add_exact

__all__ = ["op_totals", "module_totals", "root_label", "cell_totals", "OP_TOTALS", "MODULE_TOTALS", "row_batches", "count_true",
           "count_equal", "column_sum"]

#: the most rows a batched pass reads at once (a table of one big chunk is read in slices of this many)
BATCH_ROWS = 1 << 18

_i64, _f64, _str = pa.int64(), pa.float64(), pa.string()

#: the numbers of each op group (after its key columns)
OP_TOTALS = pa.schema([("calls", _i64), ("cpu_ns", _i64), ("mean_cpu_ns", _f64), ("max_cpu_ns", _i64),
                       ("share", _f64), ("cuda_ns", _i64), ("flops", _i64), ("bytes_read", _i64),
                       ("bytes_written", _i64)])
MODULE_TOTALS = pa.schema([("module", _str), ("parent", _str), ("depth", _i64), ("total_ns", _i64),
                           ("self_ns", _i64), ("forward_ns", _i64), ("backward_ns", _i64), ("ops", _i64),
                           ("share", _f64)])

_LIST_TYPES = (pa.types.is_list, pa.types.is_large_list)


def _work(ops: pa.Table, include_noise: bool) -> pa.Table:
    if include_noise or ops.num_rows == 0 or "is_noise" not in ops.column_names:
        return ops
    return ops.filter(pc.invert(pc.fill_null(ops.column("is_noise"), False)))


def _key_column(ops: pa.Table, name: str) -> pa.Array:
    """A column usable as a group key: dictionaries decoded, lists as their text (``[2, 3], [3]``)."""
    col = ops.column(name)
    typ = col.type
    if pa.types.is_dictionary(typ):
        return col.cast(typ.value_type)
    if any(f(typ) for f in _LIST_TYPES):
        return pa.array([_text(v) for v in col.to_pylist()], _str)
    return col


def _text(v: Any) -> Optional[str]:
    if v is None:
        return None
    if isinstance(v, list):
        return ", ".join(_text(x) or "None" for x in v) if not v or not isinstance(v[0], list) else \
            ", ".join("[" + (_text(x) or "") + "]" for x in v)
    return str(v)


def op_totals(ops: pa.Table, by: Union[str, Sequence[str]] = "op", *, include_noise: bool = False) -> pa.Table:
    """Totals per group of ops (``key_averages()``): the ``by`` columns, then ``OP_TOTALS``, the
    largest CPU time first (ties by key)."""
    keys = [by] if isinstance(by, str) else list(by)
    if not keys:
        raise ValueError("op_totals: by names no column")
    for k in keys:
        if k not in ops.column_names:
            raise KeyError(f"op_totals: no ops column {k!r}; columns: {', '.join(ops.column_names)}")
    if len(keys) == 1 and pa.types.is_dictionary(ops.schema.field(keys[0]).type):
        return _op_totals_codes(ops, keys[0], include_noise)
    need = list(dict.fromkeys(keys + ["cpu_ns", "cuda_ns", "flops", "bytes_read", "bytes_written"]
                              + (["is_noise"] if "is_noise" in ops.column_names else [])))
    work = _work(ops.select(need), include_noise)   # the columns read, then the rows: no list column copied
    cols = {k: _key_column(work, k) for k in keys}
    nums = {n: pc.fill_null(work.column(n), 0) for n in ("cpu_ns", "flops", "bytes_read", "bytes_written")}
    t = pa.table({**{f"k{i}": cols[k] for i, k in enumerate(keys)}, **nums, "cuda_ns": work.column("cuda_ns")})
    kk = [f"k{i}" for i in range(len(keys))]
    g = t.group_by(kk, use_threads=False).aggregate(
        [([], "count_all"), ("cpu_ns", "sum"), ("cpu_ns", "max"), ("cuda_ns", "sum"),
         ("flops", "sum"), ("bytes_read", "sum"), ("bytes_written", "sum")])
    total = pc.sum(nums["cpu_ns"]).as_py() or 0
    calls = g.column("count_all")
    cpu = pc.fill_null(g.column("cpu_ns_sum"), 0)
    out = {k: g.column(f"k{i}") for i, k in enumerate(keys)}
    out.update({
        "calls": calls.cast(_i64), "cpu_ns": cpu.cast(_i64),
        "mean_cpu_ns": pc.divide(cpu.cast(_f64), pc.max_element_wise(calls, 1).cast(_f64)),
        "max_cpu_ns": pc.fill_null(g.column("cpu_ns_max"), 0).cast(_i64),
        "share": pc.divide(cpu.cast(_f64), float(total or 1)),
        "cuda_ns": g.column("cuda_ns_sum").cast(_i64),   # null: no op of the group has a CUDA time
        "flops": g.column("flops_sum").cast(_i64), "bytes_read": g.column("bytes_read_sum").cast(_i64),
        "bytes_written": g.column("bytes_written_sum").cast(_i64)})
    res = pa.table(out)
    if res.num_rows:
        res = res.sort_by([("cpu_ns", "descending")] + [(k, "ascending") for k in keys])
    return res


_SUMMED = ("cpu_ns", "cuda_ns", "flops", "bytes_read", "bytes_written")


def _op_totals_codes(ops: pa.Table, key: str, include_noise: bool) -> pa.Table:
    """``op_totals`` by one dictionary column: its codes summed with ``np.bincount`` (no hash join, no
    copy of the rows kept). A record batch at a time when the batches share their dictionary (every
    table a trace builds: a memory-mapped table is read a batch at a time); else the whole columns,
    combined into one batch. Bookkeeping rows go to a bin of their own, dropped at the end."""
    noisy = not include_noise and "is_noise" in ops.column_names
    work = ops.select([key, *_SUMMED] + (["is_noise"] if noisy else []))
    batches = [b for b in work.to_batches() if b.num_rows]
    dicts = [b.column(0).dictionary for b in batches]
    if any(not (d is dicts[0] or d.equals(dicts[0])) for d in dicts[1:]):
        batches = [b for b in work.combine_chunks().to_batches() if b.num_rows]   # one dictionary
        dicts = [b.column(0).dictionary for b in batches]
    names = (dicts[0].to_pylist() if dicts else []) + [None]
    n = len(names) + 1                       # the codes, null (``names[-1]``), then bookkeeping rows
    calls = np.zeros(n, np.int64)
    sums = {name: np.zeros(n, np.int64) for name in _SUMMED}
    mx = np.zeros(n, np.int64)
    has_cuda = np.zeros(n, bool)
    for b in batches:
        codes = pc.fill_null(b.column(0).indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
        codes[codes < 0] = len(names) - 1
        if noisy:
            codes[np.asarray(pc.fill_null(b.column("is_noise"), False).to_numpy(zero_copy_only=False), bool)] = n - 1
        calls += np.bincount(codes, minlength=n)
        cuda_valid = np.asarray(pc.is_valid(b.column("cuda_ns")).to_numpy(zero_copy_only=False), bool)
        has_cuda |= np.bincount(codes[cuda_valid], minlength=n) > 0
        for name in _SUMMED:
            if b.column(name).null_count == b.num_rows:
                continue   # a column no op of the batch has (CUDA time on CPU, FLOPs of small ops): adds 0
            v = pc.fill_null(b.column(name), 0).to_numpy(zero_copy_only=False).astype(np.int64)
            add_exact(sums[name], codes, v)
            if name == "cpu_ns":   # the max per code: sorted by code, then one reduceat (np.maximum.at is ~50x slower)
                order = np.argsort(codes, kind="stable")
                sc = codes[order]
                starts = np.flatnonzero(np.concatenate(([True], sc[1:] != sc[:-1])))
                at = sc[starts]
                mx[at] = np.maximum(mx[at], np.maximum.reduceat(v[order], starts))
    keep = calls > 0
    keep[-1] = False                         # bookkeeping rows
    cpu_i = sums["cpu_ns"]
    cpu = cpu_i.astype(np.float64)
    total = float(cpu_i[keep].sum()) or 1.0
    res = pa.table({
        key: pa.array([names[i] for i in np.flatnonzero(keep)], _str),
        "calls": pa.array(calls[keep], _i64), "cpu_ns": pa.array(cpu_i[keep], _i64),
        "mean_cpu_ns": pa.array(cpu[keep] / np.maximum(calls[keep], 1), _f64),
        "max_cpu_ns": pa.array(mx[keep], _i64), "share": pa.array(cpu[keep] / total, _f64),
        "cuda_ns": pa.array(sums["cuda_ns"][keep], _i64, mask=~has_cuda[keep]),
        "flops": pa.array(sums["flops"][keep], _i64),
        "bytes_read": pa.array(sums["bytes_read"][keep], _i64),
        "bytes_written": pa.array(sums["bytes_written"][keep], _i64)})
    return res.sort_by([("cpu_ns", "descending"), (key, "ascending")]) if res.num_rows else res


def root_label(labels: Iterable[str], roots: Optional[Sequence[str]] = None) -> Optional[str]:
    """The path of the outermost module called (``"<Net>"``), whose children's paths are the top-level
    ones (``"fc"``), or None. ``labels``: the module paths seen; ``roots``: the class of each outermost
    module the trace called (``metadata.module_roots``; None for older traces). Only one root can
    hold the top-level paths: with a model and a loss module (``<CrossEntropyLoss>``), the only
    ``<...>`` label is the loss, which the model's paths are not under."""
    tops = [k for k in labels if k.startswith("<") and "." not in k]
    if len(tops) != 1:
        return None
    if roots is not None and list(roots) != [tops[0][1:-1]]:
        return None
    return tops[0]


def module_totals(ops: pa.Table, roots: Optional[Sequence[str]] = None) -> pa.Table:
    """Per module path, children rolled into parents, in display order (``MODULE_TOTALS``); ``roots``:
    ``t.metadata.module_roots`` (see ``root_label``)."""
    if ops.num_rows == 0 or "module" not in ops.column_names:
        return MODULE_TOTALS.empty_table()
    total: dict[str, list[int]] = {}   # path -> [total, forward, backward, ops]
    own: dict[str, int] = {}
    for name, back, ns, n in _module_groups(ops):
        own[name] = own.get(name, 0) + ns
        parts = name.split(".")
        for i in range(len(parts)):
            tot = total.setdefault(".".join(parts[: i + 1]), [0, 0, 0, 0])
            tot[0] += ns
            tot[2 if back else 1] += ns
            tot[3] += n
    if not total:
        return MODULE_TOTALS.empty_table()
    root = root_label(total, roots)   # the outermost module called: "<Net>"
    if root is not None:
        total[root] = [sum(v[i] for k, v in total.items() if "." not in k) for i in range(4)]
    children: dict[Optional[str], list[str]] = {}
    for k in total:
        parent = k.rsplit(".", 1)[0] if "." in k else (root if k != root else None)
        children.setdefault(parent, []).append(k)
    grand = sum(own.values()) or 1
    rows: list[tuple[str, Optional[str], int]] = []

    if root is not None:
        rows.append((root, None, -1))   # the whole model: its children are the top level (depth 0)
    # depth first, the costliest child first (a stack, not a recursive closure: no reference cycle)
    stack: list[tuple[str, Optional[str], int]] = []

    def push(parent: Optional[str], depth: int) -> None:
        kids = sorted(children.get(parent, []), key=lambda c: (-total[c][0], c))
        stack.extend((k, parent, depth) for k in reversed(kids))

    push(root, 0)
    while stack:
        k, parent, depth = stack.pop()
        rows.append((k, parent, depth))
        push(k, depth + 1)
    return pa.table({
        "module": pa.array([r[0] for r in rows], _str), "parent": pa.array([r[1] for r in rows], _str),
        "depth": pa.array([r[2] for r in rows], _i64),
        "total_ns": pa.array([total[r[0]][0] for r in rows], _i64),
        "self_ns": pa.array([own.get(r[0], 0) for r in rows], _i64),
        "forward_ns": pa.array([total[r[0]][1] for r in rows], _i64),
        "backward_ns": pa.array([total[r[0]][2] for r in rows], _i64),
        "ops": pa.array([total[r[0]][3] for r in rows], _i64),
        "share": pa.array([total[r[0]][0] / grand for r in rows], _f64)}, schema=MODULE_TOTALS)


def _module_groups(ops: pa.Table) -> list[tuple[str, bool, int, int]]:
    """(module, backward, CPU time, ops) per (module, backward) pair of the rows with a module, a record
    batch at a time: each batch's module and phase codes mapped to ids once per distinct value, the
    CPU times summed per (module id, backward) by ``add_exact`` (no decoded string column)."""
    ids: dict[str, int] = {}
    sums = np.zeros(0, np.int64)
    counts = np.zeros(0, np.int64)
    for b in row_batches(ops, ["module", "phase", "cpu_ns"]):
        mcodes, mnames = _codes(b.column(0))
        lut = np.array([ids.setdefault(str(v), len(ids)) for v in mnames] + [-1], np.int64)
        mod = lut[mcodes]                     # code -1 (null) -> the -1 appended
        pcodes, pnames = _codes(b.column(1))
        back = np.array([v == "backward" for v in pnames] + [False], bool)[pcodes]
        keep = mod >= 0
        key = mod[keep] * 2 + back[keep]
        if len(sums) < 2 * len(ids):
            sums = np.concatenate([sums, np.zeros(2 * len(ids) - len(sums), np.int64)])
            counts = np.concatenate([counts, np.zeros(2 * len(ids) - len(counts), np.int64)])
        counts += np.bincount(key, minlength=len(counts))
        cpu = pc.fill_null(b.column(2), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        add_exact(sums, key, cpu[keep])
    names = list(ids)
    return [(names[k // 2], bool(k % 2), int(sums[k]), int(counts[k])) for k in np.flatnonzero(counts).tolist()]


def _codes(col: Any) -> tuple[np.ndarray, list[Any]]:
    """(per-row code, -1 for null; the distinct values) of one batch's column of any type (a dictionary
    column's own codes; other columns are dictionary-encoded, lists first read as their text)."""
    if any(f(col.type) for f in _LIST_TYPES):
        col = pa.array([_text(v) for v in col.to_pylist()], _str)
    if not pa.types.is_dictionary(col.type):
        col = pc.dictionary_encode(col)
    codes = pc.fill_null(col.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    return codes, col.dictionary.to_pylist()


def row_batches(table: pa.Table, names: Sequence[str], rows: Optional[int] = None) -> Iterator[pa.RecordBatch]:
    """The columns ``names`` of ``table`` a record batch at a time, a batch longer than ``rows``
    (``BATCH_ROWS``) in zero-copy slices: what a batched pass holds at once is one batch's
    temporaries, whatever the table's size or chunking (a memory-mapped table's batches are file pages)."""
    rows = rows or BATCH_ROWS
    slices = (b.slice(lo, rows) for b in table.select(list(names)).to_batches() for lo in range(0, b.num_rows, rows))
    yield from passing(table, slices)   # a mapped table's pages given back slice by slice


def count_true(col: Any) -> int:
    """Rows where a boolean column is true (nulls are not), chunk by chunk."""
    return sum(int(pc.sum(c).as_py() or 0) for c in _chunks(col))


def count_equal(col: Any, value: Any) -> int:
    """Rows of ``col`` equal to ``value``, chunk by chunk; a dictionary chunk compares its distinct
    values once and counts its codes (no decoded column)."""
    n = 0
    for c in _chunks(col):
        if pa.types.is_dictionary(c.type):
            hit = [i for i, v in enumerate(c.dictionary.to_pylist()) if v == value]
            if hit:
                n += int(pc.sum(pc.is_in(c.indices, value_set=pa.array(hit, c.indices.type))).as_py() or 0)
        else:
            n += int(pc.sum(pc.equal(c, value)).as_py() or 0)
    return n


def column_sum(col: Any) -> Optional[int]:
    """``pc.sum(col).as_py()`` chunk by chunk: None when every row is null (or there is none)."""
    parts = [v for v in (pc.sum(c).as_py() for c in _chunks(col)) if v is not None]
    return sum(parts) if parts else None


def _chunks(col: Any) -> list[Any]:
    return list(col.chunks) if isinstance(col, pa.ChunkedArray) else [col]


def cell_totals(ops: pa.Table, wall_ns: Optional[int] = None) -> dict[str, Any]:
    """The cell in numbers: ops (forward, backward, bookkeeping), CPU time in ops, the wall, bytes, FLOPs
    (column by column, chunk by chunk: nothing the size of a column is made)."""
    n = ops.num_rows
    if n == 0:
        return {"ops": 0, "forward": 0, "backward": 0, "noise": 0, "cpu_ns": 0, "wall_ns": wall_ns,
                "bytes_read": 0, "bytes_written": 0, "flops": 0}
    bwd = count_equal(ops.column("phase"), "backward")
    return {"ops": n, "forward": n - bwd, "backward": bwd, "noise": count_true(ops.column("is_noise")),
            "cpu_ns": int(column_sum(ops.column("cpu_ns")) or 0), "wall_ns": wall_ns,
            "bytes_read": int(column_sum(ops.column("bytes_read")) or 0),
            "bytes_written": int(column_sum(ops.column("bytes_written")) or 0),
            "flops": int(column_sum(ops.column("flops")) or 0)}
