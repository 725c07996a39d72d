"""Decode a finished Session's interned columns into the Arrow tables of ``schema.py``.

Everything the hot path left for later is derived here, vectorised: op names
and tags, shapes/strides/dtypes/formats per row (``take`` over the interned
meta tuples), bytes read/written, source lines (from the enclosing call, or for
backward ops from the forward op that created their autograd node), module of
backward ops (likewise), ``fwd_seq``, ``hidden_copy``. String columns are
dictionary-encoded (schema 1.2): each interned table (op names, metas' dtypes,
devices and formats, modules, node names, files) becomes one small Arrow
dictionary once, and a column is its integer codes gathered by numpy, so no
per-row Python object and no string copy is made. List columns are Arrow
offsets + values built by ``gather`` (one C pass when the native engine is
loaded), once per chunk, from the interned segments. Spilled traces are
decoded chunk by chunk into a memory-mapped Arrow IPC file, so building never
needs the whole decoded table in RAM.
"""
from __future__ import annotations

import os
import platform
import tempfile
import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .._common import COPYING_OPS, INEXACT_DTYPES, NOISE_OPS, ipython_shell
from ..native import forced_fallback, loaded_engine
from ..schema import nullable_array
from .recorder import F_BACKWARD, F_INPLACE, F_OUT_KW, F_VIEW, Recorder

if TYPE_CHECKING:
    from .._trace import Trace
    from .session import Session

#: torch-level calls a user expects to be free (views / no-ops); a copy under them is hidden
EXPECT_FREE_CALLS = frozenset({
    "reshape", "flatten", "contiguous", "view_as", "reshape_as", "to", "type_as", "matmul", "linear", "einsum",
    "unflatten", "squeeze", "unsqueeze", "transpose", "permute", "expand", "expand_as", "view", "__matmul__",
    "movedim", "swapaxes", "bmm", "mm", "tensordot", "ravel", "T", "mT",
})


class _Dict:
    """Interned strings as an Arrow dictionary: ``codes[id]`` is the value's index in
    ``dictionary`` (-1 for None), so a column is a numpy gather of codes, never a string copy.

    The dictionary holds each distinct string once (ids of different interned values may
    share one: every ``aten.*`` op has namespace ``aten``); None is a null index, never a
    dictionary entry, so every reader sees plain nullable strings.
    """

    __slots__ = ("dictionary", "codes", "values")

    def __init__(self, values: Sequence[Optional[str]]) -> None:
        index: Dict[str, int] = {}
        codes = np.empty(len(values), dtype=np.int32)
        for i, v in enumerate(values):
            codes[i] = -1 if v is None else index.setdefault(v, len(index))
        self.values = values
        self.dictionary = pa.array(list(index), pa.string())
        self.codes = codes

    def take(self, ids: np.ndarray, null_mask: Optional[np.ndarray] = None) -> pa.DictionaryArray:
        c = self.codes[ids] if len(ids) else np.zeros(0, np.int32)
        null = c < 0
        if null_mask is not None:
            null |= null_mask
        indices = nullable_array(c, null, pa.int32())
        # codes index the dictionary by construction: skip the O(n) bounds validation
        return pa.DictionaryArray.from_arrays(indices, self.dictionary, safe=False)


#: the phase column's dictionary: index 1 for rows flagged F_BACKWARD
_PHASES = pa.array(["forward", "backward"], pa.string())


#: op -> (name, namespace, overload, tags, short name, noise?): the same in every trace
_FUNC_NAMES: Dict[Any, Tuple[str, str, str, List[str], str, bool]] = {}


def _func_names(func: Any) -> Tuple[str, str, str, List[str], str, bool]:
    got = _FUNC_NAMES.get(func)
    if got is not None:
        return got
    name = str(func)
    parts = name.split(".")
    try:
        tags = [str(t).split(".")[-1] for t in func.tags]
    except Exception:
        tags = []
    sn = parts[1] if len(parts) > 1 else name
    got = (name, parts[0], parts[2] if len(parts) > 2 else "default", tags, sn, sn in NOISE_OPS)
    try:
        _FUNC_NAMES[func] = got
    except TypeError:   # an unhashable stand-in: not cached
        pass
    return got


def _op_dicts(rec: Recorder) -> Dict[str, Any]:
    names: List[str] = []
    nss: List[str] = []
    ovls: List[str] = []
    tags: List[List[str]] = []
    noise: List[bool] = []
    short: List[str] = []
    for func in rec.funcs.values:
        name, ns, ovl, tg, sn, nz = _func_names(func)
        names.append(name)
        nss.append(ns)
        ovls.append(ovl)
        tags.append(tg)
        short.append(sn)
        noise.append(nz)
    return dict(op=_Dict(names), namespace=_Dict(nss), overload=_Dict(ovls), tags=tags,
                is_noise=np.array(noise or [False], dtype=bool), short=short, names=names)


def _segments(starts: np.ndarray, lens: np.ndarray, offsets: Optional[np.ndarray] = None) -> np.ndarray:
    """Indexes of the concatenated segments [starts[i], starts[i] + lens[i]) (vectorised).
    ``offsets``: ``_offsets(lens)`` when the caller has it already."""
    if offsets is None:
        offsets = _offsets(lens)
    total = int(offsets[-1])
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(starts - offsets[:-1], lens) + np.arange(total, dtype=np.int64)


def _offsets(lens: np.ndarray) -> np.ndarray:
    off = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    return off


