"""What memory is made of: a category per storage, live bytes per category per op, memory per module.

Pure functions of the trace tables. ``categorize`` derives ``tensors.category`` from what was recorded:

* ``parameter`` / ``buffer`` / ``gradient`` / ``optimizer_state``: ``known`` (storage id -> category,
  read at the end of the trace from the modules the trace saw and the optimizers the user holds),
  plus every storage an ``AccumulateGrad`` node's ops wrote (gradients freed before the end:
  ``zero_grad()``), plus optimizer state the leak finder named (``optimizer_state`` holder kind);
* ``input``: existed before the trace, or made outside every module (outside backward) and read by
  an op of a module (the batch, a mask built in the cell);
* ``activation``: saved for backward, i.e. made in forward and freed by a later backward (autograd
  releases a saved tensor when its node has run), or alive at the end and held only by an autograd
  graph (the leak finder's ``autograd_graph`` holder);
* ``temporary``: made and freed within one phase (one run of forward ops, or one backward);
* ``other``: the rest (outputs the program keeps, a loss, tensors living across phases).

Phases are runs of ops with the same ``phase``; ops under a ``Tensor.backward`` /
``torch.autograd.backward`` / ``torch.autograd.grad`` call count as backward (the seed gradient
``ones_like`` those calls make). A storage the program keeps *and* autograd saved is not freed by
the backward, so it is not an activation here (it is ``other``).

``memory_timeline`` is the ``memory`` view split by category, with the op, module, phase and source
line of each row and each device's peak marked; ``memory_at`` what was live while one op ran (the peak
by default) by category and module; ``module_memory`` per module the activations its forward saved
and the peaks while its forward and backward ops ran, children rolled into parents by path.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from .. import schema as S
from .memory_batches import memory_at as _memory_at
from .memory_batches import memory_timeline_batches
from .memory_batches import module_memory as _module_memory
from .memory_columns import (  # noqa: F401  (the names this module had: read here by name)
    _CAT,
    BACKWARD_CALLS,
    CATS,
    _array,
    _backward_rows,
    _batches,
    _category_codes,
    _codes,
    _devices,
    _filled,
    _is,
    _op_columns,
    backward_calls,
)
from .storage_reads import _flat, _ints, read_column, rows_where

__all__ = ["categorize", "category_blocks", "memory_timeline", "memory_at", "module_memory", "BACKWARD_CALLS"]


def backward_region(ops: pa.Table, calls: Optional[pa.Table]) -> np.ndarray:
    """Per op: ran in autograd's engine, or under a call that runs it (see the module docstring)."""
    n = ops.num_rows
    if n == 0:
        return np.zeros(0, bool)
    under = backward_calls(calls)
    out = np.empty(n, bool)
    for lo, b in _batches(ops, ["phase", "call_id"]):
        out[lo:lo + b.num_rows] = _backward_rows(b.column(0), b.column(1), under)
    return out


def _clamp(x: np.ndarray, hi: int) -> np.ndarray:
    """``x`` clipped to [0, hi] (``np.clip``'s dispatch costs more than the two ufuncs on short arrays)."""
    out: np.ndarray = np.minimum(np.maximum(x, 0), hi)
    return out


def _out_like(v: str) -> bool:
    return v == "out" or v.endswith("_out")


def _any_out_overload(ops: pa.Table) -> bool:
    """Whether an ``out=`` overload ran (from the dictionaries when the column is one: most traces
    ran none, and then nothing needs looking up per op)."""
    col = ops.column("overload")
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    if all(pa.types.is_dictionary(c.type) for c in chunks):
        seen: set[int] = set()
        for c in chunks:
            if id(c.dictionary) in seen:
                continue
            seen.add(id(c.dictionary))
            if any(v is not None and _out_like(v) for v in c.dictionary.to_pylist()):
                return True
        return False
    return True


#: per-op flag bits of Lifetimes.flags
_ACC, _MOD, _OUT = 1, 2, 4
#: rows of tensors categorised at a time
_STORAGE_STEP = 1 << 16


