"""Arrow columns from interned values: dictionary-encoded strings and list columns by segment gather.

The decoder (``decode.py``) builds every string column as an Arrow dictionary over an
interned table (``_Dict``: no per-row Python object, no string copy) and every list column as
Arrow offsets plus the concatenated values of each row's interned segment (``gather``: one C
pass when the native engine is loaded, numpy otherwise; both give the same buffers).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from itertools import chain
from typing import Any, Optional, Union, cast

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from .._common import INEXACT_DTYPES, NOISE_OPS
from ..native import forced_fallback, loaded_engine
from ..schema import dense_array, nullable_array
from .recorder import CallStore, Packed, Recorder, unpack
from .spill import read_npz

#: the integer types whose one-value chunks ``Nulls`` shares (equal ints are equal bits; floats are
#: not: -0.0 == 0.0, and NaN is never equal)
_SHARED_INTS = {pa.int64(): np.int64, pa.int32(): np.int32, pa.uint64(): np.uint64}


class Nulls:
    """The columns of one decode that are the same on every row of a chunk: all null, or one value.

    Arrow arrays are immutable, so every chunk (and column) of the same length whose rows are all
    null, or all one value, shares one array (per length, type and value): a column no row of the
    trace fills (``seq_nr`` of a trace without autograd, ``parent_id`` of calls that never nest...)
    or that never changes (``cell``, ``nonfinite`` zeros, the ``namespace`` codes of aten ops, every
    column of a loop of one op) costs one array per chunk length, not a fresh buffer per chunk: an
    in-memory trace's finishing time goes mostly to the kernel handing out the pages its columns fill.
    """

    __slots__ = ("_cache", "share")

    def __init__(self, share: bool = True) -> None:
        self._cache: dict[tuple[object, ...], pa.Array] = {}
        self.share = share

    def __call__(self, n: int, typ: pa.DataType) -> pa.Array:
        """An all-null column of ``n`` rows."""
        if not self.share:
            return pa.nulls(n, typ)
        key = (n, typ)
        arr = self._cache.get(key)
        if arr is None:
            arr = self._cache[key] = pa.nulls(n, typ)
        return arr

    def nullable(self, values: np.ndarray, null_mask: np.ndarray, typ: pa.DataType = pa.int64()) -> pa.Array:
        """``nullable_array(values, null_mask, typ)``, shared when every row is null or (not bool)
        every row holds the same value."""
        if len(values) and self.share:
            nulls = int(np.count_nonzero(null_mask))
            if nulls == len(values):
                return self(len(values), typ)
            if nulls == 0 and typ in _SHARED_INTS:
                return self.dense(values, typ)
        return nullable_array(values, null_mask, typ)

    def dense(self, values: np.ndarray, typ: pa.DataType = pa.int64()) -> pa.Array:
        """``dense_array(values, typ)``, shared with the earlier chunks of this length that held the
        same single value on every row."""
        n = len(values)
        if (not self.share or n < 2 or typ not in _SHARED_INTS or values[0] != values[-1]
                or values.min() != values.max()):
            return dense_array(values, typ)
        key = (n, typ, values[0].item())
        arr = self._cache.get(key)
        if arr is None:
            arr = self._cache[key] = dense_array(values, typ)
        return arr

    def full(self, n: int, value: int, typ: pa.DataType = pa.int64()) -> pa.Array:
        """A column of ``n`` rows holding ``value``."""
        arr = self._cache.get((n, typ, value)) if self.share else None
        return arr if arr is not None else self.dense(np.full(n, value, _SHARED_INTS[typ]), typ)


_NO_SHARING = Nulls(share=False)


class _Dict:
    """Interned strings as an Arrow dictionary: ``codes[id]`` is the value's index in
    ``dictionary`` (-1 for None), so a column is a numpy gather of codes, never a string copy.

    The dictionary holds each distinct string once (ids of different interned values may
    share one: every ``aten.*`` op has namespace ``aten``); None is a null index, never a
    dictionary entry, so every reader sees plain nullable strings.
    """

    __slots__ = ("dictionary", "codes", "values", "has_null")

    def __init__(self, values: Sequence[Optional[str]]) -> None:
        index: dict[str, int] = {}
        codes = [-1 if v is None else index.setdefault(v, len(index)) for v in values]
        self.values = values
        self.dictionary = pa.array(list(index), pa.string())
        self.codes = np.array(codes, dtype=np.int32)
        self.has_null = -1 in codes

    def take(self, ids: np.ndarray, null_mask: Optional[np.ndarray] = None, nulls: Optional[Nulls] = None
             ) -> pa.DictionaryArray:
        """The column of rows ``ids``, null also where ``null_mask``; with ``nulls`` (a decode's
        :class:`Nulls`) a column null on every row takes that decode's shared all-null indices."""
        c = self.codes[ids] if len(ids) else np.zeros(0, np.int32)
        if null_mask is None and not self.has_null:   # no null possible: no mask to count or pack
            indices = dense_array(c, pa.int32()) if nulls is None else nulls.dense(c, pa.int32())
        else:
            null = c < 0
            if null_mask is not None:
                null |= null_mask
            indices = (nulls or _NO_SHARING).nullable(c, null, pa.int32())
        # codes index the dictionary by construction: skip the O(n) bounds validation
        return pa.DictionaryArray.from_arrays(indices, self.dictionary, safe=False)