def _native_gather() -> Any:
    """engine.cpp's ``gather`` when the native engine is loaded in this process (never compiles
    or loads it: a python-engine trace in a process without it uses numpy)."""
    try:
        if forced_fallback():
            return None
        return getattr(loaded_engine(), "gather", None)
    except Exception:
        return None


def gather(ids: Optional[np.ndarray], starts: np.ndarray, lens: np.ndarray, flat: np.ndarray
           ) -> Tuple[np.ndarray, np.ndarray]:
    """List rows as Arrow buffers: ``(offsets, values)`` where row ``i`` is
    ``flat[starts[k]:starts[k] + lens[k]]`` with ``k = ids[i]`` (``k = i`` when ``ids`` is None).

    ``offsets`` is int32 (``rows + 1`` entries), ``values`` has ``flat``'s dtype. One pass in C
    when the native engine is loaded (engine.cpp ``gather``), else numpy segment gathers; both
    give the same arrays (tests/test_tables_build.py).
    """
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    lens = np.ascontiguousarray(lens, dtype=np.int64)
    flat = np.ascontiguousarray(flat)
    if ids is not None and ids.dtype not in (np.int32, np.int64):
        ids = ids.astype(np.int64)
    native = _native_gather()
    if native is not None:
        off, vals = native(None if ids is None else np.ascontiguousarray(ids), starts, lens, flat, flat.itemsize)
        return np.frombuffer(off, dtype=np.int32), np.frombuffer(vals, dtype=flat.dtype)
    if ids is not None:
        starts, lens = starts[ids], lens[ids]
    offsets = _offsets(lens)
    if offsets[-1] > np.iinfo(np.int32).max:
        raise OverflowError("gather: more than 2**31 list items in one column chunk")
    return offsets.astype(np.int32), flat[_segments(starts, lens, offsets)]


def _list(offsets: np.ndarray, values: Any) -> pa.ListArray:
    """A ListArray over int32 ``offsets`` (as ``gather`` makes them: valid by construction)."""
    if not isinstance(values, pa.Array):
        values = pa.array(values)
    return pa.Array.from_buffers(pa.list_(values.type), len(offsets) - 1, [None, pa.py_buffer(offsets)],
                                 children=[values])


def _tuple_dicts(rec: Recorder) -> Dict[str, Any]:
    """Interned meta tuples as flat numpy segments, and per-meta values as flat Arrow arrays.

    Rows are expanded with numpy segment gathers instead of ``take`` over nested
    list arrays (which costs ~1.7 µs a row for the twelve list columns).
    """
    m = rec.metas
    tuples = rec.tuples.values
    tup_len = np.array([len(t) for t in tuples] or [0], dtype=np.int64)
    tup_flat = np.array([i for t in tuples for i in t], dtype=np.int64)
    tup_start = _offsets(tup_len)[:-1]
    shape_len = np.array([len(s) for s in m.shapes] or [0], dtype=np.int64)
    shape_flat = np.array([d for s in m.shapes for d in s], dtype=np.int64)
    strides = [st if st is not None else () for st in m.strides]
    stride_len = np.array([len(st) for st in strides] or [0], dtype=np.int64)
    stride_flat = np.array([d for st in strides for d in st], dtype=np.int64)
    meta_nbytes = np.array(m.nbytes or [0], dtype=np.int64)
    meta_float = np.array([d in INEXACT_DTYPES for d in m.dtypes] or [False], dtype=bool)
    nbytes = np.array([int(meta_nbytes[list(t)].sum()) if t else 0 for t in tuples] or [0], dtype=np.int64)
    has_float = np.array([bool(meta_float[list(t)].any()) if t else False for t in tuples] or [False], dtype=bool)
    return dict(tup_len=tup_len, tup_flat=tup_flat, tup_start=tup_start,
                shape=(shape_len, _offsets(shape_len)[:-1], shape_flat),
                stride=(stride_len, _offsets(stride_len)[:-1], stride_flat),
                dtypes=_Dict(m.dtypes), devices=_Dict(m.devices), formats=_Dict(m.formats),
                ambiguous=np.array(m.ambiguous or [False], dtype=bool),
                nbytes=nbytes, lens=tup_len, has_float=has_float,
                # every meta has as many strides as dims (none non-strided): one gather serves both
                same_layout=bool(np.array_equal(shape_len, stride_len)))


def _list_columns(t: Dict[str, Any], tuple_ids: np.ndarray, side: str, cols: Dict[str, Any]) -> np.ndarray:
    """in_*/out_* list columns for rows whose metas are the interned tuples ``tuple_ids``;
    returns the rows' offsets (tensors per row, cumulated) as numpy."""
    off1, metas = gather(tuple_ids, t["tup_start"], t["tup_len"], t["tup_flat"])
    for key, name in (("shape", "shapes"), ("stride", "strides")):
        lens, starts, flat = t[key]
        off2, vals = gather(metas, starts, lens, flat)
        cols[f"{side}_{name}"] = _list(off1, _list(off2, pa.array(vals, pa.int64())))
    for name in ("dtypes", "devices", "formats"):
        cols[f"{side}_{name}"] = _list(off1, t[name].take(metas))
    cols[f"{side}_ambiguous"] = _list(off1, pa.array(t["ambiguous"][metas], pa.bool_()))
    return off1