class Lifetimes:
    """What ``categorize`` and ``made_by_out_argument`` read of ``tensors`` and ``ops``, gathered in
    one pass over ``ops`` batch by batch (a memory-mapped table stays mapped, never combined): per
    storage whether an op of a module read it (a bit each; ``alloc_seq``/``free_seq`` are read a block of rows
    at a time from ``tensors``, never whole: a mapped table stays mapped); per op one byte of
    flags (an AccumulateGrad op, in a module, an ``out=`` overload); the phase runs (the first op
    of each run of forward or backward ops); the first op that showed each storage that existed
    before the trace (the only ones whose first sighting matters); the storages AccumulateGrad
    wrote. The caller that moves a storage's ``alloc_seq`` says so here too (``move_alloc``)."""

    def __init__(self, tensors: pa.Table, ops: pa.Table, calls: Optional[pa.Table] = None) -> None:
        self.n_ops = n_ops = ops.num_rows
        n = tensors.num_rows
        self.tensors = tensors   # alloc_seq/free_seq read a block of rows at a time (alloc_at, free_at)
        #: rows whose alloc_seq the caller moved (move_alloc), and to where
        self.moved: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        pre, rows_are_ids = [], True
        for lo, b in _batches(tensors, ["storage_id", "alloc_seq"]):   # one block pass: no per-storage arrays
            sid, alloc = _filled(b.column(0), -1), _filled(b.column(1), -1)
            rows_are_ids = rows_are_ids and bool((sid == np.arange(lo, lo + len(sid))).all())
            pre.append(sid[~((alloc >= 0) & (alloc < n_ops)) & (sid >= 0)])
        #: storage id -> row of tensors (-1: none); None when the ids are the rows (a recorded trace)
        self.pos: Optional[np.ndarray] = None
        self.sid: Optional[np.ndarray] = None   # the ids, read whole only when they are not the rows
        if not rows_are_ids:
            self.sid = sid = _ints(tensors.column("storage_id"), -1)
            self.pos = np.full(int(sid.max(initial=-1)) + 1, -1, dtype=np.int64)
            self.pos[sid[sid >= 0]] = np.nonzero(sid >= 0)[0]
        self.npos = len(self.pos) if self.pos is not None else n
        #: storage ids not made by an op of the trace, sorted; the first op that showed each (as an
        #: input or an output) and the first that showed it as an output (``n_ops``: none)
        self.pre = np.unique(np.concatenate(pre)) if pre else np.zeros(0, np.int64)
        self.first = np.full(len(self.pre), n_ops, np.int64)
        self.first_out = np.full(len(self.pre), n_ops, np.int64)
        #: per tensors row, a bit (little-endian within each byte): an op of a module read it
        self.read_in_module = np.zeros((n + 7) // 8, np.uint8)
        self.flags = np.zeros(n_ops, np.uint8)
        grads: list[np.ndarray] = []
        starts: list[int] = []        # first op of each phase run
        run_bwd: list[bool] = []
        self.first_fwd = n_ops        # the first op outside backward
        under = backward_calls(calls)
        outs_needed = _any_out_overload(ops) if n_ops else False
        names = ["phase", "call_id", "autograd_node", "module", "in_storages", "out_storages"]
        if outs_needed:
            names.append("overload")
        for lo, b in _batches(ops, names) if n_ops else ():
            m = b.num_rows
            if m == 0:
                continue
            bwd = _backward_rows(b.column(0), b.column(1), under)
            change = np.nonzero(bwd[1:] != bwd[:-1])[0] + 1
            if not run_bwd or run_bwd[-1] != bool(bwd[0]):
                starts.append(lo)
                run_bwd.append(bool(bwd[0]))
            for k in change.tolist():
                starts.append(lo + k)
                run_bwd.append(bool(bwd[k]))
            if self.first_fwd == n_ops and not bwd.all():
                self.first_fwd = lo + int(np.argmin(bwd))
            acc = _is(b.column(2), lambda v: v.endswith("AccumulateGrad"))
            in_mod = _codes(b.column(3))[0] >= 0
            f = self.flags[lo:lo + m]
            f |= acc.astype(np.uint8) * _ACC
            f |= in_mod.astype(np.uint8) * _MOD
            if outs_needed:
                f |= _is(b.column(6), _out_like).astype(np.uint8) * _OUT
            ins, rows = _flat(b.column(4))
            outs, orow = _flat(b.column(5))
            self._first(ins, rows + lo, self.first)
            self._first(outs, orow + lo, self.first, self.first_out)
            sel = (ins >= 0) & (ins < self.npos) & in_mod[rows]
            r = self._rows(ins[sel])
            r = r[r >= 0]
            np.bitwise_or.at(self.read_in_module, r >> 3, np.left_shift(1, r & 7).astype(np.uint8))
            if acc.any():
                grads.append(outs[acc[orow]])
        self.starts = np.array(starts, np.int64)
        self.run_bwd = np.array(run_bwd, bool)
        self.grads = np.concatenate(grads) if grads else np.zeros(0, np.int64)

    def read_by_module(self, lo: int, hi: int) -> np.ndarray:
        """Per tensors row of ``[lo, hi)``: an op of a module read it (bools, from the bits)."""
        bits = np.unpackbits(self.read_in_module[lo >> 3:(hi + 7) >> 3], bitorder="little")
        out: np.ndarray = bits[lo & 7:(lo & 7) + hi - lo].astype(bool)
        return out

    def _read(self, name: str, lo: int, hi: int, rows: Optional[np.ndarray] = None) -> np.ndarray:
        """Column ``name`` (nulls -1) of rows ``[lo, hi)``, or of ``rows``; moved allocations applied."""
        return read_column(self.tensors, name, lo, hi, rows, self.moved if name == "alloc_seq" else None)

    def alloc_at(self, rows: np.ndarray) -> np.ndarray:
        return self._read("alloc_seq", 0, 0, rows)

    def free_at(self, rows: np.ndarray) -> np.ndarray:
        return self._read("free_seq", 0, 0, rows)

    def move_alloc(self, rows: np.ndarray, seqs: np.ndarray) -> None:
        """``alloc_seq`` of ``rows`` is ``seqs`` from now on (buffers made for an op's ``out=``)."""
        order = np.argsort(rows, kind="stable")
        self.moved = (np.asarray(rows, np.int64)[order], np.asarray(seqs, np.int64)[order])

    def rows_where(self, name: str, pred: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Rows whose ``name`` (alloc_seq/free_seq, nulls -1) satisfies ``pred``, a block at a time."""
        return rows_where(self.tensors, name, pred, _STORAGE_STEP, self.moved if name == "alloc_seq" else None)

    def _rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows of tensors of storage ids in [0, npos) (-1: none)."""
        return self.pos[ids] if self.pos is not None else ids

    def _first(self, vals: np.ndarray, rows: np.ndarray, *into: np.ndarray) -> None:
        """Lower ``into`` (per id of ``pre``) to the first of ``rows`` that showed each such id."""
        if not len(self.pre) or not len(vals):
            return
        ok = (vals >= 0) & (vals < self.npos)
        vals, rows = vals[ok], rows[ok]
        idx = np.minimum(np.searchsorted(self.pre, vals), len(self.pre) - 1)
        hit = self.pre[idx] == vals
        for a in into:
            np.minimum.at(a, idx[hit], rows[hit])

    def first_of(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(first op that showed it, first op that showed it as an output) per tensors row of
        ``rows``; ``n_ops`` where none did or the storage was made by an op of the trace."""
        fs = np.full(len(rows), self.n_ops, np.int64)
        fo = fs.copy()
        if not len(self.pre):
            return fs, fo
        ids = self.sid[rows] if self.sid is not None else rows
        idx = np.minimum(np.searchsorted(self.pre, ids), len(self.pre) - 1)
        hit = (self.pre[idx] == ids) & (ids >= 0)
        fs[hit], fo[hit] = self.first[idx[hit]], self.first_out[idx[hit]]
        return fs, fo

    def run_of(self, seq: np.ndarray) -> np.ndarray:
        """The phase run of each op ``seq`` (in [0, n_ops))."""
        out: np.ndarray = np.searchsorted(self.starts, seq, side="right") - 1
        return out

    def categories(self, lo: int, hi: int) -> np.ndarray:
        """What the lifetimes alone say of tensors rows ``[lo, hi)`` (codes into CATS; see the
        module docstring): input, temporary, activation or other."""
        alloc, free = self._read("alloc_seq", lo, hi), self._read("free_seq", lo, hi)
        n_ops = self.n_ops
        cat = np.full(hi - lo, _CAT["other"], dtype=np.int32)
        made = (alloc >= 0) & (alloc < n_ops)
        cat[~made] = _CAT["input"]
        if n_ops == 0:
            return cat
        a = _clamp(alloc, n_ops - 1)
        f = _clamp(free, n_ops - 1)
        seg_a, seg_f = self.run_of(a), self.run_of(f)
        bwd_a, bwd_f = self.run_bwd[seg_a], self.run_bwd[seg_f]
        freed = made & (free >= 0)
        cat[freed & (seg_a == seg_f)] = _CAT["temporary"]
        saved = freed & ~bwd_a & bwd_f & (seg_f > seg_a)
        # freed at the last op of a backward that accumulated a gradient: released when the backward
        # call returned (an unnamed loss), not by a node (AccumulateGrad saves nothing)
        run_end = np.append(self.starts[1:], n_ops)[seg_f]
        last = bwd_f & (f == run_end - 1)
        saved &= ~(last & ((self.flags[f] & _ACC) != 0))
        cat[saved] = _CAT["activation"]
        # existing before the trace and freed by its backward: saved by a forward run before it; but
        # one first seen in a backward after the trace's own forward and freed in it was made there by
        # code the trace does not see (a recomputation cut short, a compiled backward's buffers)
        pre_freed = ~made & (free >= 0) & bwd_f
        if pre_freed.any():
            rows = np.nonzero(pre_freed)[0]
            fs, _ = self.first_of(rows + lo)
            seen = fs < n_ops
            rows, fs = rows[seen], fs[seen]
            cat[rows] = _CAT["activation"]
            same = (self.run_of(fs) == seg_f[rows]) & (fs > self.first_fwd)
            cat[rows[same]] = _CAT["temporary"]
        # made outside every module, outside backward, read by a module's op: the step's input
        in_mod_a = (self.flags[a] & _MOD) != 0
        cat[made & self.read_by_module(lo, hi) & ~in_mod_a & ~bwd_a] = _CAT["input"]
        return cat


def made_by_out_argument(tensors: pa.Table, ops: pa.Table,
                         lifetimes: Optional[Lifetimes] = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows of ``tensors``, seq) of storages without ``alloc_seq`` first shown as an op's ``out=``
    argument: a buffer made for that op by code the trace does not see (a ``torch.compile``d
    region's kernels allocate their outputs without dispatching an op)."""
    n_ops = ops.num_rows
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    if n_ops == 0 or tensors.num_rows == 0 or not _any_out_overload(ops):
        return empty   # no out= overload ran (most traces): nothing to look up
    lt = lifetimes if lifetimes is not None else Lifetimes(tensors, ops)
    rows = lt.rows_where("alloc_seq", lambda a: a < 0)
    fs, fo = lt.first_of(rows)
    keep = (fs < n_ops) & (fo == fs)
    rows, fs = rows[keep], fs[keep]
    keep = (lt.flags[fs] & _OUT) != 0
    return rows[keep], fs[keep]


def categorize(tensors: pa.Table, ops: pa.Table, calls: Optional[pa.Table] = None,
               known: Optional[Mapping[int, str]] = None, graph_held: Iterable[int] = (),
               optimizer_held: Iterable[int] = (), lifetimes: Optional[Lifetimes] = None) -> pa.Array:
    """The ``tensors.category`` column (dictionary strings, one per row of ``tensors``).

    ``known``: storage id -> parameter / buffer / gradient / optimizer_state; ``graph_held``: ids of
    storages alive at the end that only an autograd graph holds; ``optimizer_held``: ids an
    optimizer holds (both from the leak finder); ``lifetimes``: the pass over ``ops`` already made
    (with ``calls``). Storages are categorised ``_STORAGE_STEP`` rows at a time (``category_blocks``)."""
    n = tensors.num_rows
    cat = np.full(n, _CAT["other"], dtype=np.int32)
    lo = 0
    for block in category_blocks(tensors, ops, calls, known, graph_held, optimizer_held, lifetimes):
        cat[lo:lo + len(block)] = block.indices.to_numpy()
        lo += len(block)
    return _dict_array(cat)


def category_blocks(tensors: pa.Table, ops: pa.Table, calls: Optional[pa.Table] = None,
                    known: Optional[Mapping[int, str]] = None, graph_held: Iterable[int] = (),
                    optimizer_held: Iterable[int] = (), lifetimes: Optional[Lifetimes] = None,
                    lengths: Optional[Iterable[int]] = None) -> Iterator[pa.DictionaryArray]:
    """``categorize``'s column a block of rows at a time, in row order: blocks of
    ``lengths`` rows (a spilled trace writes each to its file as it comes: no array per storage),
    then of ``_STORAGE_STEP``. What overrides the lifetimes (gradients, state, graph-held) is a
    set of rows, sorted once and applied to each block's own rows, in ``categorize``'s order."""
    n = tensors.num_rows
    if n == 0:
        return
    lt = lifetimes if lifetimes is not None else Lifetimes(tensors, ops, calls)

    def rows_of(ids: Iterable[int]) -> np.ndarray:
        a = ids.astype(np.int64) if isinstance(ids, np.ndarray) else np.fromiter((int(i) for i in ids), dtype=np.int64)
        a = a[(a >= 0) & (a < lt.npos)]
        r = lt._rows(a)
        return np.unique(r[r >= 0])

    # what AccumulateGrad wrote is a gradient (also one zero_grad() freed before the end); state
    # outranks what the lifetimes say (CATS is in precedence order)
    held = rows_of(graph_held)
    ranked = [(rows_of(lt.grads), np.int32(_CAT["gradient"])), (rows_of(optimizer_held), np.int32(_CAT["optimizer_state"]))]
    if known:
        ks = np.fromiter(known.keys(), dtype=np.int64, count=len(known))
        kc = np.array([_CAT.get(c, _CAT["other"]) for c in known.values()], dtype=np.int32)
        ok = (ks >= 0) & (ks < lt.npos)
        r = lt._rows(ks[ok])
        kc, r = kc[ok][r >= 0], r[r >= 0]
        order = np.argsort(r, kind="stable")
        ranked.append((r[order], kc[order]))
    steps = iter(lengths if lengths is not None else ())
    lo = 0
    while lo < n:
        hi = min(lo + max(int(next(steps, _STORAGE_STEP)), 0), n)
        if hi == lo:
            continue
        cat = lt.categories(lo, hi)
        h = _within(held, lo, hi)
        if len(h):
            alloc = lt.alloc_at(h)
            h = h[(alloc >= 0) & (alloc < lt.n_ops) & (lt.free_at(h) < 0) & (cat[h - lo] == _CAT["other"])]
            cat[h - lo] = _CAT["activation"]
        for rows, code in ranked:
            a, b = np.searchsorted(rows, lo), np.searchsorted(rows, hi)
            if a < b:
                r = rows[a:b] - lo
                cat[r] = np.minimum(cat[r], code if np.ndim(code) == 0 else code[a:b])
        yield _dict_array(cat)
        lo = hi


def _within(rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The sorted ``rows`` in ``[lo, hi)``."""
    out: np.ndarray = rows[np.searchsorted(rows, lo):np.searchsorted(rows, hi)]
    return out


_CAT_DICT = pa.array(list(CATS), pa.string())


def _dict_array(codes: np.ndarray) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(codes.astype(np.int32, copy=False), _CAT_DICT)


# -- the timeline --------------------------------------------------------------------------------

def memory_timeline(tensors: pa.Table, ops: pa.Table) -> pa.Table:
    """MEMORY_TIMELINE rows: per device, one row per op (seq order), live bytes per category while it runs
    (built a block of ops at a time: ``memory_batches.memory_timeline_batches``)."""
    return pa.Table.from_batches(list(memory_timeline_batches(tensors, ops)), schema=S.MEMORY_TIMELINE).combine_chunks()


def peaks(timeline: pa.Table) -> list[dict[str, Any]]:
    """One dict per device: the timeline's peak row (``is_peak``) as plain values."""
    if timeline.num_rows == 0:
        return []
    rows: list[dict[str, Any]] = timeline.filter(timeline.column("is_peak")).to_pylist()
    return rows


def memory_at(tensors: pa.Table, ops: pa.Table, seq: Optional[int] = None) -> pa.Table:
    """MEMORY_AT rows: storages live while op ``seq`` ran grouped by (device, category, module), largest
    first. ``seq`` None: each device at its own peak."""
    return _memory_at(tensors, ops, seq)


# -- per module ----------------------------------------------------------------------------------

def module_memory(tensors: pa.Table, ops: pa.Table, calls: Optional[pa.Table] = None) -> pa.Table:
    """MODULE_MEMORY rows, largest activations first (see the module docstring; built a block of ops at
    a time: ``memory_batches.module_memory``)."""
    return _module_memory(tensors, ops, calls)