#: what decoding built from a trace's interned values, keyed by those values: a workload traced
#: again interns the same op overloads, metas and module paths in the same order, and rebuilding
#: their dictionaries is much of a small trace's decode. Entries are read-only once built; past
#: _MEMO_SIZE the oldest goes. Only small sets of values are kept (at most _MEMO_VALUES each): a
#: big trace's decode is not dominated by them, and 64 of its dictionaries would hold real memory.
_MEMO: dict[Any, Any] = {}
_MEMO_SIZE = 64
_MEMO_VALUES = 4096


def _memo(key: Any, build: Callable[[], Any], n: int) -> Any:
    """``build()``, shared with earlier calls of the same ``key`` (made of ``n`` interned values)."""
    if n > _MEMO_VALUES:
        return build()
    try:
        got = _MEMO.get(key)
    except TypeError:   # an unhashable interned value (a stand-in op): built every time
        return build()
    if got is None:
        got = build()
        if len(_MEMO) >= _MEMO_SIZE:
            del _MEMO[next(iter(_MEMO))]
        _MEMO[key] = got
    return got


def _dict(values: Sequence[Optional[str]]) -> _Dict:
    """``_Dict(values)``, shared with earlier decodes of the same values."""
    key = tuple(values)
    return _memo(("dict", key), lambda: _Dict(key), len(key))  # type: ignore[no-any-return]


#: the phase column's dictionary: index 1 for rows flagged F_BACKWARD
_PHASES = pa.array(["forward", "backward"], pa.string())


#: op -> (name, namespace, overload, tags, short name, noise?): the same in every trace
_FUNC_NAMES: dict[Any, tuple[str, str, str, list[str], str, bool]] = {}


def _func_names(func: Any) -> tuple[str, str, str, list[str], str, bool]:
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


def _op_dicts(rec: Recorder) -> dict[str, Any]:
    """Per-op names, tags and flags of the trace's interned op overloads (shared with earlier
    decodes of the same overloads)."""
    funcs = rec.funcs.values
    return _memo(("ops", tuple(funcs)), lambda: _build_op_dicts(funcs), len(funcs))  # type: ignore[no-any-return]