def _matmul_flops(name: str, shapes: Sequence[Sequence[int]]) -> int:
    """torch.utils.flop_counter's mm/addmm/bmm/baddbmm formulas (2*m*n*k per batch), or -1."""
    try:
        a, b = shapes[-2], shapes[-1]
        if name in ("mm", "addmm"):
            return 2 * a[0] * a[1] * b[1]
        if name in ("bmm", "baddbmm"):
            return 2 * a[0] * a[1] * a[2] * b[2]
    except (IndexError, TypeError):
        pass
    return -1




class _ListDict:
    """A list column's interned values as flat numpy segments: rows expand by ``gather``.

    Values are ints (``value_type``) or, with ``value_type=None``, strings kept as a ``_Dict``.
    """

    def __init__(self, lists: Sequence[Sequence[Any]], value_type: Any) -> None:
        self.lens = np.array([len(v) for v in lists] or [0], dtype=np.int64)
        self.starts = _offsets(self.lens)[:-1]
        flat = [x for v in lists for x in v]
        self.strings: Optional[_Dict]
        if value_type is None:
            self.strings = _Dict(flat)   # flat position == id in the _Dict
            self.pos = np.arange(len(flat), dtype=np.int64)
        else:
            self.strings = None
            self.flat = np.array(flat, dtype=_NUMPY_TYPES[value_type])
            self.value_type = value_type

    def take(self, idx: np.ndarray) -> pa.ListArray:
        if self.strings is not None:
            off, pos = gather(idx, self.starts, self.lens, self.pos)
            return _list(off, self.strings.take(pos))
        off, vals = gather(idx, self.starts, self.lens, self.flat)
        return _list(off, pa.array(vals, self.value_type))


_NUMPY_TYPES = {pa.int32(): np.int32, pa.int64(): np.int64}


class _CallColumns(dict[str, np.ndarray]):   # a plain dict subclass at run time
    """The calls rows as contiguous int64 columns, each read on first use: a frozen chunk's packed
    column unpacked and concatenated with the live rows' (column-wise: stacking rows into one
    matrix and slicing strided columns from it cost several times more). A decode needs two
    columns (``src``, ``func``); only the calls table reads them all."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self._calls = rec.calls

    def __missing__(self, name: str) -> np.ndarray:
        col = self[name] = self._calls.column(name)
        return col


class _Links:
    """Backward rows to forward rows, built incrementally as chunks are decoded in order.

    A backward row (``node != 0``) whose autograd sequence number was claimed by a forward row
    links to the first such row (``fwd_seq``) and inherits its module and call (its source
    line). The index holds one entry per forward row with a sequence number: sorted keys and
    the first row's seq, module and call, in arrays that grow by doubling (sequence numbers
    mostly increase, so a chunk's new keys append). Kept on the recorder: ``dataset=`` decodes
    spilled chunks while the trace runs and the final build decodes them again, and neither
    re-reads the whole trace for it (the old global pass did, per spill).
    """

    def __init__(self) -> None:
        self.n_seen = 0          # rows of the trace added so far
        self.size = 0
        self.keys = np.zeros(1024, np.int64)
        self.vals = np.zeros((1024, 3), np.int64)   # first seq, module, call

    def extend(self, chunk: Mapping[str, np.ndarray], start: int) -> None:
        n = len(chunk["op"])
        if start + n <= self.n_seen:
            return
        lo = max(self.n_seen - start, 0)
        seq_nr = np.asarray(chunk["seq_nr"][lo:], dtype=np.int64)
        fwd = np.nonzero((np.asarray(chunk["node"][lo:]) == 0) & (seq_nr >= 0))[0]
        self.n_seen = start + n
        if not len(fwd):
            return
        keys, first = np.unique(seq_nr[fwd], return_index=True)
        rows = fwd[first]
        vals = np.stack([rows + start + lo, np.asarray(chunk["module"][lo:])[rows],
                         np.asarray(chunk["call"][lo:])[rows]], axis=1)
        if self.size:   # keep the first row of a key seen before
            pos = np.minimum(np.searchsorted(self.keys[:self.size], keys), self.size - 1)
            new = self.keys[:self.size][pos] != keys
            keys, vals = keys[new], vals[new]
            if not len(keys):
                return
        if self.size and keys[0] <= self.keys[self.size - 1]:   # rare: not increasing, merge
            k = np.concatenate([self.keys[:self.size], keys])
            v = np.concatenate([self.vals[:self.size], vals])
            order = np.argsort(k, kind="stable")
            self.keys, self.vals, self.size = k[order], v[order], len(k)
            return
        need = self.size + len(keys)
        if need > len(self.keys):
            cap = max(need, 2 * len(self.keys))
            self.keys = np.resize(self.keys, cap)
            self.vals = np.resize(self.vals, (cap, 3))
        self.keys[self.size:need] = keys
        self.vals[self.size:need] = vals
        self.size = need

    def resolve(self, chunk: Mapping[str, np.ndarray]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(fwd_seq, module, call) of the chunk's rows: forward rows keep their own module/call."""
        module = np.asarray(chunk["module"], dtype=np.int64).copy()
        call = np.asarray(chunk["call"], dtype=np.int64).copy()
        fwd_seq = np.full(len(module), -1, dtype=np.int64)
        seq_nr = np.asarray(chunk["seq_nr"], dtype=np.int64)
        bwd = np.nonzero((np.asarray(chunk["node"]) != 0) & (seq_nr >= 0))[0]
        if len(bwd) and self.size:
            keys = self.keys[:self.size]
            pos = np.minimum(np.searchsorted(keys, seq_nr[bwd]), self.size - 1)
            hit = keys[pos] == seq_nr[bwd]
            rows, v = bwd[hit], self.vals[pos[hit]]
            fwd_seq[rows] = v[:, 0]
            module[rows] = v[:, 1]
            call[rows] = v[:, 2]
        return fwd_seq, module, call


