"""Decode a trace's buffers (the recorder's interned columns) into the Arrow tables of ``schema``.

``decode_tables(rec, ...)`` takes the buffers and what the options say about them, never the
session. Everything the hot path left for later is derived here, vectorised: op names and
tags, shapes/strides/dtypes/formats per row (gathers over the interned meta tuples), bytes read
and written, source lines (from the enclosing call, or for backward ops from the forward op that
created their autograd node), module of backward ops (likewise), ``fwd_seq``, ``hidden_copy``.
Spilled traces have their ops, calls and tensors decoded chunk by chunk into memory-mapped Arrow
IPC files (``spilled.py``), so decoding never needs a whole table in RAM; ``decode_ops_from``
decodes spilled rows while the trace runs.
"""
from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from typing import Any, Optional, Union

import numpy as np
import pyarrow as pa

from .. import schema as S
from .._common import COPYING_OPS
from ..errors import SpillError
from ..schema import dense_array, nullable_array
from .columns import (
    _PHASES,
    Nulls,
    OpIdsAt,
    _call_ranges,
    _dict,
    _Links,
    _list,
    _list_columns,
    _ListDict,
    _memo,
    _op_dicts,
    _shape_rows,
    _storage_lists,
    _tuple_dicts,
)
from .opfacts import FLOP_AT_BUILD, matmul_flops
from .recorder import F_BACKWARD, F_INPLACE, F_OUT_KW, F_VIEW, Recorder, SparseInts
from .spilled import SharedNulls, SpillFiles, _ranges, call_facts, null_column, null_ops, release_memory

#: torch-level calls a user expects to be free (views / no-ops); a copy under them is hidden
EXPECT_FREE_CALLS = frozenset({
    "reshape", "flatten", "contiguous", "view_as", "reshape_as", "to", "type_as", "matmul", "linear", "einsum",
    "unflatten", "squeeze", "unsqueeze", "transpose", "permute", "expand", "expand_as", "view", "__matmul__",
    "movedim", "swapaxes", "bmm", "mm", "tensordot", "ravel", "T", "mT",
})

#: the (op, input shapes, dtypes, devices) this process has run under a trace: the hash of each key,
#: added at decode (never on the hot path), so ``ops.first_run`` marks the first execution of each
_SEEN_KEYS: set[int] = set()

#: the columns a probe contributes (recording/probes.py), never decoded from the buffers: the
#: decoded tables are the schema's tables without them, and finishing adds them once
PROBE_COLUMNS: dict[str, tuple[str, ...]] = {
    "ops": ("graph_id",),               # the compiled regions probe
    "calls": ("compiled", "graph_id"),  # the compiled regions probe
    "tensors": ("category",),   # the storages probe
}


def decoded_schema(name: str) -> pa.Schema:
    """The schema of table ``name`` as decoded: the full schema less :data:`PROBE_COLUMNS`."""
    full = S.TABLES[name]
    drop = PROBE_COLUMNS.get(name, ())
    return pa.schema([f for f in full if f.name not in drop], metadata=full.metadata)


DECODED_OPS = decoded_schema("ops")
DECODED_CALLS = decoded_schema("calls")
DECODED_TENSORS = decoded_schema("tensors")
#: column names in schema order (iterating a pyarrow schema wraps every field: ~0.4 µs each)
_OPS_NAMES = tuple(DECODED_OPS.names)
_CALLS_NAMES = tuple(DECODED_CALLS.names)
_TENSORS_NAMES = tuple(DECODED_TENSORS.names)


def empty_decoded(name: str) -> pa.Table:
    """An empty decoded table (no rows, the decoded schema)."""
    return decoded_schema(name).empty_table() if name in PROBE_COLUMNS else S.empty(name)


