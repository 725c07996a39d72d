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

from collections.abc import Iterable, Mapping
from typing import Any, Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .memory import _array, _devices, _filled, _int_column, _sum_by, live_mask, live_matrix

__all__ = ["categorize", "memory_timeline", "memory_at", "module_memory", "BACKWARD_CALLS"]

CATS = S.MEMORY_CATEGORIES
_CAT = {c: i for i, c in enumerate(CATS)}
#: torch-level calls that run autograd's engine: ops they make outside it belong to the backward
BACKWARD_CALLS = frozenset({"torch.Tensor.backward", "Tensor.backward", "torch.autograd.backward",
                            "torch.autograd.grad", "torch.autograd.__init__.backward", "torch.autograd.__init__.grad"})


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


def backward_region(ops: pa.Table, calls: Optional[pa.Table]) -> np.ndarray:
    """Per op: ran in autograd's engine, or under a call that runs it (see the module docstring)."""
    n = ops.num_rows
    if n == 0:
        return np.zeros(0, bool)
    bwd = _is(ops.column("phase"), lambda v: v == "backward")
    if calls is not None and calls.num_rows:
        flag = _is(calls.column("qualname"), lambda v: v in BACKWARD_CALLS)
        if flag.any():
            under = flag.tolist()   # plain lists: one step per call, no numpy scalars
            for i, p in enumerate(_int_column(calls, "parent_id", -1).tolist()):   # parents precede children
                if p >= 0 and under[p]:
                    under[i] = True
            flag = np.array(under, dtype=bool)
            cid = _int_column(ops, "call_id", -1)
            ok = (cid >= 0) & (cid < len(flag))
            bwd[ok] |= flag[cid[ok]]
    return bwd


def _clamp(x: np.ndarray, hi: int) -> np.ndarray:
    """``x`` clipped to [0, hi] (``np.clip``'s dispatch costs more than the two ufuncs on short arrays)."""
    out: np.ndarray = np.minimum(np.maximum(x, 0), hi)
    return out