def _links(rec: Recorder) -> _Links:
    links = getattr(rec, "links", None)
    if links is None:
        links = rec.links = _Links()
    return links


class _Ctx:
    """Dictionaries and global per-op arrays shared by every chunk's decode."""

    def __init__(self, sess: Session) -> None:
        rec = sess.ctx.rec
        self.sess = sess
        self.ops = _op_dicts(rec)
        self.tup = _tuple_dicts(rec)
        self.alias_lists = _ListDict(rec.aliases.values, pa.int32())
        self.tags = _ListDict(self.ops["tags"], None)
        self.alias_fresh = np.array([all(x < 0 for x in a) for a in rec.aliases.values] or [True], dtype=bool)
        self.modules = _Dict(rec.modules.values)
        self.nodes = _Dict(rec.nodes.values)
        n_calls = rec.n_calls
        self.call_cols = _CallColumns(rec)
        call_src = self.call_cols["src"]
        src_vals = rec.sources.values
        self.src_files = _Dict([None if v is None else v[0] for v in src_vals])
        self.src_lines = np.array([-1 if v is None or v[1] is None else v[1] for v in src_vals] or [-1], dtype=np.int64)
        self.call_src = call_src
        func_names = [getattr(f, "__name__", str(f)) for f in rec.call_funcs.values]
        call_func = self.call_cols["func"][:n_calls]
        func_free = np.array([name in EXPECT_FREE_CALLS for name in func_names] or [False], dtype=bool)
        self.call_free = func_free[call_func] if n_calls else np.zeros(0, bool)
        short = self.ops["short"]
        self.copy_op = np.array([s in COPYING_OPS for s in short] or [False], dtype=bool)
        self.to_copy_op = np.array([s == "_to_copy" for s in short] or [False], dtype=bool)
        self.cell = sess.cell
        screen = sess.ctx.screen
        if screen is True:   # the native engine screens; its counters replace this at finish
            from .engines import NativeScreen

            screen = NativeScreen({})
        self.screened_op = np.array([bool(screen.screens(f)) if screen is not None else False
                                     for f in rec.funcs.values] or [False], dtype=bool)
        self._g: Optional[Dict[str, np.ndarray]] = None
        self._null_cache: Dict[Any, pa.Array] = {}
        self.links = _links(rec)

    @property
    def g(self) -> Dict[str, np.ndarray]:
        """Whole-trace columns some tables index by seq (``op``: a tensor's allocating op, a
        warning's op), read once, only the columns needed, on first use."""
        if self._g is None:
            ops = [np.asarray(c["op"], dtype=np.int32) for c in self.sess.ctx.rec.iter_op_chunks(columns=("op",))]
            self._g = {"op": np.concatenate(ops) if ops else np.zeros(0, np.int32)}
        return self._g

    def decode(self, chunk: Dict[str, np.ndarray], start: int) -> pa.RecordBatch:
        rec = self.sess.ctx.rec
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
        cols: Dict[str, Any] = {}
        cols["seq"] = pa.array(seq)
        cols["cell"] = self._nulls(n, pa.int64()) if self.cell is None else pa.array(np.full(n, self.cell, np.int64))
        for k in ("op", "namespace", "overload"):
            cols[k] = self.ops[k].take(op)
        cols["tags"] = self.tags.take(op)
        backward = (flags & F_BACKWARD) != 0
        cols["phase"] = pa.DictionaryArray.from_arrays(pa.array(backward.astype(np.int32), pa.int32()), _PHASES,
                                                       safe=False)
        cols["autograd_node"] = self.nodes.take(node)
        seq_nr = chunk["seq_nr"]
        cols["seq_nr"] = nullable_array(seq_nr, seq_nr < 0)
        cols["fwd_seq"] = nullable_array(fs, fs < 0)
        cols["call_id"] = nullable_array(chunk["call"], chunk["call"] < 0)
        cols["module"] = self.modules.take(module)
        cols["source_file"] = self.src_files.take(src_idx)
        cols["source_line"] = self._lines(src_idx)
        in_off = _list_columns(t, ins, "in", cols).astype(np.int64)
        out_off = _list_columns(t, outs, "out", cols).astype(np.int64)
        # storages: per row n_in then n_out ids, row after row (row i starts at in_off[i] + out_off[i])
        stor = chunk["storages"]
        total = in_off[-1] + out_off[-1]
        if len(stor) < total:  # defensive: a truncated chunk never misaligns rows
            stor = np.concatenate([stor, np.full(total - len(stor), -1, stor.dtype)])
        row_start = in_off[:-1] + out_off[:-1]
        for key, starts, lens in (("in_storages", row_start, np.diff(in_off)),
                                  ("out_storages", row_start + np.diff(in_off), np.diff(out_off))):
            off, vals = gather(None, starts, lens, stor)
            cols[key] = _list(off, pa.array(vals, pa.int64()))
        cols["out_alias"] = self.alias_lists.take(alias)
        is_view = (flags & F_VIEW) != 0
        cols["is_view"] = pa.array(is_view)
        cols["inplace"] = pa.array((flags & (F_INPLACE | F_OUT_KW)) != 0)
        cols["hidden_copy"] = pa.array(self._hidden_copy(op, ins, outs, alias, call, n))
        noise = self.ops["is_noise"][op] if n else np.zeros(0, bool)
        cols["is_noise"] = pa.array(noise, pa.bool_())
        flops = self._shape_flops(chunk["flops"], op, ins)
        cols["flops"] = nullable_array(flops, flops < 0)
        no_bytes = is_view | noise
        cols["bytes_read"] = pa.array(np.where(no_bytes, 0, t["nbytes"][ins]) if n else np.zeros(0, np.int64))
        cols["bytes_written"] = pa.array(np.where(no_bytes, 0, t["nbytes"][outs]) if n else np.zeros(0, np.int64))
        cols["start_ns"] = pa.array(chunk["start"])
        cols["cpu_ns"] = pa.array(chunk["dur"])
        cols["cuda_ns"] = self._sparse_int(rec.cuda_ns, start, n)
        cols["error_id"] = self._sparse_int(rec.op_errors, start, n)
        if self.sess.ctx.screen is not None:
            screened = self.screened_op[op] & t["has_float"][outs] if n else np.zeros(0, bool)
            nf = np.where(screened, 0, -1)   # null: not screened (views, aliases, empty*, no float output)
            prod = np.zeros(n, dtype=bool)
            prod_null = np.ones(n, dtype=bool)
            for s, (cnt, produced) in rec.nonfinite.items():
                if start <= s < start + n:
                    nf[s - start] = cnt
                    prod[s - start] = bool(produced)
                    prod_null[s - start] = False
            cols["nonfinite"] = nullable_array(nf.astype(np.int64), nf < 0)
            cols["nonfinite_produced"] = nullable_array(prod, prod_null, pa.bool_())
        else:
            cols["nonfinite"] = self._nulls(n, pa.int64())
            cols["nonfinite_produced"] = self._nulls(n, pa.bool_())
        if rec.numerics:
            rel = np.full(n, np.nan)
            mx = np.full(n, np.nan)
            for s, (r, m) in rec.numerics.items():
                if start <= s < start + n:
                    rel[s - start] = r
                    mx[s - start] = m
            cols["num_rel_err"] = nullable_array(rel, np.isnan(rel), pa.float64())
            cols["num_max_abs_err"] = nullable_array(mx, np.isnan(mx), pa.float64())
        else:
            cols["num_rel_err"] = self._nulls(n, pa.float64())
            cols["num_max_abs_err"] = self._nulls(n, pa.float64())
        cols["graph_id"] = self._nulls(n, pa.int64())   # filled by recording/compiled.attach
        return pa.RecordBatch.from_arrays([cols[f.name] for f in S.OPS], schema=S.OPS)

    def _lines(self, src_idx: np.ndarray) -> pa.Array:
        lines = self.src_lines[src_idx] if len(src_idx) else np.zeros(0, np.int64)
        return nullable_array(lines, lines < 0)

    def _shape_flops(self, flops: np.ndarray, op: np.ndarray, ins: np.ndarray) -> np.ndarray:
        """Fill the rows the dispatch mode left for later (-2): matmul FLOPs from input shapes."""
        todo = np.nonzero(flops == -2)[0]
        if not len(todo):
            return flops
        flops = flops.copy()
        m = self.sess.ctx.rec.metas
        tv = self.sess.ctx.rec.tuples.values
        short = self.ops["short"]
        cache: Dict[Tuple[int, int], int] = {}
        for i in todo:
            key = (int(op[i]), int(ins[i]))
            v = cache.get(key)
            if v is None:
                shapes = [m.shapes[j] for j in tv[key[1]]]
                v = cache[key] = _matmul_flops(short[key[0]], shapes)
            flops[i] = v
        return flops

    def _nulls(self, n: int, typ: Any) -> pa.Array:
        """An all-null column, one per (length, type) for the whole build (Arrow arrays are
        immutable: every chunk of the same length shares it)."""
        key = (n, typ)
        arr = self._null_cache.get(key)
        if arr is None:
            arr = self._null_cache[key] = pa.nulls(n, typ)
        return arr

    def _sparse_int(self, d: Dict[int, int], start: int, n: int) -> pa.Array:
        if not d:
            return self._nulls(n, pa.int64())
        vals = np.zeros(n, dtype=np.int64)
        mask = np.ones(n, dtype=bool)
        for s, v in d.items():
            if start <= s < start + n:
                vals[s - start] = v
                mask[s - start] = False
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
            m = self.sess.ctx.rec.metas
            tv = self.sess.ctx.rec.tuples.values
            for i in idx:
                a, b = tv[ins[i]], tv[outs[i]]
                if not a or not b or m.dtypes[a[0]] != m.dtypes[b[0]] or m.devices[a[0]] != m.devices[b[0]]:
                    cand[i] = False
                elif m.formats[a[0]] != m.formats[b[0]] and not m.ambiguous[a[0]] and not m.ambiguous[b[0]]:
                    cand[i] = False   # .to(memory_format=...): the conversion the user asked for
        return cand