def _build_op_dicts(funcs: Sequence[Any]) -> dict[str, Any]:
    names: list[str] = []
    nss: list[str] = []
    ovls: list[str] = []
    tags: list[list[str]] = []
    noise: list[bool] = []
    short: list[str] = []
    for func in funcs:
        name, ns, ovl, tg, sn, nz = _func_names(func)
        names.append(name)
        nss.append(ns)
        ovls.append(ovl)
        tags.append(tg)
        short.append(sn)
        noise.append(nz)
    return dict(op=_Dict(names), namespace=_Dict(nss), overload=_Dict(ovls), tags=tags,
                tag_lists=_ListDict(tags, None), is_noise=np.array(noise or [False], dtype=bool), short=short,
                names=names)


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
           ) -> tuple[np.ndarray, np.ndarray]:
    """List rows as Arrow buffers: ``(offsets, values)`` where row ``i`` is
    ``flat[starts[k]:starts[k] + lens[k]]`` with ``k = ids[i]`` (``k = i`` when ``ids`` is None).

    ``offsets`` is int32 (``rows + 1`` entries), ``values`` has ``flat``'s dtype. One pass in C
    when the native engine is loaded (engine.cpp ``gather``), else numpy segment gathers; both
    give the same arrays (tests/recording/test_tables_build.py).
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
        row_lens = lens[ids]
        if len(ids) and bool((row_lens == row_lens[0]).all()):
            return _uniform_gather(ids, starts, lens, flat, int(row_lens[0]))
        starts, lens = starts[ids], row_lens
    offsets = _offsets(lens)
    if offsets[-1] > np.iinfo(np.int32).max:
        raise OverflowError("gather: more than 2**31 list items in one column chunk")
    return offsets.astype(np.int32), flat[_segments(starts, lens, offsets)]


def _uniform_gather(ids: np.ndarray, starts: np.ndarray, lens: np.ndarray, flat: np.ndarray, width: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """``gather`` when every row's segment is ``width`` long (a loop of one op: every row the same
    tuple, every meta as many dims): the segments of that length as the rows of a small matrix
    (one per interned segment), and one row take of it, no per-item index arrays."""
    n = len(ids)
    if n * width > np.iinfo(np.int32).max:
        raise OverflowError("gather: more than 2**31 list items in one column chunk")
    offsets = np.arange(0, (n + 1) * width, width, dtype=np.int32) if width else np.zeros(n + 1, np.int32)
    if width == 0:
        return offsets, flat[:0]
    # rows of segments of another length are clipped garbage: no id selects them
    idx = np.minimum(starts[:, None] + np.arange(width), len(flat) - 1)
    return offsets, flat[idx].take(ids, axis=0).ravel()


def _list(offsets: np.ndarray, values: Any) -> pa.ListArray:
    """A ListArray over int32 ``offsets`` (as ``gather`` makes them: valid by construction)."""
    if not isinstance(values, pa.Array):
        values = pa.array(values)
    return pa.Array.from_buffers(pa.list_(values.type), len(offsets) - 1, [None, pa.py_buffer(offsets)],
                                 children=[values])


def _list_columns(t: dict[str, Any], tuple_ids: np.ndarray, side: str, cols: dict[str, Any],
                  nulls: Optional[Nulls] = None) -> np.ndarray:
    """in_*/out_* list columns for rows whose metas are the interned tuples ``tuple_ids``;
    returns the rows' int32 offsets (tensors per row, cumulated). Every column of the side shares
    one offsets buffer; strides share the shapes' inner offsets when every meta has as many
    strides as dims (``same_layout``); with ``nulls``, a chunk's dtypes/devices/formats that are one
    value (float32 on cpu, contiguous) share their indices."""
    off1, metas = gather(tuple_ids, t["tup_start"], t["tup_len"], t["tup_flat"])
    lens, starts, flat = t["shape"]
    off2, vals = gather(metas, starts, lens, flat)
    cols[f"{side}_shapes"] = _list(off1, _list(off2, dense_array(vals)))
    lens, starts, flat = t["stride"]
    soff, vals = gather(metas, starts, lens, flat)
    cols[f"{side}_strides"] = _list(off1, _list(off2 if t["same_layout"] else soff, dense_array(vals)))
    for name in ("dtypes", "devices", "formats"):
        cols[f"{side}_{name}"] = _list(off1, t[name].take(metas, nulls=nulls))
    cols[f"{side}_ambiguous"] = _list(off1, pa.array(t["ambiguous"][metas], pa.bool_()))
    return off1


def _storage_lists(stor: np.ndarray, in_off: np.ndarray, out_off: np.ndarray) -> tuple[pa.ListArray, pa.ListArray]:
    """The ``in_storages``/``out_storages`` columns from a chunk's storage ids (per row its inputs'
    then its outputs', row after row) and the int32 offsets of the rows' input and output tensors
    (the in_*/out_* columns' offsets, shared). Rows that all have as many inputs and as many outputs
    (a loop of one op) split as a matrix's columns; others by segment gathers."""
    n = len(in_off) - 1
    n_in, n_out = int(in_off[-1]), int(out_off[-1])
    total = n_in + n_out
    if len(stor) < total:  # defensive: a truncated chunk never misaligns rows
        stor = np.concatenate([stor, np.full(total - len(stor), -1, stor.dtype)])
    k, m = (n_in // n, n_out // n) if n else (0, 0)
    if n and k * n == n_in and m * n == n_out and _steps(in_off, k) and _steps(out_off, m):
        rows = stor[:total].reshape(n, k + m)
        ins, outs = np.ascontiguousarray(rows[:, :k]).ravel(), np.ascontiguousarray(rows[:, k:]).ravel()
    else:
        in_o, out_o = in_off.astype(np.int64), out_off.astype(np.int64)
        row_start = in_o[:-1] + out_o[:-1]   # row i's ids start at in_off[i] + out_off[i]
        in_len = np.diff(in_o)
        ins = gather(None, row_start, in_len, stor)[1]
        outs = gather(None, row_start + in_len, np.diff(out_o), stor)[1]
    return _list(in_off, dense_array(ins)), _list(out_off, dense_array(outs))


def _steps(off: np.ndarray, k: int) -> bool:
    """Whether offsets ``off`` grow by exactly ``k`` every row."""
    return bool((off[1:] - off[:-1] == k).all())


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
        return _list(off, dense_array(vals, self.value_type))


_NUMPY_TYPES = {pa.int32(): np.int32, pa.int64(): np.int64}


def call_rows(store: CallStore, name: str, lo: int, hi: int) -> np.ndarray:
    """Rows ``[lo, hi)`` of one field of a calls store as a new int64 array, reading only the chunks
    that overlap them (a spilled one from its file): the calls table is built a range at a time and
    never holds a whole column (8 B a call each). The native engine's store has its own
    (``live_calls.LiveCalls.column_range``)."""
    k, out, start = store.fields.index(name), np.empty(max(hi - lo, 0), dtype=np.int64), 0
    parts: list[tuple[int, Union[int, dict[str, Packed], None]]] = [(n, i) for i, (_, n) in enumerate(store.spilled)]
    parts += [(len(ch[name][1]), ch) for ch in store.frozen] + [(len(store), None)]   # then the live rows
    for n, src in parts:
        b, e = max(lo, start), min(hi, start + n)
        if b < e:
            if src is None:
                base, a = 0, store.matrix()[:, k]
            elif isinstance(src, int):
                base, a = store.spilled_field(src, name)
            else:
                base, a = src[name]
            part = out[b - lo:e - lo]
            part[:] = a[b - start:e - start]
            if base:
                part += base
        start += n
    return out


#: calls read at a time when the decoder reads their source and function ids
CALL_RANGE = 1 << 16


def _call_ranges(rec: Recorder) -> Callable[[str, int, int], np.ndarray]:
    """``(field, lo, hi) -> int64 rows [lo, hi)`` of the calls store, a range at a time: the native
    engine's store reads them itself (``column_range``), the python one through ``call_rows``."""
    ranged = getattr(rec.calls, "column_range", None)
    if ranged is not None:
        return cast(Callable[[str, int, int], np.ndarray], ranged)
    return partial(call_rows, rec.calls)


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
        # int32 while every value fits (16 B a forward row with a sequence number, not 32), then int64
        self.keys = np.zeros(1024, np.int32)
        self.vals = np.zeros((1024, 3), np.int32)   # first seq, module, call

    def _fit(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Widen the index to int64 before values that do not fit int32 are stored."""
        if self.keys.dtype == np.int64 or not len(keys):
            return
        lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
        if min(int(keys.min()), int(vals.min())) < lo or max(int(keys.max()), int(vals.max())) > hi:
            self.keys = self.keys.astype(np.int64)
            self.vals = self.vals.astype(np.int64)

    def _find(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position, found) of each of ``q`` (int64) among the index's keys. A value the int32
        index cannot hold is not in it (numpy would compare it wrapped, not widened)."""
        keys = self.keys[:self.size]
        if keys.dtype == np.int32:
            ok = (q >= np.iinfo(np.int32).min) & (q <= np.iinfo(np.int32).max)
            q = np.where(ok, q, 0).astype(np.int32)
        else:
            ok = np.ones(len(q), bool)
        pos = np.minimum(np.searchsorted(keys, q), self.size - 1)
        return pos, ok & (keys[pos] == q)

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
        keys = seq_nr[fwd]
        if len(keys) > 1 and not (keys[1:] > keys[:-1]).all():   # repeated or out of order: sort, first row
            keys, first = np.unique(keys, return_index=True)
            rows = fwd[first]
        else:
            rows = fwd
        vals = np.stack([rows + start + lo, np.asarray(chunk["module"][lo:])[rows],
                         np.asarray(chunk["call"][lo:])[rows]], axis=1)
        if self.size:   # keep the first row of a key seen before
            new = ~self._find(keys)[1]
            keys, vals = keys[new], vals[new]
            if not len(keys):
                return
        self._fit(keys, vals)
        keys, vals = keys.astype(self.keys.dtype, copy=False), vals.astype(self.vals.dtype, copy=False)
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

    def resolve(self, chunk: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(fwd_seq, module, call) of the chunk's rows: forward rows keep their own module/call."""
        module = np.asarray(chunk["module"], dtype=np.int64).copy()
        call = np.asarray(chunk["call"], dtype=np.int64).copy()
        fwd_seq = np.full(len(module), -1, dtype=np.int64)
        seq_nr = np.asarray(chunk["seq_nr"], dtype=np.int64)
        bwd = np.nonzero((np.asarray(chunk["node"]) != 0) & (seq_nr >= 0))[0]
        if len(bwd) and self.size:
            pos, hit = self._find(seq_nr[bwd])
            rows, v = bwd[hit], self.vals[pos[hit]]
            fwd_seq[rows] = v[:, 0]
            module[rows] = v[:, 1]
            call[rows] = v[:, 2]
        return fwd_seq, module, call


def _int_lists(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, concatenated items) of int sequences as int64 arrays; lengths is ``[0]`` for no
    sequence (ids index it)."""
    if not seqs:
        return np.zeros(1, np.int64), np.zeros(0, np.int64)
    lens = np.fromiter(map(len, seqs), np.int64, len(seqs))
    return lens, np.fromiter(chain.from_iterable(seqs), np.int64, int(lens.sum()))


def _tuple_dicts(rec: Recorder) -> dict[str, Any]:
    """Interned meta tuples as flat numpy segments, and per-meta values as flat Arrow arrays
    (shared with earlier decodes of the same metas and tuples).

    Rows are expanded with numpy segment gathers instead of ``take`` over nested
    list arrays (which costs ~1.7 µs a row for the twelve list columns).
    """
    m = rec.metas
    n = len(rec.tuples.values) + len(m.shapes)
    if n > _MEMO_VALUES:   # not kept: no key to build
        return _build_tuple_dicts(rec)
    key = ("tuples", tuple(rec.tuples.values), tuple(m.shapes), tuple(m.strides), tuple(m.dtypes), tuple(m.devices),
           tuple(m.formats), tuple(m.ambiguous), tuple(m.nbytes))
    return _memo(key, lambda: _build_tuple_dicts(rec), n)  # type: ignore[no-any-return]


def _build_tuple_dicts(rec: Recorder) -> dict[str, Any]:
    m = rec.metas
    tup_len, tup_flat = _int_lists(rec.tuples.values)
    tup_off = _offsets(tup_len)
    shape_len, shape_flat = _int_lists(m.shapes)
    stride_len, stride_flat = _int_lists([st if st is not None else () for st in m.strides])
    meta_nbytes = np.array(m.nbytes or [0], dtype=np.int64)
    meta_float = np.array([d in INEXACT_DTYPES for d in m.dtypes] or [False], dtype=bool)
    # per tuple: its metas' bytes summed, and whether any is floating (running sums at the tuple bounds)
    cum_bytes = _offsets(meta_nbytes[tup_flat])
    cum_float = _offsets(meta_float[tup_flat])
    nbytes = cum_bytes[tup_off[1:]] - cum_bytes[tup_off[:-1]]
    has_float = cum_float[tup_off[1:]] > cum_float[tup_off[:-1]]
    return dict(tup_len=tup_len, tup_flat=tup_flat, tup_start=tup_off[:-1],
                shape=(shape_len, _offsets(shape_len)[:-1], shape_flat),
                stride=(stride_len, _offsets(stride_len)[:-1], stride_flat),
                dtypes=_Dict(m.dtypes), devices=_Dict(m.devices), formats=_Dict(m.formats),
                ambiguous=np.array(m.ambiguous or [False], dtype=bool),
                nbytes=nbytes, lens=tup_len, has_float=has_float,
                # every meta has as many strides as dims (none non-strided): one gather serves both
                same_layout=bool(np.array_equal(shape_len, stride_len)))


def _int64(col: npt.ArrayLike, lo: int, hi: int) -> np.ndarray:
    """Rows ``[lo, hi)`` of a recorded integer column (an ``array`` the python engine filled, or a
    numpy view of the rows the native engine handed over) as a new contiguous int64 array."""
    out: np.ndarray = np.array(np.asarray(col)[lo:hi], dtype=np.int64)
    return out


def _shape_rows(shape: tuple[np.ndarray, np.ndarray, np.ndarray], metas: np.ndarray) -> tuple[np.ndarray, pa.Array]:
    lens, starts, flat = shape
    off, vals = gather(metas, starts, lens, flat)
    return off, dense_array(vals)


class OpIdsAt:
    """The op id of rows ``seqs`` (in ``[0, n_ops)``), read from the op chunks that hold them (the
    spilled ones loaded one column at a time, the last few kept): a tensors block's allocating ops
    sit in a few neighbouring chunks, so no whole-trace op column is read (the tensors decode)."""

    def __init__(self, rec: Recorder, keep: int = 4) -> None:
        self.rec, self.keep = rec, keep
        counts = list(rec.spilled_counts) + [len(ch["op"][1]) for ch in rec.mem_chunks]
        self.starts = np.cumsum([0] + counts)
        self.cache: dict[int, np.ndarray] = {}

    def chunk(self, k: int) -> np.ndarray:
        got = self.cache.get(k)
        if got is None:
            rec, ns = self.rec, len(self.rec.spilled_chunks)
            if k < ns:
                z = read_npz(rec.spilled_chunks[k])
                names = sorted(x for x in z if x != "__bases__")
                got = unpack((int(z["__bases__"][names.index("op")]), z["op"]))
            else:
                got = unpack(rec.mem_chunks[k - ns]["op"])
            if len(self.cache) >= self.keep:
                del self.cache[next(iter(self.cache))]
            self.cache[k] = got
        return got

    def __call__(self, seqs: np.ndarray) -> np.ndarray:
        out = np.zeros(len(seqs), np.int64)
        if not len(seqs):
            return out
        which = np.searchsorted(self.starts, seqs, side="right") - 1
        for k in range(int(which.min()), int(which.max()) + 1):   # a few neighbouring chunks
            sel = which == k
            if sel.any():
                out[sel] = self.chunk(k)[seqs[sel] - self.starts[k]]
        return out