class Lifetimes:
    """What ``categorize`` and ``made_by_out_argument`` read of ``tensors`` and ``ops``, as numpy,
    converted once: the end of every trace runs both on the same tables. ``alloc`` is writable: the
    caller that moves a storage's ``alloc_seq`` sets it here too."""

    def __init__(self, tensors: pa.Table, ops: pa.Table) -> None:
        self.n_ops = ops.num_rows
        self.sid = sid = _int_column(tensors, "storage_id", -1)
        self.alloc = _int_column(tensors, "alloc_seq", -1)
        self.free = _int_column(tensors, "free_seq", -1)
        #: storage id -> row of tensors (-1: none)
        self.pos = np.full(int(sid.max(initial=-1)) + 1, -1, dtype=np.int64)
        self.pos[sid[sid >= 0]] = np.nonzero(sid >= 0)[0]
        self.ins, self.rows = _flat(ops.column("in_storages"))
        self.outs, self.orow = _flat(ops.column("out_storages"))
        #: per tensors row: the first op that showed the storage, as an input or an output
        self.first = self.first_shown((self.ins, self.rows), (self.outs, self.orow))

    def first_shown(self, *shown: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """Per tensors row: the first op that showed the storage in ``shown`` ((storage ids, op rows)
        of flattened list columns), ``n_ops`` where none did."""
        npos = max(len(self.pos), 1)
        first = np.full(npos, self.n_ops, np.int64)
        for vals, rows in shown:
            ok = (vals >= 0) & (vals < npos)
            np.minimum.at(first, vals[ok], rows[ok])
        has = self.sid >= 0
        got = np.full(len(self.sid), self.n_ops, np.int64)
        got[has] = first[self.sid[has]]
        return got


def _out_like(v: str) -> bool:
    return v == "out" or v.endswith("_out")


def made_by_out_argument(tensors: pa.Table, ops: pa.Table,
                         lifetimes: Optional[Lifetimes] = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows of ``tensors``, seq) of storages without ``alloc_seq`` first shown as an op's ``out=``
    argument: a buffer made for that op by code the trace does not see (a ``torch.compile``d
    region's kernels allocate their outputs without dispatching an op)."""
    n_ops = ops.num_rows
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    if n_ops == 0 or tensors.num_rows == 0:
        return empty
    overload = _array(ops.column("overload"))
    if pa.types.is_dictionary(overload.type) and not any(
            v is not None and _out_like(v) for v in overload.dictionary.to_pylist()):
        return empty   # no out= overload ran (most traces): nothing to look up
    out_variant = _is(overload, _out_like)
    lt = lifetimes if lifetimes is not None else Lifetimes(tensors, ops)
    fs, fo = lt.first, lt.first_shown((lt.outs, lt.orow))
    rows = np.nonzero((lt.alloc < 0) & (fs < n_ops) & (fo == fs) & out_variant[np.minimum(fs, n_ops - 1)])[0]
    return rows, fs[rows]


def categorize(tensors: pa.Table, ops: pa.Table, calls: Optional[pa.Table] = None,
               known: Optional[Mapping[int, str]] = None, graph_held: Iterable[int] = (),
               optimizer_held: Iterable[int] = (), lifetimes: Optional[Lifetimes] = None) -> pa.Array:
    """The ``tensors.category`` column (dictionary strings, one per row of ``tensors``).

    ``known``: storage id -> parameter / buffer / gradient / optimizer_state; ``graph_held``: ids of
    storages alive at the end that only an autograd graph holds; ``optimizer_held``: ids an
    optimizer holds (both from the leak finder); ``lifetimes``: the columns already converted."""
    n = tensors.num_rows
    cat = np.full(n, _CAT["other"], dtype=np.int32)
    if n == 0:
        return _dict_array(cat)
    lt = lifetimes if lifetimes is not None else Lifetimes(tensors, ops)
    pos, alloc, free = lt.pos, lt.alloc, lt.free

    def rows_of(ids: Iterable[int]) -> np.ndarray:
        a = ids.astype(np.int64) if isinstance(ids, np.ndarray) else np.fromiter((int(i) for i in ids), dtype=np.int64)
        a = a[(a >= 0) & (a < len(pos))]
        r = pos[a]
        return r[r >= 0]

    n_ops = lt.n_ops
    made = (alloc >= 0) & (alloc < n_ops)
    cat[~made] = _CAT["input"]
    grads = np.zeros(0, np.int64)
    if n_ops:
        bwd = backward_region(ops, calls)
        seg = np.zeros(n_ops, np.int64)   # the phase run of each op
        np.cumsum(bwd[1:] != bwd[:-1], out=seg[1:])
        ins, rows, outs, orow = lt.ins, lt.rows, lt.outs, lt.orow
        acc = _is(ops.column("autograd_node"), lambda v: v.endswith("AccumulateGrad"))
        # the op that first showed each storage (as input or output)
        fs = lt.first
        seen = fs < n_ops
        fsc = np.minimum(fs, n_ops - 1)
        a = _clamp(alloc, n_ops - 1)
        f = _clamp(free, n_ops - 1)
        freed = made & (free >= 0)
        seg_a, seg_f, bwd_a, bwd_f = seg[a], seg[f], bwd[a], bwd[f]
        cat[freed & (seg_a == seg_f)] = _CAT["temporary"]
        saved = freed & ~bwd_a & bwd_f & (seg_f > seg_a)
        # freed at the last op of a backward that accumulated a gradient: released when the backward
        # call returned (an unnamed loss), not by a node (AccumulateGrad saves nothing)
        last = np.zeros(n_ops, bool)
        last[:-1] = bwd[:-1] & ~bwd[1:]
        last[-1] = bwd[-1]
        saved &= ~(last[f] & acc[f])
        cat[saved] = _CAT["activation"]
        # existing before the trace and freed by its backward: saved by a forward run before it; but
        # one first seen in a backward after the trace's own forward and freed in it was made there by
        # code the trace does not see (a recomputation cut short, a compiled backward's buffers)
        fwd_before = np.zeros(n_ops, bool)
        fwd_before[1:] = np.logical_or.accumulate(~bwd)[:-1]
        pre_freed = ~made & seen & (free >= 0) & bwd_f
        cat[pre_freed] = _CAT["activation"]
        cat[pre_freed & (seg[fsc] == seg_f) & fwd_before[fsc]] = _CAT["temporary"]
        # made outside every module, outside backward, read by a module's op: the step's input
        mod_codes, _ = _codes(ops.column("module"))
        m = (ins >= 0) & (ins < len(pos)) & (mod_codes[rows] >= 0)
        r = pos[ins[m]]
        r_in = np.zeros(n, bool)
        r_in[r[r >= 0]] = True
        cat[made & r_in & (mod_codes[a] < 0) & ~bwd_a] = _CAT["input"]
        # what AccumulateGrad wrote is a gradient (also one zero_grad() freed before the end)
        if acc.any():
            grads = rows_of(outs[acc[orow]])
    held = rows_of(graph_held)
    if len(held):
        held = held[made[held] & (free[held] < 0) & (cat[held] == _CAT["other"])]
        cat[held] = _CAT["activation"]
    # state outranks what the lifetimes say (CATS is in precedence order)
    for r, c in ((grads, "gradient"), (rows_of(optimizer_held), "optimizer_state")):
        if len(r):
            cat[r] = np.minimum(cat[r], _CAT[c])
    if known:
        ks = np.fromiter(known.keys(), dtype=np.int64, count=len(known))
        kc = np.array([_CAT.get(c, _CAT["other"]) for c in known.values()], dtype=np.int32)
        ok = (ks >= 0) & (ks < len(pos))
        r = pos[ks[ok]]
        kc = kc[ok][r >= 0]
        r = r[r >= 0]
        cat[r] = np.minimum(cat[r], kc)
    return _dict_array(cat)


_CAT_DICT = pa.array(list(CATS), pa.string())


def _dict_array(codes: np.ndarray) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(codes.astype(np.int32, copy=False), _CAT_DICT)


# -- the timeline --------------------------------------------------------------------------------

def _category_codes(tensors: pa.Table) -> np.ndarray:
    """Index into CATS per row (``other`` where null: a trace of an older schema)."""
    if "category" not in tensors.column_names:
        return np.full(tensors.num_rows, _CAT["other"], np.int64)
    codes, values = _codes(tensors.column("category"))
    lut = np.array([_CAT.get(v or "other", _CAT["other"]) for v in values] + [_CAT["other"]], dtype=np.int64)
    out: np.ndarray = lut[codes]
    return out


def _live(tensors: pa.Table, n_ops: int) -> tuple[list[str], np.ndarray]:
    """(devices, live[d, c, s]): bytes of category c on device d live while op s runs (``live_mask``)."""
    nbytes = _int_column(tensors, "nbytes", 0)
    alloc = _int_column(tensors, "alloc_seq", -1)
    free = _int_column(tensors, "free_seq", -1)
    names, dev = _devices(tensors)
    cat = _category_codes(tensors)
    D, C = len(names), len(CATS)
    live, _ = live_matrix(dev * C + cat, nbytes, alloc, free, D * C, n_ops)
    return names, live.reshape(D, C, n_ops)


def _op_columns(ops: pa.Table, n: int, rows: np.ndarray) -> dict[str, pa.Array]:
    """The op's columns of each timeline row (``rows``: its seq); read in place, not gathered, when the
    rows are every op once (one device)."""
    every = len(rows) == n
    idx = None if every else pa.array(rows)
    out: dict[str, pa.Array] = {}
    for name in ("op", "phase", "module", "source_file", "source_line"):
        col = ops.column(name) if idx is None else ops.column(name).take(idx)
        out[name] = S.plain_strings(pa.table({name: col})).column(name)
    return out


def _repeated(names: list[str], n: int) -> pa.Array:
    """Each of ``names`` ``n`` times, as one string array (through a dictionary: no string per row in Python)."""
    codes = np.repeat(np.arange(len(names), dtype=np.int32), n)
    return pa.DictionaryArray.from_arrays(codes, pa.array(names, pa.string())).cast(pa.string())


def memory_timeline(tensors: pa.Table, ops: pa.Table) -> pa.Table:
    """MEMORY_TIMELINE rows: per device, one row per op (seq order), live bytes per category while it runs."""
    n_ops = ops.num_rows
    if n_ops == 0 or tensors.num_rows == 0:
        return S.MEMORY_TIMELINE.empty_table()
    names, live = _live(tensors, n_ops)
    D = len(names)
    total = live.sum(axis=1)
    peak = np.zeros((D, n_ops), bool)
    peak[np.arange(D), np.argmax(total, axis=1)] = True
    rows = np.tile(np.arange(n_ops, dtype=np.int64), D)
    opc = _op_columns(ops, n_ops, rows)
    cols: dict[str, Any] = dict(seq=pa.array(rows), device=_repeated(names, n_ops),
                                live_bytes=pa.array(total.reshape(-1)), is_peak=pa.array(peak.reshape(-1)))
    cols.update(opc)
    for ci, c in enumerate(CATS):
        cols[f"{c}_bytes"] = pa.array(live[:, ci, :].reshape(-1))
    return pa.Table.from_arrays([cols[f.name] for f in S.MEMORY_TIMELINE], schema=S.MEMORY_TIMELINE)


def peaks(timeline: pa.Table) -> list[dict[str, Any]]:
    """One dict per device: the timeline's peak row (``is_peak``) as plain values."""
    if timeline.num_rows == 0:
        return []
    rows: list[dict[str, Any]] = timeline.filter(timeline.column("is_peak")).to_pylist()
    return rows


def storage_modules(tensors: pa.Table, ops: pa.Table) -> tuple[np.ndarray, list[Optional[str]]]:
    """(per storage an index into the names, -1 for none; names): the module that made it (the
    op's module: backward ops carry their forward op's), or for one the trace did not make, the
    module whose op first read it. Vectorised: one lookup table per dictionary."""
    names: list[Optional[str]] = []
    index: dict[Optional[str], int] = {}

    def lut(values: list[Optional[str]]) -> np.ndarray:
        return np.array([-1 if v is None else index.setdefault(v, len(index)) for v in values] + [-1],
                        dtype=np.int64)

    tcodes, tvals = _codes(tensors.column("module"))
    codes = lut(tvals)[tcodes]
    if ops.num_rows:
        alloc = _int_column(tensors, "alloc_seq", -1)
        made = (alloc >= 0) & (alloc < ops.num_rows)
        if made.any():
            ocodes, ovals = _codes(ops.column("module"))
            codes[made] = lut(ovals)[ocodes[alloc[made]]]
    names = [None] * len(index)
    for v, i in index.items():
        names[i] = v
    return codes, names


def memory_at(tensors: pa.Table, ops: pa.Table, seq: Optional[int] = None) -> pa.Table:
    """MEMORY_AT rows: storages live while op ``seq`` ran grouped by (device, category, module), largest
    first. ``seq`` None: each device at its own peak."""
    n_ops = ops.num_rows
    if n_ops == 0 or tensors.num_rows == 0:
        return S.MEMORY_AT.empty_table()
    names, dev = _devices(tensors)
    if seq is None:
        tl = memory_timeline(tensors, ops)
        at = {p["device"]: p["seq"] for p in peaks(tl)}
    else:
        at = {d: int(seq) for d in names}
    nbytes = _int_column(tensors, "nbytes", 0)
    alloc = _int_column(tensors, "alloc_seq", -1)
    free = _int_column(tensors, "free_seq", -1)
    cat = _category_codes(tensors)
    mcodes, mnames = storage_modules(tensors, ops)
    M = len(mnames) + 1
    out: list[dict[str, Any]] = []
    for di, d in enumerate(names):
        s = at.get(d)
        if s is None:
            continue
        alive = np.nonzero((dev == di) & live_mask(alloc, free, s))[0]
        if not len(alive):
            continue
        key = cat[alive] * M + (mcodes[alive] + 1)
        keys, inv = np.unique(key, return_inverse=True)
        sums = np.bincount(inv, weights=nbytes[alive].astype(np.float64)).astype(np.int64)
        counts = np.bincount(inv)
        for k in np.argsort(-sums, kind="stable").tolist():
            mi = int(keys[k] % M) - 1
            out.append(dict(seq=s, device=d, category=CATS[int(keys[k] // M)],
                            module=mnames[mi] if mi >= 0 else None, bytes=int(sums[k]), storages=int(counts[k])))
    return pa.Table.from_pylist(out, schema=S.MEMORY_AT)


# -- per module ----------------------------------------------------------------------------------

def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def module_memory(tensors: pa.Table, ops: pa.Table, calls: Optional[pa.Table] = None) -> pa.Table:
    """MODULE_MEMORY rows, largest activations first (see the module docstring)."""
    n_ops = ops.num_rows
    if n_ops == 0 or tensors.num_rows == 0:
        return S.MODULE_MEMORY.empty_table()
    # live bytes per device while each op runs (every category at once: one row per device, not per category)
    names, dev = _devices(tensors)
    total, _ = live_matrix(dev, _int_column(tensors, "nbytes", 0), _int_column(tensors, "alloc_seq", -1),
                           _int_column(tensors, "free_seq", -1), len(names), n_ops)   # [device, seq]
    mcodes, mvalues = _codes(ops.column("module"))
    bwd = backward_region(ops, calls)
    rows: dict[tuple[str, str], dict[str, Any]] = {}

    def row(m: str, d: str) -> dict[str, Any]:
        r = rows.get((m, d))
        if r is None:
            r = rows[(m, d)] = dict(module=m, device=d, depth=m.count("."), activation_bytes=0,
                                    own_activation_bytes=0, fwd_peak_bytes=None, fwd_peak_seq=None,
                                    bwd_peak_bytes=None, bwd_peak_seq=None, fwd_ops=0, bwd_ops=0)
        return r

    has = mcodes >= 0
    for di, d in enumerate(names):
        for phase, mask in (("fwd", ~bwd), ("bwd", bwd)):
            sel = np.nonzero(has & mask)[0]
            if not len(sel):
                continue
            codes = mcodes[sel]
            order = np.lexsort((sel, codes))
            sel, codes = sel[order], codes[order]
            starts = np.concatenate([[0], np.nonzero(np.diff(codes))[0] + 1])
            vals = total[di, sel]
            for k, st in enumerate(starts.tolist()):
                end = int(starts[k + 1]) if k + 1 < len(starts) else len(sel)
                j = st + int(np.argmax(vals[st:end]))
                path = mvalues[int(codes[st])]
                if path is None:
                    continue
                for anc in _ancestors(path):
                    r = row(anc, d)
                    r[f"{phase}_ops"] += end - st
                    b = int(vals[j])
                    if r[f"{phase}_peak_bytes"] is None or b > r[f"{phase}_peak_bytes"] or (
                            b == r[f"{phase}_peak_bytes"] and int(sel[j]) < r[f"{phase}_peak_seq"]):
                        r[f"{phase}_peak_bytes"], r[f"{phase}_peak_seq"] = b, int(sel[j])
    _, dev = _devices(tensors)
    cat = _category_codes(tensors)
    act = np.nonzero(cat == _CAT["activation"])[0]
    if len(act):
        mcodes, mnames = storage_modules(tensors, ops)
        nbytes = _int_column(tensors, "nbytes", 0)
        act = act[mcodes[act] >= 0]
        M = len(mnames)
        key = dev[act] * M + mcodes[act]
        keys, inv = np.unique(key, return_inverse=True)
        sums = np.bincount(inv, weights=nbytes[act].astype(np.float64)).astype(np.int64)
        for k, b in zip(keys.tolist(), sums.tolist()):
            m, d = mnames[k % M], names[k // M]
            if m is None:
                continue
            row(m, d)["own_activation_bytes"] += b
            for anc in _ancestors(m):
                row(anc, d)["activation_bytes"] += b
    out = sorted(rows.values(), key=lambda r: (-r["activation_bytes"], -(r["fwd_peak_bytes"] or 0), r["module"]))
    return pa.Table.from_pylist(out, schema=S.MODULE_MEMORY)


# -- the timeline's digest: what the summary reads of it, in bounded memory ------------------------

def memory_digest(tensors: pa.Table, ops: pa.Table, columns: int, block: int = 1 << 16) -> dict[str, Any]:
    """What the summary reads of ``memory_timeline`` and ``memory``, without building either: per device
    the peak (the timeline's ``is_peak`` row and ``memory_peak``'s tie-break past bookkeeping ops), the
    bytes before the first op and during the last, and the rows the memory chart draws on ``columns``
    pixel columns (render/svg_memory.py: per column the op with the most live bytes, the first such).

    The ops are swept in blocks of about ``block`` (whole chart columns): what it holds is one block
    of live bytes per (device, category) and the storages' events, whatever the op count. Equal to
    reading the same from ``memory_timeline(tensors, ops)`` (tests/analyses/test_memory_digest.py).
    """
    n = ops.num_rows
    if n == 0 or tensors.num_rows == 0:
        return {"n": 0, "devices": []}
    nbytes = _int_column(tensors, "nbytes", 0)
    alloc = _int_column(tensors, "alloc_seq", -1)
    free = _int_column(tensors, "free_seq", -1)
    names, dev = _devices(tensors)
    cat = _category_codes(tensors)
    D, C = len(names), len(CATS)
    K = D * C
    key = dev * C + cat
    pre = alloc < 0
    baseline = _sum_by(key[pre], nbytes[pre], K)
    # the events (``live_matrix``'s rule): +bytes at the op that made a storage, -bytes after the op it died in
    made = ~pre & (alloc < n)
    freed = (free >= 0) & (free + 1 < n)
    ev_seq = np.concatenate([alloc[made], free[freed] + 1])
    order = np.argsort(ev_seq, kind="stable")
    ev_seq = ev_seq[order]
    ev_key = np.concatenate([key[made], key[freed]])[order]
    ev_w = np.concatenate([nbytes[made], -nbytes[freed]]).astype(np.float64)[order]
    del order, made, freed, pre
    edges = np.linspace(0, n, columns + 1).astype(np.int64) if n > columns else np.arange(n + 1, dtype=np.int64)
    edges = edges[np.concatenate(([True], edges[1:] > edges[:-1]))]   # empty columns draw nothing
    per = max(1, block // max(1, n // max(len(edges) - 1, 1)))
    bounds = edges[::per].tolist()
    if bounds[-1] != n:
        bounds.append(n)
    has_noise = "is_noise" in ops.column_names
    running = baseline.copy()
    best: list[Optional[int]] = [None] * D
    best_seq = [0] * D
    best_cats: list[Any] = [None] * D
    named: list[Optional[int]] = [None] * D
    drawn: list[list[np.ndarray]] = [[] for _ in range(D)]
    drawn_live: list[list[np.ndarray]] = [[] for _ in range(D)]
    end = np.zeros(D, np.int64)
    for a, b in zip(bounds[:-1], bounds[1:]):
        width = b - a
        lo, hi = np.searchsorted(ev_seq, [a, b], side="left").tolist()
        d = np.bincount(ev_key[lo:hi] * width + (ev_seq[lo:hi] - a), weights=ev_w[lo:hi],
                        minlength=K * width).astype(np.int64).reshape(K, width)
        np.cumsum(d, axis=1, out=d)
        d += running[:, None]
        running = d[:, -1].copy()
        live3 = d.reshape(D, C, width)
        tot = live3.sum(axis=1)
        end = tot[:, -1].copy()
        noise = (pc.fill_null(ops.column("is_noise").slice(a, width), False).to_numpy(zero_copy_only=False)
                 .astype(bool) if has_noise else None)
        cut = edges[(edges >= a) & (edges < b)] - a
        lens = np.diff(np.append(cut, width))
        pos = np.arange(width)
        for di in range(D):
            row = tot[di]
            j = int(np.argmax(row))
            m = int(row[j])
            prev = best[di]
            if prev is None or m > prev:
                best[di], best_seq[di], best_cats[di], named[di] = m, a + j, live3[di, :, j].copy(), None
            if m == best[di] and named[di] is None and noise is not None:
                ok = np.flatnonzero((row == m) & ~noise)
                named[di] = a + int(ok[0]) if len(ok) else None
            segmax = np.maximum.reduceat(row, cut)
            first = np.minimum.reduceat(np.where(row == np.repeat(segmax, lens), pos, width), cut)
            drawn[di].append(a + first)
            drawn_live[di].append(live3[di][:, first])
    out = []
    for di, name in enumerate(names):
        out.append({"device": name, "peak_bytes": int(best[di] or 0), "peak_seq": int(best_seq[di]),
                    "peak_categories": np.asarray(best_cats[di], np.int64), "named_peak_seq": named[di],
                    "start_bytes": int(baseline[di * C:(di + 1) * C].sum()), "end_bytes": int(end[di]),
                    "drawn": np.concatenate(drawn[di]), "drawn_live": np.concatenate(drawn_live[di], axis=1)})
    return {"n": n, "devices": out, "has_noise": has_noise}


def digest_peaks(digest: Mapping[str, Any], ops: pa.Table) -> list[dict[str, Any]]:
    """``peaks(memory_timeline(tensors, ops))`` from a ``memory_digest``: each device's peak row."""
    rows = []
    for p in digest["devices"]:
        s = p["peak_seq"]
        opc = _op_columns(ops, digest["n"], np.array([s], np.int64))
        r: dict[str, Any] = {"seq": s, "device": p["device"]}
        r.update({k: v[0].as_py() for k, v in opc.items()})
        r["live_bytes"] = p["peak_bytes"]
        r.update({f"{c}_bytes": int(p["peak_categories"][ci]) for ci, c in enumerate(CATS)})
        r["is_peak"] = True
        rows.append({f.name: r[f.name] for f in S.MEMORY_TIMELINE})
    return rows


def digest_memory_peak(digest: Mapping[str, Any], ops: pa.Table, tensors: pa.Table) -> Optional[dict[str, dict[str, Any]]]:
    """``analyses.memory.memory_peak(memory_table(tensors, n), ops, tensors)`` from a ``memory_digest``;
    None where it cannot say the same (storages naming ops past the last: read the tables then)."""
    out: dict[str, dict[str, Any]] = {}
    if not digest["devices"]:
        return out
    n = digest["n"]
    alloc = _int_column(tensors, "alloc_seq", -1)
    free = _int_column(tensors, "free_seq", -1)
    last = int(max(alloc.max(initial=-1), free.max(initial=-1)))
    if last >= n:
        return None
    noise_col = ops.column("is_noise") if digest.get("has_noise") else None
    for p in digest["devices"]:
        s = p["peak_seq"] if p["named_peak_seq"] is None else p["named_peak_seq"]
        info: dict[str, Any] = {"peak_bytes": p["peak_bytes"], "peak_seq": s, "start_bytes": p["start_bytes"],
                                "end_bytes": p["end_bytes"]}
        if noise_col is None or not noise_col[s].as_py():
            info["peak_op"] = ops.column("op")[s].as_py()
        if last >= 0:   # the high-water mark: the same rule over the ops the storages name (0..last)
            info["high_water_bytes"], info["high_water_seq"] = p["peak_bytes"], p["peak_seq"]
        out[p["device"]] = info
    return out