def _ops_table(sess: Session, ctx: _Ctx) -> Tuple[pa.Table, Optional[str]]:
    rec = sess.ctx.rec
    batches: List[pa.RecordBatch] = []
    start = 0
    spilled = bool(rec.spilled_chunks)
    sink: Any = None
    writer: Any = None
    path: Optional[str] = None
    if spilled:
        tmp = tempfile.mkdtemp(prefix="tensorscope-ops-", dir=sess.options.spill_dir)
        path = os.path.join(tmp, "ops.arrow")
        sink = pa.OSFile(path, "wb")
        writer = pa.ipc.new_file(sink, S.OPS)
    for chunk in rec.iter_op_chunks():
        b = ctx.decode(chunk, start)
        start += b.num_rows
        if writer is not None:
            writer.write_batch(b)
        else:
            batches.append(b)
    if writer is not None and sink is not None:
        writer.close()
        sink.close()
        with pa.memory_map(path) as src:
            table = pa.ipc.open_file(src).read_all()
        return table, path
    if not batches:
        return S.empty("ops"), None
    return pa.Table.from_batches(batches, schema=S.OPS), None


def decode_ops_from(sess: Session, first_seq: int) -> Iterator[pa.RecordBatch]:
    """Record batches of the ops rows from ``first_seq`` on, decoded now, while the trace may still
    record (``dataset=`` writes spilled rows as parts). Rows decoded early lack what is only
    resolved at the end (``cuda_ns``)."""
    ctx = _Ctx(sess)
    for start, chunk in sess.ctx.rec.iter_op_chunks(from_seq=first_seq, with_start=True):
        ctx.links.extend(chunk, start)   # rows before first_seq, if a decode was skipped
        if start + len(chunk["op"]) > first_seq:
            b = ctx.decode(chunk, start)
            yield b.slice(first_seq - start) if start < first_seq else b