def _sparse_rows(d: Union[dict[int, Any], SparseInts], start: int, n: int, dtype: Any, width: int = 1
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The entries of a sparse per-op dict (seq -> a value, or a tuple of ``width`` values) that
    fall in the rows ``[start, start + n)``: (row positions, values as a ``(rows, width)`` array)."""
    if isinstance(d, SparseInts):   # one chunk's entries, no scan of the others
        return d.rows_in(start, n, dtype, width)
    seqs = np.fromiter(d, np.int64, len(d))
    sel = (seqs >= start) & (seqs < start + n)
    vals = np.array(list(d.values()), dtype=dtype).reshape(len(d), width)
    return seqs[sel] - start, vals[sel]



class Decoder:
    """Dictionaries and global per-op arrays shared by every chunk's decode of one trace's buffers.

    ``cell``: the notebook cell the trace ran in (a column of every table); ``screen``: the
    non-finite screen that ran (it says which ops it screens), or None; ``links``: the
    backward-to-forward index, kept by the caller across decodes of the same trace."""

    def __init__(self, rec: Recorder, *, cell: Optional[int], screen: Any, links: _Links) -> None:
        self.rec = rec
        self.ops = _op_dicts(rec)
        self.tup = _tuple_dicts(rec)
        aliases = rec.aliases.values
        self.alias_lists = _memo(("aliases", tuple(aliases)), lambda: _ListDict(aliases, pa.int32()), len(aliases))
        self.tags = self.ops["tag_lists"]
        self.alias_fresh = np.array([all(x < 0 for x in a) for a in rec.aliases.values] or [True], dtype=bool)
        self.modules = _dict(rec.modules.values)
        self.nodes = _dict(rec.nodes.values)
        src_vals = rec.sources.values
        self.src_files = _dict([None if v is None else v[0] for v in src_vals])
        self.src_lines = np.array([-1 if v is None or v[1] is None else v[1] for v in src_vals] or [-1], dtype=np.int64)
        self.call_names = func_names = [getattr(f, "__name__", str(f)) for f in rec.call_funcs.values]
        func_free = np.array([name in EXPECT_FREE_CALLS for name in func_names] or [False], dtype=bool)
        # per call: its source (int32: ids of interned locations) and whether its function is
        # expected to be free, read a range of calls at a time (an int64 column is 8 B a call)
        # (still recording, a dataset= spill decoding ops now: the native store hands whole columns of
        # every call so far, while ``n_calls`` is set at the end)
        live = bool(getattr(rec.calls, "live", False))
        src_type = np.int32 if len(src_vals) < 2**31 else np.int64
        ranged = self.call_range = _call_ranges(rec)
        self.call_src, self.call_free = call_facts(rec, ranged, func_free, src_type, live)
        short = self.ops["short"]
        self.copy_op = np.array([s in COPYING_OPS for s in short] or [False], dtype=bool)
        self.to_copy_op = np.array([s == "_to_copy" for s in short] or [False], dtype=bool)
        self.cell = cell
        self.screened = screen is not None
        self.screened_op = np.array([bool(screen.screens(f)) if screen is not None else False
                                     for f in rec.funcs.values] or [False], dtype=bool)
        self._run_keys: dict[tuple[int, int], int] = {}   # (op id, input tuple id) -> process-wide key hash
        self.nulls = Nulls()   # all-null columns shared by every chunk (see columns.Nulls)
        self.links = links
        #: ops columns null on every row of the trace, known before any chunk is decoded: a spilled
        #: ops file leaves them out (8 B a row each)
        self.null_ops = null_ops(rec, cell=cell, screened=self.screened, nodes=self.nodes, modules=self.modules)

    def ops_at(self, seqs: Collection[int]) -> dict[int, int]:
        """The op id of each of the rows ``seqs`` that exists (a warning's op): only the chunks that
        hold one are read, and nothing whole-trace is kept."""
        want = np.unique(np.fromiter((int(q) for q in seqs), dtype=np.int64, count=len(seqs)))
        want = want[want >= 0]
        out: dict[int, int] = {}
        if not len(want):
            return out
        for start, chunk in self.rec.iter_op_chunks(columns=("op",), from_seq=int(want[0]), with_start=True):
            op = chunk["op"]
            lo, hi = np.searchsorted(want, [start, start + len(op)])
            for q in want[lo:hi].tolist():
                out[q] = int(op[q - start])
            if hi == len(want):
                break
        return out

    def decode(self, chunk: dict[str, np.ndarray], start: int) -> pa.RecordBatch:
        rec = self.rec
        n = len(chunk["op"])
        seq = np.arange(start, start + n, dtype=np.int64)
        op = np.asarray(chunk["op"], dtype=np.int64)   # already int64 once unpacked: no copy
        ins = np.asarray(chunk["ins"], dtype=np.int64)
        outs = np.asarray(chunk["outs"], dtype=np.int64)
        alias = np.asarray(chunk["alias"], dtype=np.int64)
        flags = chunk["flags"]
        node = np.asarray(chunk["node"], dtype=np.int64)
        self.links.extend(chunk, start)
        fs, module, call = self.links.resolve(chunk)
        call_null = call < 0
        src_idx = np.zeros(n, dtype=np.int64)
        if len(self.call_src):
            src_idx[~call_null] = self.call_src[call[~call_null]]
        t = self.tup
        cols: dict[str, Any] = {}
        nulls = self.nulls
        cols["seq"] = dense_array(seq)
        cols["cell"] = self._cells(n)
        for k in ("op", "namespace", "overload"):
            cols[k] = self.ops[k].take(op, nulls=nulls)
        cols["tags"] = self.tags.take(op)
        backward = (flags & F_BACKWARD) != 0
        cols["phase"] = pa.DictionaryArray.from_arrays(nulls.dense(backward.astype(np.int32), pa.int32()), _PHASES,
                                                       safe=False)
        cols["autograd_node"] = self.nodes.take(node, nulls=nulls)
        seq_nr = chunk["seq_nr"]
        cols["seq_nr"] = nulls.nullable(seq_nr, seq_nr < 0)
        cols["fwd_seq"] = nulls.nullable(fs, fs < 0)
        cols["call_id"] = nulls.nullable(chunk["call"], chunk["call"] < 0)
        cols["module"] = self.modules.take(module, nulls=nulls)
        cols["source_file"] = self.src_files.take(src_idx, nulls=nulls)
        cols["source_line"] = self._lines(src_idx)
        in_off = _list_columns(t, ins, "in", cols, nulls)
        out_off = _list_columns(t, outs, "out", cols, nulls)
        cols["in_storages"], cols["out_storages"] = _storage_lists(chunk["storages"], in_off, out_off)
        cols["out_alias"] = self.alias_lists.take(alias)
        is_view = (flags & F_VIEW) != 0
        cols["is_view"] = pa.array(is_view)
        cols["inplace"] = pa.array((flags & (F_INPLACE | F_OUT_KW)) != 0)
        cols["hidden_copy"] = pa.array(self._hidden_copy(op, ins, outs, alias, call, n))
        noise = self.ops["is_noise"][op] if n else np.zeros(0, bool)
        cols["is_noise"] = pa.array(noise, pa.bool_())
        flops = self._shape_flops(chunk["flops"], op, ins)
        cols["flops"] = nulls.nullable(flops, flops < 0)
        no_bytes = is_view | noise
        cols["bytes_read"] = nulls.dense(np.where(no_bytes, 0, t["nbytes"][ins]) if n else np.zeros(0, np.int64))
        cols["bytes_written"] = nulls.dense(np.where(no_bytes, 0, t["nbytes"][outs]) if n else np.zeros(0, np.int64))
        cols["start_ns"] = dense_array(chunk["start"])
        cols["cpu_ns"] = dense_array(chunk["dur"])
        cols["cuda_ns"] = self._sparse_int(rec.cuda_ns, start, n)
        cols["error_id"] = self._sparse_int(rec.op_errors, start, n)
        if self.screened:
            screened = self.screened_op[op] & t["has_float"][outs] if n else np.zeros(0, bool)
            nf = np.where(screened, 0, -1)   # null: not screened (views, aliases, empty*, no float output)
            if rec.nonfinite:
                prod = np.zeros(n, dtype=bool)
                prod_null = np.ones(n, dtype=bool)
                rows, vals = _sparse_rows(rec.nonfinite, start, n, np.int64, 2)
                nf[rows] = vals[:, 0]
                prod[rows] = vals[:, 1] != 0
                prod_null[rows] = False
                cols["nonfinite_produced"] = nullable_array(prod, prod_null, pa.bool_())
            else:
                cols["nonfinite_produced"] = self._nulls(n, pa.bool_())
            cols["nonfinite"] = nulls.nullable(nf.astype(np.int64), nf < 0)
        else:
            cols["nonfinite"] = self._nulls(n, pa.int64())
            cols["nonfinite_produced"] = self._nulls(n, pa.bool_())
        if rec.numerics:
            rel = np.full(n, np.nan)
            mx = np.full(n, np.nan)
            rows, vals = _sparse_rows(rec.numerics, start, n, np.float64, 2)
            rel[rows] = vals[:, 0]
            mx[rows] = vals[:, 1]
            cols["num_rel_err"] = nullable_array(rel, np.isnan(rel), pa.float64())
            cols["num_max_abs_err"] = nullable_array(mx, np.isnan(mx), pa.float64())
        else:
            cols["num_rel_err"] = self._nulls(n, pa.float64())
            cols["num_max_abs_err"] = self._nulls(n, pa.float64())
        cols["first_run"] = pa.array(self._first_run(op, ins, noise, start), pa.bool_())
        cols["probe_ns"] = self._sparse_int(rec.probe_ns, start, n)
        self._fingerprints(cols, rec, start, n)
        return pa.RecordBatch.from_arrays([cols[name] for name in _OPS_NAMES], schema=DECODED_OPS)

    def _first_run(self, op: np.ndarray, ins: np.ndarray, noise: np.ndarray, start: int) -> np.ndarray:
        """True on the first row in this process of each (op, input shapes, dtypes, devices): one
        hash per distinct (op id, input tuple id) of the chunk, looked up in ``_SEEN_KEYS``; the keys
        this trace claimed are kept with the seq of their first row (``rec.first_keys``), so decoding
        the same rows again gives the same answer."""
        out = np.zeros(len(op), dtype=bool)
        if not len(op):
            return out
        pair = op * (len(self.rec.tuples.values) + 1) + ins
        # a key's first row starts a run of equal keys: only run starts can be first (a loop of one op
        # is one run), and np.unique sorts those, not every row
        starts = np.flatnonzero(np.concatenate(([True], pair[1:] != pair[:-1])))
        first = starts[np.unique(pair[starts], return_index=True)[1]]
        first.sort()                       # rows in dispatch order: the first of a key wins within the chunk
        funcs, tuples, m = self.rec.funcs.values, self.rec.tuples.values, self.rec.metas
        for i in first.tolist():
            if noise[i]:
                continue
            k = (int(op[i]), int(ins[i]))
            h = self._run_keys.get(k)
            if h is None:
                metas = tuples[k[1]] if 0 <= k[1] < len(tuples) else ()
                h = self._run_keys[k] = hash((str(funcs[k[0]]), tuple((m.shapes[j], m.dtypes[j], m.devices[j])
                                                                       for j in metas)))
            mine = self.rec.first_keys.get(h)
            if mine is not None:
                out[i] = mine == start + i
            elif h not in _SEEN_KEYS:
                _SEEN_KEYS.add(h)
                self.rec.first_keys[h] = start + i
                out[i] = True
        return out

    def _fingerprints(self, cols: dict[str, Any], rec: Recorder, start: int, n: int) -> None:
        """The fp_* columns from ``rec.fingerprints`` (seq -> (hash, nonfinite, sum, abs_sum, max_abs))."""
        fp = rec.fingerprints
        if not fp:
            cols["fp_hash"] = self._nulls(n, pa.uint64())
            for name in ("fp_nonfinite",):
                cols[name] = self._nulls(n, pa.int64())
            for name in ("fp_sum", "fp_abs_sum", "fp_max_abs"):
                cols[name] = self._nulls(n, pa.float64())
            return
        seqs = np.fromiter(fp, np.int64, len(fp))
        sel = (seqs >= start) & (seqs < start + n)
        rows = seqs[sel] - start
        vals = [v for v, keep in zip(fp.values(), sel.tolist()) if keep]
        missing = np.ones(n, dtype=bool)
        missing[rows] = False
        h = np.zeros(n, np.uint64)
        h[rows] = np.array([v[0] for v in vals], dtype=np.uint64)
        cols["fp_hash"] = nullable_array(h, missing, pa.uint64())
        nf = np.zeros(n, np.int64)
        nf[rows] = np.array([v[1] for v in vals], dtype=np.int64)
        cols["fp_nonfinite"] = nullable_array(nf, missing, pa.int64())
        for k, name in ((2, "fp_sum"), (3, "fp_abs_sum"), (4, "fp_max_abs")):
            f = np.zeros(n, np.float64)
            f[rows] = np.array([v[k] for v in vals], dtype=np.float64)
            cols[name] = nullable_array(f, missing, pa.float64())

    def _lines(self, src_idx: np.ndarray) -> pa.Array:
        lines = self.src_lines[src_idx] if len(src_idx) else np.zeros(0, np.int64)
        return self.nulls.nullable(lines, lines < 0)

    def _shape_flops(self, flops: np.ndarray, op: np.ndarray, ins: np.ndarray) -> np.ndarray:
        """Fill the rows the dispatch mode left for later (FLOP_AT_BUILD): matmul FLOPs from input shapes,
        once per distinct (op, input metas) pair."""
        todo = np.nonzero(flops == FLOP_AT_BUILD)[0]
        if not len(todo):
            return flops
        flops = flops.copy()
        m = self.rec.metas
        tv = self.rec.tuples.values
        short = self.ops["short"]
        n_tup = len(tv)
        keys, inverse = np.unique(op[todo] * n_tup + ins[todo], return_inverse=True)
        vals = [matmul_flops(short[k // n_tup], [m.shapes[j] for j in tv[k % n_tup]]) for k in keys.tolist()]
        flops[todo] = np.array(vals, dtype=np.int64)[inverse]
        return flops

    def _cells(self, n: int) -> pa.Array:
        """The ``cell`` column: one value on every row, or null outside a notebook cell."""
        if self.cell is None:
            return self._nulls(n, pa.int64())
        return self.nulls.full(n, self.cell)

    def _nulls(self, n: int, typ: Any) -> pa.Array:
        """An all-null column, one per (length, type) for the whole build (Arrow arrays are
        immutable: every chunk of the same length shares it)."""
        return self.nulls(n, typ)

    def _sparse_int(self, d: Union[dict[int, int], SparseInts], start: int, n: int) -> pa.Array:
        if not d:
            return self._nulls(n, pa.int64())
        rows, v = _sparse_rows(d, start, n, np.int64)
        if len(rows) == n and n and rows[0] == 0 and bool((rows[1:] > rows[:-1]).all()):
            return dense_array(v[:, 0])   # every row has one, in order (probe_ns of a screened loop)
        vals = np.zeros(n, dtype=np.int64)
        mask = np.ones(n, dtype=bool)
        vals[rows] = v[:, 0]
        mask[rows] = False
        return nullable_array(vals, mask)

    def _hidden_copy(self, op: np.ndarray, ins: np.ndarray, outs: np.ndarray, alias: np.ndarray, call: np.ndarray,
                     n: int) -> np.ndarray:
        if n == 0 or not len(self.call_free):
            return np.zeros(n, dtype=bool)
        under_free = np.zeros(n, dtype=bool)
        ok = call >= 0
        under_free[ok] = self.call_free[call[ok]]
        cand: np.ndarray = self.copy_op[op] & under_free & self.alias_fresh[alias]
        # a _to_copy is a cast or a device move unless dtype and device are unchanged
        idx = np.nonzero(cand & self.to_copy_op[op])[0]
        if len(idx):
            m = self.rec.metas
            tv = self.rec.tuples.values
            for i in idx:
                a, b = tv[ins[i]], tv[outs[i]]
                if not a or not b or m.dtypes[a[0]] != m.dtypes[b[0]] or m.devices[a[0]] != m.devices[b[0]]:
                    cand[i] = False
                elif m.formats[a[0]] != m.formats[b[0]] and not m.ambiguous[a[0]] and not m.ambiguous[b[0]]:
                    cand[i] = False   # .to(memory_format=...): the conversion the user asked for
        return cand


def ops_table(ctx: Decoder, spill_dir: Optional[str], files: Optional[SpillFiles] = None
              ) -> tuple[pa.Table, Optional[str]]:
    """The ops table; past ``spill_rows`` decoded chunk by chunk into a memory-mapped Arrow IPC
    file (in ``files``, else a new directory under ``spill_dir``), whose path is returned (the
    Trace owns its directory) with the table; in memory when a spill file failed (a full disk:
    ``rec.spill_failed``, reported at the end of the trace)."""
    rec = ctx.rec
    if files is None and rec.spilled_chunks and rec.spill_failed is None:
        try:
            files = SpillFiles(spill_dir, rec)
        except SpillError as e:
            rec.spill_failure(e, "the decoded ops table was")
    if files is not None:
        # the file holds the columns that are not null on every row (ctx.null_ops: shared null chunks)
        kept = [i for i, name in enumerate(_OPS_NAMES) if name not in ctx.null_ops]
        schema = pa.schema([DECODED_OPS.field(i) for i in kept], metadata=DECODED_OPS.metadata)

        def batches() -> Iterator[pa.RecordBatch]:
            start = 0
            for chunk in rec.iter_op_chunks():
                b = ctx.decode(chunk, start)
                start += b.num_rows
                yield pa.RecordBatch.from_arrays([b.column(i) for i in kept], schema=schema)
                del b
                # no release_memory() here: the next chunk reuses this one's freed temporaries (giving them
                # back to the OS made every chunk fault its pages in again)
        t = files.write("ops", schema, batches, rec.n_spilled + rec.mem_rows)
        lengths = [len(c) for c in t.column(0).chunks]
        path = files.path("ops")
        shared = SharedNulls()
        return pa.Table.from_arrays([t.column(f.name) if f.name not in ctx.null_ops else
                                     null_column(t.num_rows, f.type, lengths, shared) for f in DECODED_OPS],
                                    schema=DECODED_OPS), path if os.path.exists(path) else None
    decoded: list[pa.RecordBatch] = []
    start = 0
    for chunk in rec.iter_op_chunks():
        decoded.append(ctx.decode(chunk, start))
        start += decoded[-1].num_rows
    if not decoded:
        return empty_decoded("ops"), None
    return pa.Table.from_batches(decoded, schema=DECODED_OPS), None


def decode_ops_from(rec: Recorder, first_seq: int, *, cell: Optional[int], screen: Any,
                    links: _Links) -> Iterator[pa.RecordBatch]:
    """Record batches of the ops rows from ``first_seq`` on, decoded now, while the trace may still
    record (``dataset=`` writes spilled rows as parts), in the full ops schema. Rows decoded early
    lack what is only known at the end: ``cuda_ns``, and ``graph_id`` (null: no probe contributed yet)."""
    ctx = Decoder(rec, cell=cell, screen=screen, links=links)
    for start, chunk in rec.iter_op_chunks(from_seq=first_seq, with_start=True):
        ctx.links.extend(chunk, start)   # rows before first_seq, if a decode was skipped
        if start + len(chunk["op"]) > first_seq:
            b = ctx.decode(chunk, start)
            b = b.slice(first_seq - start) if start < first_seq else b
            cols = dict(zip(b.schema.names, b.columns))
            yield pa.RecordBatch.from_arrays(
                [cols[f.name] if f.name in cols else ctx._nulls(b.num_rows, f.type) for f in S.OPS], schema=S.OPS)


def calls_table(ctx: Decoder, files: Optional[SpillFiles] = None) -> pa.Table:
    """The calls table; with ``files`` (the trace spilled) decoded ``chunk_rows`` rows at a time
    into a memory-mapped file."""
    rec = ctx.rec
    n = rec.n_calls
    if n == 0:
        return empty_decoded("calls")
    funcs = rec.call_funcs.values
    names = _dict(ctx.call_names)
    qual = _dict([_qualname(f) for f in funcs])
    autocasts = _dict(rec.autocasts.values)
    nested: dict[int, int] = {}   # call id -> depth, for nested calls only (rare; parents precede children)

    ranged = ctx.call_range

    def batch(lo: int, hi: int) -> pa.RecordBatch:
        a = {k: ranged(k, lo, hi) for k in rec.calls.fields}
        parent = a["parent"]
        depth = np.zeros(hi - lo, dtype=np.int64)
        for i in np.nonzero(parent >= 0)[0].tolist():
            depth[i] = nested[lo + i] = nested.get(int(parent[i]), 0) + 1
        src = a["src"].astype(np.int64)
        nulls = ctx.nulls
        cols = dict(
            call_id=dense_array(np.arange(lo, hi, dtype=np.int64)),
            parent_id=nulls.nullable(parent, parent < 0),
            depth=nulls.dense(depth),
            cell=ctx._cells(hi - lo),
            name=names.take(a["func"], nulls=nulls),
            qualname=qual.take(a["func"], nulls=nulls),
            module=ctx.modules.take(a["module"], nulls=nulls),
            source_file=ctx.src_files.take(src, nulls=nulls),
            source_line=ctx._lines(src),
            start_ns=dense_array(a["start"]),
            dur_ns=dense_array(a["dur"]),
            first_seq=nulls.nullable(a["first_seq"], a["n_ops"] <= 0),
            n_ops=dense_array(a["n_ops"]),
            autocast=autocasts.take(a["autocast"], nulls=nulls),
            error_id=nulls.nullable(a["error"], a["error"] < 0),
        )
        return pa.RecordBatch.from_arrays([cols[name] for name in _CALLS_NAMES], schema=DECODED_CALLS)

    # ``chunk_rows`` rows a batch in memory too: a batch's temporaries are reused by the next one,
    # and no column is one array of every call (numpy asks the kernel for huge pages past 4 MB,
    # which can cost more than the table)
    if files is None:
        return pa.Table.from_batches([batch(lo, hi) for lo, hi in _ranges(n, rec.chunk_rows)], schema=DECODED_CALLS)
    return files.write("calls", DECODED_CALLS, lambda: (batch(lo, hi) for lo, hi in _ranges(n, rec.chunk_rows)), n)


def _qualname(f: Any) -> str:
    q = getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or str(f)
    if q.startswith("TensorBase.") or q.startswith("_TensorBase."):
        return "Tensor." + q.split(".", 1)[1]
    mod: Optional[str] = getattr(f, "__module__", None)
    if mod is None or mod in ( "torch._C._VariableFunctions", "torch._C._nn", "torch._C._linalg", "torch._C._fft", "torch._C._special"):
        mod = {"torch._C._nn": "torch.nn.functional", "torch._C._linalg": "torch.linalg", "torch._C._fft": "torch.fft",
               "torch._C._special": "torch.special"}.get(mod or "", "torch")
    if mod == "torch._tensor":
        mod = "torch"
        if not q.startswith("Tensor."):
            q = "Tensor." + q
    return f"{mod}.{q}"


def tensors_table(ctx: Decoder, files: Optional[SpillFiles] = None) -> pa.Table:
    """The tensors table (a row per storage, in id order) from the storage records (``rec.tensors``),
    ``chunk_rows`` ids at a time, a record batch each (with ``files``: into a memory-mapped file); ``address``: the data
    pointer the engines keyed a storage by (a fake tensor's key is no address: null)."""
    rec, c = ctx.rec, ctx.rec.tensors
    c.seal()   # the python engine's live records
    if (n := len(c)) == 0:
        return empty_decoded("tensors")
    devs, dts = ctx.tup["devices"], ctx.tup["dtypes"]
    op_at = OpIdsAt(rec)
    n_ops = int(op_at.starts[-1])

    def batch(lo: int, hi: int) -> pa.RecordBatch:
        m = hi - lo
        b = c.block(lo, hi)
        meta, alloc, free, call, nbytes, module, ptr = (b[k] for k in (
            "meta", "alloc_seq", "free_seq", "call", "nbytes", "module", "ptr"))
        src_idx = np.zeros(m, dtype=np.int64)
        ok = call >= 0
        if len(ctx.call_src):
            src_idx[ok] = ctx.call_src[call[ok]]
        alloc_op_idx = op_at(np.clip(alloc, 0, max(n_ops - 1, 0))) if n_ops else np.zeros(m, np.int64)
        cols = dict(
            storage_id=dense_array(np.arange(lo, hi, dtype=np.int64)),
            nbytes=dense_array(nbytes),
            device=devs.take(meta), dtype=dts.take(meta), shape=_list(*_shape_rows(ctx.tup["shape"], meta)),
            alloc_seq=nullable_array(alloc, alloc < 0),
            alloc_op=ctx.ops["op"].take(alloc_op_idx, alloc < 0) if n_ops else
            pa.nulls(m, S.TENSORS.field("alloc_op").type),
            free_seq=nullable_array(free, free < 0),
            cell=ctx._cells(m),
            module=ctx.modules.take(module),
            source_file=ctx.src_files.take(src_idx),
            source_line=ctx._lines(src_idx),
            address=nullable_array(ptr, ptr <= 0),
        )
        return pa.RecordBatch.from_arrays([cols[name] for name in _TENSORS_NAMES], schema=DECODED_TENSORS)

    if files is None:   # a batch per chunk_rows ids as well: no whole-trace temporaries (huge pages)
        return pa.Table.from_batches([batch(lo, hi) for lo, hi in _ranges(n, rec.chunk_rows)], schema=DECODED_TENSORS)
    return files.write("tensors", DECODED_TENSORS, lambda: (batch(lo, hi) for lo, hi in _ranges(n, rec.chunk_rows)), n)


def errors_table(ctx: Decoder) -> pa.Table:
    rows = ctx.rec.errors
    if not rows:
        return S.empty("errors")
    names = ctx.ops["names"]
    folded: list[dict[str, Any]] = []
    index: dict[tuple[Any, ...], int] = {}
    ops = ctx.ops_at([r["seq"] for r in rows if r.get("op") is None and r.get("seq") is not None and r["kind"] == "warning"])
    for r in rows:
        r = dict(r)
        if r.get("op") is None and r["kind"] == "warning" and r.get("seq") in ops:
            r["op"] = names[ops[r["seq"]]]
        if r["kind"] == "warning":
            key = (r.get("seq"), r.get("message"), r.get("cpp_file"), r.get("cpp_line"))
            if key in index:
                folded[index[key]]["count"] += 1
                continue
            index[key] = len(folded)
        folded.append(r)
    for r in folded:
        r.setdefault("count", 1)
    # error ids are positions in the recorded list; keep them stable for ops/calls links
    return pa.Table.from_pylist(folded, schema=S.ERRORS)




def decode_tables(rec: Recorder, *, cell: Optional[int], screen: Any, links: _Links,
                  spill_dir: Optional[str]) -> tuple[dict[str, pa.Table], Optional[SpillFiles]]:
    """The ``ops``, ``calls``, ``tensors`` and ``errors`` tables of a finished trace's buffers as
    decoded (without :data:`PROBE_COLUMNS`), and when the ops were spilled the directory their
    memory-mapped files are in (else None): then ``ops``, ``calls`` and ``tensors`` were decoded
    chunk by chunk into it and read back memory-mapped."""
    rec.end_chunk()
    ctx = Decoder(rec, cell=cell, screen=screen, links=links)
    files: Optional[SpillFiles] = None
    if rec.spilled_chunks and rec.spill_failed is None:   # after a failed spill file nothing more is written
        try:
            files = SpillFiles(spill_dir, rec)
        except SpillError as e:
            rec.spill_failure(e, "the decoded tables were")
    tables = {"calls": calls_table(ctx, files)}
    rec.calls.close_reads()   # the calls are read (the Decoder's sources and functions, then the table)
    release = getattr(rec.calls, "release", None)
    if files is not None and release is not None:
        release()   # the rows the native engine handed over are in the file now (the ops decode
        release_memory()   # reads ctx.call_src / call_free, made from them when the Decoder was)
    tables["ops"] = ops_table(ctx, spill_dir, files)[0]
    if files is not None:
        release_memory()
    tables["tensors"] = tensors_table(ctx, files)
    tables["errors"] = errors_table(ctx)
    return {k: tables[k] for k in ("ops", "calls", "tensors", "errors")}, files