def _calls_table(sess: Session, ctx: _Ctx) -> pa.Table:
    rec = sess.ctx.rec
    c = rec.calls
    n = rec.n_calls
    if n == 0:
        return S.empty("calls")
    a = {k: ctx.call_cols[k][:n] for k in c.fields}
    funcs = rec.call_funcs.values
    names = _Dict([getattr(f, "__name__", str(f)) for f in funcs])
    qual = _Dict([_qualname(f) for f in funcs])
    parent = a["parent"]
    depth = np.zeros(n, dtype=np.int64)
    for i in np.nonzero(parent >= 0)[0]:  # nested calls are rare; parents precede children
        depth[i] = depth[parent[i]] + 1
    src = a["src"].astype(np.int64)
    autocasts = _Dict(rec.autocasts.values)
    cols = dict(
        call_id=pa.array(np.arange(n, dtype=np.int64)),
        parent_id=nullable_array(parent, parent < 0),
        depth=pa.array(depth),
        cell=pa.nulls(n, pa.int64()) if sess.cell is None else pa.array(np.full(n, sess.cell, np.int64)),
        name=names.take(a["func"]),
        qualname=qual.take(a["func"]),
        module=ctx.modules.take(a["module"]),
        source_file=ctx.src_files.take(src),
        source_line=ctx._lines(src),
        start_ns=pa.array(a["start"]),
        dur_ns=pa.array(a["dur"]),
        first_seq=nullable_array(a["first_seq"], a["n_ops"] <= 0),
        n_ops=pa.array(a["n_ops"]),
        autocast=autocasts.take(a["autocast"]),
        compiled=pa.nulls(n, pa.bool_()),   # filled by recording/compiled.attach
        error_id=nullable_array(a["error"], a["error"] < 0),
        graph_id=pa.nulls(n, pa.int64()),   # filled by recording/compiled.attach
    )
    return pa.Table.from_arrays([cols[f.name] for f in S.CALLS], schema=S.CALLS)


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


def _tensors_table(sess: Session, ctx: _Ctx) -> pa.Table:
    rec = sess.ctx.rec
    c = rec.tensors
    n = len(c.meta)
    if n == 0:
        return S.empty("tensors")
    meta = np.frombuffer(c.meta, dtype=np.int32).astype(np.int64)
    alloc = np.frombuffer(c.alloc_seq, dtype=np.int64)
    free = np.frombuffer(c.free_seq, dtype=np.int64)
    call = np.frombuffer(c.call, dtype=np.int64)
    devs = ctx.tup["devices"]
    dts = ctx.tup["dtypes"]
    src_idx = np.zeros(n, dtype=np.int64)
    ok = call >= 0
    if len(ctx.call_src):
        src_idx[ok] = ctx.call_src[call[ok]]
    g_op = ctx.g["op"] if n else np.zeros(0, np.int32)
    alloc_op_idx = np.where(alloc >= 0, g_op[np.clip(alloc, 0, max(len(g_op) - 1, 0))] if len(g_op) else 0, 0)
    cols = dict(
        storage_id=pa.array(np.arange(n, dtype=np.int64)),
        nbytes=pa.array(np.frombuffer(c.nbytes, dtype=np.int64)),
        device=devs.take(meta), dtype=dts.take(meta), shape=_list(*_shape_rows(ctx.tup["shape"], meta)),
        alloc_seq=nullable_array(alloc, alloc < 0),
        alloc_op=ctx.ops["op"].take(alloc_op_idx.astype(np.int64), alloc < 0) if len(g_op) else
        pa.nulls(n, S.TENSORS.field("alloc_op").type),
        free_seq=nullable_array(free, free < 0),
        cell=pa.nulls(n, pa.int64()) if sess.cell is None else pa.array(np.full(n, sess.cell, np.int64)),
        module=ctx.modules.take(np.frombuffer(c.module, dtype=np.int32).astype(np.int64)),
        source_file=ctx.src_files.take(src_idx),
        source_line=ctx._lines(src_idx),
        category=pa.nulls(n, S.TENSORS.field("category").type),   # filled by _with_categories
    )
    return pa.Table.from_arrays([cols[f.name] for f in S.TENSORS], schema=S.TENSORS)


def _with_categories(sess: Session, tables: Dict[str, pa.Table]) -> pa.Table:
    """``tensors`` with its ``category`` column (analyses/memory_categories.py), from the lifetimes and
    the model/optimizer state alive now (tracking/state.py): read once, here, never per op."""
    from ..analyses.memory_categories import categorize, made_by_out_argument

    tensors = tables["tensors"]
    if tensors.num_rows == 0:
        return tensors
    rows, seqs = made_by_out_argument(tensors, tables["ops"])
    if len(rows):   # buffers compiled code made for an op's out=: made there, not before the trace
        alloc = np.asarray(pc.fill_null(tensors.column("alloc_seq"), -1).to_numpy(zero_copy_only=False)).copy()
        alloc[rows] = seqs
        op_names = tables["ops"].column("op").take(pa.array(np.maximum(alloc, 0)))
        alloc_op = pc.if_else(pa.array(alloc >= 0), op_names, pa.nulls(len(alloc), op_names.type))
        tensors = tensors.set_column(tensors.schema.get_field_index("alloc_seq"), S.TENSORS.field("alloc_seq"),
                                     nullable_array(alloc, alloc < 0))
        tensors = tensors.set_column(tensors.schema.get_field_index("alloc_op"), S.TENSORS.field("alloc_op"),
                                     alloc_op)
    known: Dict[int, str] = {}
    tracker = sess.ctx.tracker
    if tracker is not None:
        from ..tracking.leaks.roots import user_objects
        from ..tracking.state import find_optimizers, state_storages

        free = np.asarray(pc.fill_null(tensors.column("free_seq"), -1).to_numpy(zero_copy_only=False))
        ptrs = tracker.ptrs
        live = {int(ptrs[i]): i for i in np.nonzero(free < 0)[0].tolist() if i < len(ptrs)}
        modules = sess.ctx.modules.roots() if sess.ctx.modules is not None else []
        objs = user_objects(ipython_shell())
        try:
            optimizers = find_optimizers(objs)
        finally:
            objs.clear()
        known = state_storages(modules, optimizers, live)
        del modules, optimizers
    lk = tables.get("leaks")
    graph_held: List[int] = []
    opt_held: List[int] = []
    if lk is not None and lk.num_rows:
        for sid, kind in zip(lk.column("storage_id").to_pylist(), lk.column("holder_kind").to_pylist()):
            if sid is None:
                continue
            if kind == "autograd_graph":
                graph_held.append(sid)
            elif kind == "optimizer_state":
                opt_held.append(sid)
    col = categorize(tensors, tables["ops"], tables.get("calls"), known, graph_held, opt_held)
    return tensors.set_column(tensors.schema.get_field_index("category"), S.TENSORS.field("category"), col)


def _shape_rows(shape: Tuple[np.ndarray, np.ndarray, np.ndarray], metas: np.ndarray) -> Tuple[np.ndarray, pa.Array]:
    lens, starts, flat = shape
    off, vals = gather(metas, starts, lens, flat)
    return off, pa.array(vals, pa.int64())


def _errors_table(sess: Session, ctx: _Ctx) -> pa.Table:
    rows = sess.ctx.rec.errors
    if not rows:
        return S.empty("errors")
    names = ctx.ops["names"]
    g_op = ctx.g["op"]
    folded: List[Dict[str, Any]] = []
    index: Dict[Tuple[Any, ...], int] = {}
    for r in rows:
        r = dict(r)
        if r.get("op") is None and r.get("seq") is not None and 0 <= r["seq"] < len(g_op) and r["kind"] == "warning":
            r["op"] = names[int(g_op[r["seq"]])]
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


def _kernels_table(sess: Session, ops: pa.Table) -> Tuple[pa.Table, List[str]]:
    if sess.kernels is None:
        return S.empty("kernels"), []
    try:
        if sess.deferred_kernels and sess.kernels.available:
            from ..timing.kernels import cuda_devices_of

            pending = sess.kernels.end_window_deferred(sess.ctx.t0, ops, cuda_devices_of(ops))
            if pending is not None:
                return pending, []   # the Trace resolves it when the table is first read
        return sess.kernels.end_window(sess.ctx.t0, ops)
    except Exception as e:
        sess.ctx.rec.tracer_error("kernels", e)
        return S.empty("kernels"), [f"kernel collection failed: {e}"]


def _leaks_table(sess: Session, tensors: pa.Table) -> pa.Table:
    if sess.ctx.tracker is None or not sess.options.leaks:
        return S.empty("leaks")
    try:
        from ..tracking.leaks import leak_table
        from ..tracking.storages import LiveStorage
    except ImportError:
        return S.empty("leaks")
    live = sess.ctx.tracker.live_created()
    if not live:
        return S.empty("leaks")
    # only the live storages' rows, and only the columns a record needs (the whole table as Python
    # objects cost ~1 ms per 300 storages)
    cols = ("nbytes", "device", "dtype", "shape", "alloc_seq", "alloc_op", "cell", "source_file", "source_line")
    t = tensors.select(list(cols)).take(pa.array([sid for sid, _ref in live], pa.int64())).to_pydict()
    records: List[Any] = []   # tracking.storages.LiveStorage
    for i, (sid, ref) in enumerate(live):
        row = {k: t[k][i] for k in cols}
        records.append(LiveStorage(
            storage_id=sid, ref=ref, data_ptr=sess.ctx.tracker.ptrs[sid], nbytes=row["nbytes"], device=row["device"],
            dtype=row["dtype"], shape=tuple(row["shape"] or ()), alloc_seq=row["alloc_seq"], alloc_op=row["alloc_op"],
            cell=row["cell"], source_file=row["source_file"], source_line=row["source_line"]))
    import torch

    with torch._C.DisableTorchFunction():   # the search reads tensor attributes: invisible to user modes
        return leak_table(records, shell=ipython_shell())


_DEVICE: Optional[Dict[str, Any]] = None


def _device_description() -> Dict[str, Any]:
    """env() once per process, hidden from every mode and profiler (it runs a probe op)."""
    global _DEVICE
    if _DEVICE is not None:
        if not _DEVICE.get("peaks"):
            # measured since the first trace (tensorscope.env(), an advice): the cache read is cheap
            try:
                from .._peaks import all_peaks

                _DEVICE["peaks"] = all_peaks(measure=False) or None
            except Exception:
                pass
        return dict(_DEVICE)

    def describe() -> Dict[str, Any]:
        import torch
        from torch.utils._python_dispatch import _disable_current_modes

        from .._env import env

        with _disable_current_modes(), torch._C.DisableTorchFunction():
            return env(init_cuda=False).to_dict()   # never create a CUDA context just to describe it

    try:
        from .engines import unobserved

        _DEVICE = unobserved(describe)
    except Exception as e:
        return {"error": str(e)}
    return dict(_DEVICE)


def metadata(sess: Session, ops_rows: int, notes: List[str]) -> Dict[str, Any]:
    import torch

    from .._version import __version__

    rec = sess.ctx.rec
    device = _device_description()
    cap = sess.ctx.capture
    engine = getattr(sess, "engine_choice", None)
    native = None
    try:
        from .. import native as _native

        native = dict(_native.status())
        native["used"] = bool(getattr(cap, "native", False))
    except Exception:
        pass
    return {
        "schema_version": S.SCHEMA_VERSION,
        "tensorscope_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "created_unix_ns": time.time_ns(),
        "device": device,
        "options": sess.options,   # the TraceOptions itself: TraceMetadata keeps it typed
        "cell": sess.cell,
        "cell_source": sess.cell_source,
        "wall_ns": sess.wall_ns,
        "n_ops": ops_rows,
        "n_calls": rec.n_calls,
        "spilled_rows": rec.n_spilled,
        "tracer_errors": rec.n_tracer_errors,
        "tracer_error_messages": list(rec.tracer_errors),
        "native": native,
        # which engine recorded the ops, and why (the summary shows the reason when it is the fallback)
        "engine": engine.name if engine is not None else "python",
        "engine_reason": engine.reason if engine is not None else "",
        "opaque_ops": sess.ctx.opaque_ops,
        # [precision integration] probe counters: non-finite screen, numerics shadow (skips and why)
        "nonfinite_screen": sess.ctx.screen.report() if sess.ctx.screen is not None else None,
        "numerics": sess.ctx.shadow.report() if sess.ctx.shadow is not None else None,
        "notes": list(rec.notes) + list(notes),
    }


def build_trace(sess: Session) -> Trace:
    from .._trace import Trace

    rec = sess.ctx.rec
    rec.end_chunk()
    if sess.ctx.cuda_timer is not None:
        try:
            rec.cuda_ns.update(sess.ctx.cuda_timer.resolve())
        except Exception as e:
            rec.tracer_error("cuda timer resolve", e)
    if sess.ctx.screen is not None:
        try:
            rec.nonfinite.update(sess.ctx.screen.finish())
        except Exception as e:
            rec.tracer_error("non-finite screen finish", e)
    ctx = _Ctx(sess)
    ops, ops_file = _ops_table(sess, ctx)
    tables = {
        "ops": ops,
        "calls": _calls_table(sess, ctx),
        "tensors": _tensors_table(sess, ctx),
        "errors": _errors_table(sess, ctx),
    }
    try:
        from .compiled import attach

        tables = attach(sess, tables)   # graphs, graph_nodes; ops/calls.graph_id
        ops = tables["ops"]
    except Exception as e:
        rec.tracer_error("compiled regions", e)
    kernels, knotes = _kernels_table(sess, ops)
    tables["kernels"] = kernels
    notes = list(knotes)
    try:
        tables["leaks"] = _leaks_table(sess, tables["tensors"])
    except Exception as e:
        rec.tracer_error("leaks", e)
        tables["leaks"] = S.empty("leaks")
    try:
        tables["tensors"] = _with_categories(sess, tables)
    except Exception as e:
        rec.tracer_error("memory categories", e)
    coll = getattr(sess, "collectives", None)   # recording/collectives.py
    tables["collectives"] = coll.table(sess.ctx.t0, tables.get("ops")) if coll is not None else S.empty("collectives")
    md = metadata(sess, ops.num_rows, notes)
    return Trace(tables, md, _spill_file=ops_file)
