"""The live-bytes tables built a block of ops at a time (``live_sweep.LiveSweep``): ``memory`` and
``memory_timeline`` as record batches, ``module_memory`` from per-block aggregates.

Each is the whole-table definition (analyses/memory.py, analyses/memory_categories.py) swept in op
blocks: rows device by device (a sweep per device), each block's rows made from one block of live
bytes and the ops' columns of that block. What a builder holds is one block, the events of the
storages alive across it, and (``module_memory``) a few numbers per module: never a column per op
or per storage. ``block``: ops per block; ``step``: storages read at a time.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from .. import schema as S
from .live_sweep import DeviceIndex, LiveSweep, device_names, storage_step
from .memory_columns import (
    _CAT,
    CATS,
    _backward_rows,
    _category_codes,
    _codes,
    _filled,
    _op_columns,
    backward_calls,
    live_mask,
)

__all__ = ["memory_batches", "memory_timeline_batches", "module_memory", "device_peaks", "memory_at", "OP_BLOCK"]

#: ops per block of a sweep
OP_BLOCK = 1 << 14


def _bounds(n: int, block: Optional[int]) -> list[int]:
    """Block edges of ``block`` ops (None: ``OP_BLOCK``) over ``n`` ops."""
    return list(range(0, n, max(1, int(block)) if block else OP_BLOCK)) + [n]


def _string_block(names: list[str], di: int, n: int) -> pa.Array:
    return pa.DictionaryArray.from_arrays(np.full(n, di, np.int32), pa.array(names, pa.string())).cast(pa.string())


def memory_batches(tensors: pa.Table, n_ops: int, block: Optional[int] = None,
                   step: Optional[int] = None) -> Iterator[pa.RecordBatch]:
    """``memory_table(tensors, n_ops)``'s rows as record batches of at most ``block`` rows, in order."""
    n = int(n_ops)
    if n <= 0 or tensors.num_rows == 0:
        return
    sweep = LiveSweep(tensors, n, step=step)
    for di in range(len(sweep.names)):
        prev = int(sweep.baseline[di])
        for a, b, live in (sweep.blocks(_bounds(n, block)) if di == 0 else
                           LiveSweep(tensors, n, step=step).blocks(_bounds(n, block))):
            row = live[di]
            delta = np.empty_like(row)
            delta[0] = row[0] - prev
            delta[1:] = row[1:] - row[:-1]
            prev = int(row[-1])
            yield pa.RecordBatch.from_arrays([pa.array(np.arange(a, b, dtype=np.int64)),
                                              _string_block(sweep.names, di, b - a), pa.array(row),
                                              pa.array(delta)], schema=S.MEMORY)


def memory_timeline_batches(tensors: pa.Table, ops: pa.Table, block: Optional[int] = None,
                            step: Optional[int] = None) -> Iterator[pa.RecordBatch]:
    """``memory_timeline(tensors, ops)``'s rows as record batches of at most ``block`` rows, in order:
    a sweep for each device's peak (the first op with the most live bytes), then one per device."""
    n = ops.num_rows
    if n == 0 or tensors.num_rows == 0:
        return
    names, at, _ = device_peaks(tensors, n, block, step)
    D, C = len(names), len(CATS)
    for di in range(D):
        cats = LiveSweep(tensors, n, categories=True, step=step)
        for a, b, live in cats.blocks(_bounds(n, block)):
            width = b - a
            mine = live[di * C:(di + 1) * C]
            cols: dict[str, Any] = dict(seq=pa.array(np.arange(a, b, dtype=np.int64)),
                                        device=_string_block(names, di, width),
                                        live_bytes=pa.array(mine.sum(axis=0)),
                                        is_peak=pa.array(np.arange(a, b) == at[di]))
            cols.update(_op_columns(ops.slice(a, width), width, np.arange(width)))
            for ci, c in enumerate(CATS):
                cols[f"{c}_bytes"] = pa.array(mine[ci])
            # (the ops' columns of a block may span chunks: one batch of the block's rows)
            yield from pa.Table.from_arrays([cols[f.name] for f in S.MEMORY_TIMELINE],
                                            schema=S.MEMORY_TIMELINE).combine_chunks().to_batches()


def device_peaks(tensors: pa.Table, n_ops: int, block: Optional[int] = None,
                 step: Optional[int] = None) -> tuple[list[str], list[int], list[int]]:
    """(devices, per device the first op during which its live bytes were largest (the timeline's
    ``is_peak`` row), and those bytes), from one sweep."""
    sweep = LiveSweep(tensors, n_ops, step=step)
    best: list[Optional[int]] = [None] * len(sweep.names)
    at = [0] * len(sweep.names)
    for a, _, live in sweep.blocks(_bounds(int(n_ops), block)):
        j = np.argmax(live, axis=1).tolist()
        for di in range(len(best)):
            m = int(live[di, j[di]])
            prev = best[di]
            if prev is None or m > prev:
                best[di], at[di] = m, a + j[di]
    return sweep.names, at, [int(b or 0) for b in best]


# -- per module ----------------------------------------------------------------------------------

class _Names:
    """Global codes of a string column read piece by piece: each chunk's values in the order the
    whole column's dictionary lists them (``memory_categories._codes`` of the combined column)."""

    def __init__(self) -> None:
        self.names: list[Optional[str]] = []
        self.index: dict[Optional[str], int] = {}

    def add(self, values: list[Optional[str]]) -> np.ndarray:
        """Lookup from a piece's dictionary codes to global codes (trailing -1 for a null's code -1)."""
        out = []
        for v in values:
            if v is None:
                out.append(-1)
                continue
            if v not in self.index:
                self.index[v] = len(self.names)
                self.names.append(v)
            out.append(self.index[v])
        return np.array(out + [-1], np.int64)

    def learn(self, col: Any) -> None:
        """Every value of ``col`` in its dictionary order (chunk by chunk), before any piece is read."""
        for chunk in (col.chunks if isinstance(col, pa.ChunkedArray) else [col]):
            if pa.types.is_dictionary(chunk.type):
                self.add(chunk.dictionary.to_pylist())
            else:
                self.add(chunk.unique().to_pylist())

    def codes(self, piece: Any) -> np.ndarray:
        """Global codes (-1: null) of the rows of ``piece`` (an array or chunked array)."""
        parts = []
        for chunk in (piece.chunks if isinstance(piece, pa.ChunkedArray) else [piece]):
            local, values = _codes(chunk)
            parts.append(self.add(values)[local])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def codes_at(self, col: Any, rows: np.ndarray) -> np.ndarray:
        """Global codes of ``col`` at ``rows`` (any order), chunk by chunk (never the column combined)."""
        chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
        out = np.full(len(rows), -1, np.int64)
        offsets = np.cumsum([0] + [len(c) for c in chunks])
        which = np.searchsorted(offsets, rows, side="right") - 1
        for k in np.unique(which).tolist():
            sel = np.nonzero(which == k)[0]
            out[sel] = self.codes(chunks[k].take(pa.array(rows[sel] - offsets[k])))
        return out


def _storage_modules(smods: _Names, module: Any, alloc: np.ndarray, rows: np.ndarray, ops: pa.Table) -> np.ndarray:
    """Global codes (``smods``) of the module of each storage ``rows`` of a chunk (``module``: its
    ``tensors.module``, ``alloc``: its ``alloc_seq``, -1 for null): the module of the op that made it
    (backward ops carry their forward op's), else the one whose op first read it."""
    mc: np.ndarray = smods.codes(module)[rows]
    alloc = alloc[rows]
    made = (alloc >= 0) & (alloc < ops.num_rows)
    if made.any():
        mc[made] = smods.codes_at(ops.column("module"), alloc[made])
    return mc


def memory_at(tensors: pa.Table, ops: pa.Table, seq: Optional[int] = None, step: Optional[int] = None) -> pa.Table:
    """MEMORY_AT rows (analyses/memory_categories.py ``memory_at``): the storages live while op ``seq``
    ran (None: each device's peak) grouped by (device, category, module), largest first; the storages
    read ``step`` at a time, summed per group."""
    n = ops.num_rows
    if n == 0 or tensors.num_rows == 0:
        return S.MEMORY_AT.empty_table()
    if seq is None:
        names, seqs, _ = device_peaks(tensors, n, step=step)
    else:
        names = device_names(tensors, step)
        seqs = [int(seq)] * len(names)
    at = np.array(seqs + [0], np.int64)
    smods = _Names()
    smods.learn(tensors.column("module"))
    smods.learn(ops.column("module"))
    devs = DeviceIndex()
    groups: dict[tuple[int, int, int], list[int]] = {}   # (device, category, module code + 1) -> [bytes, storages]
    for b in tensors.select([c for c in ("device", "nbytes", "alloc_seq", "free_seq", "module", "category")
                             if c in tensors.column_names]).to_batches(max_chunksize=storage_step(step)):
        part = pa.Table.from_batches([b])
        dev = devs.codes(part)
        alloc, free = _filled(b.column(2), -1), _filled(b.column(3), -1)
        alive = np.nonzero(live_mask(alloc, free, at[dev]))[0]   # each storage at its device's op
        if not len(alive):
            continue
        mc = _storage_modules(smods, b.column(4), alloc, alive, ops) + 1
        cat = _category_codes(part)[alive]
        m1 = len(smods.names) + 1   # every name is learnt before the loop: a fixed base
        key = (dev[alive] * len(CATS) + cat) * m1 + mc
        keys, inv = np.unique(key, return_inverse=True)
        sums = np.bincount(inv, weights=_filled(b.column(1), 0)[alive].astype(np.float64)).astype(np.int64)
        counts = np.bincount(inv)
        for k, w, c in zip(keys.tolist(), sums.tolist(), counts.tolist()):
            dc, m = divmod(k, m1)
            g = groups.setdefault((dc // len(CATS), dc % len(CATS), m), [0, 0])
            g[0] += w
            g[1] += c
    out: list[dict[str, Any]] = []
    for di, d in enumerate(names):
        mine = sorted((k, v) for k, v in groups.items() if k[0] == di)
        for (_, ci, m1), (nbytes, count) in sorted(mine, key=lambda kv: -kv[1][0]):   # stable: by key on ties
            out.append(dict(seq=seqs[di], device=d, category=CATS[ci], module=smods.names[m1 - 1] if m1 else None,
                            bytes=nbytes, storages=count))
    return pa.Table.from_pylist(out, schema=S.MEMORY_AT)


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def module_memory(tensors: pa.Table, ops: pa.Table, calls: Optional[pa.Table] = None, block: Optional[int] = None,
                  step: Optional[int] = None) -> pa.Table:
    """MODULE_MEMORY rows, largest activations first (see analyses/memory_categories.py): per module and
    device the ops its forward and backward ran, the peak live bytes while they ran (the first op with
    the most), and the activations its forward ops made; children rolled into parents by path.

    The ops are swept ``block`` at a time: per block and (device, phase, module) the op count and the
    first op with the most live bytes, merged across blocks (a later block's op wins only with more
    bytes); the storages ``step`` at a time for the activations."""
    n = ops.num_rows
    if n == 0 or tensors.num_rows == 0:
        return S.MODULE_MEMORY.empty_table()
    sweep = LiveSweep(tensors, n, step=step)
    names = sweep.names
    D = len(names)
    mods = _Names()
    mods.learn(ops.column("module"))
    under = backward_calls(calls)
    # (device, phase, module code) -> [ops, peak bytes, peak seq]
    groups: dict[tuple[int, int, int], list[int]] = {}
    # no op ran in a module: no block has a group (the sweep is skipped)
    for a, b, live in (sweep.blocks(_bounds(n, block)) if any(v is not None for v in mods.names) else ()):
        part = ops.slice(a, b - a)
        codes = mods.codes(part.column("module"))
        bwd = np.concatenate([np.zeros(0, bool)] + [_backward_rows(pb.column(0), pb.column(1), under)
                                                    for pb in part.select(["phase", "call_id"]).to_batches()])
        for ph, mask in ((0, ~bwd), (1, bwd)):
            sel = np.nonzero((codes >= 0) & mask)[0]
            if not len(sel):
                continue
            c = codes[sel]
            order = np.argsort(c, kind="stable")
            sel, c = sel[order], c[order]
            starts = np.concatenate([[0], np.nonzero(np.diff(c))[0] + 1])
            ends = np.append(starts[1:], len(sel))
            for di in range(D):
                vals = live[di, sel]
                for st, en in zip(starts.tolist(), ends.tolist()):
                    j = st + int(np.argmax(vals[st:en]))
                    v, s = int(vals[j]), a + int(sel[j])
                    g = groups.get((di, ph, int(c[st])))
                    if g is None:
                        groups[(di, ph, int(c[st]))] = [en - st, v, s]
                        continue
                    g[0] += en - st
                    if v > g[1] or (v == g[1] and s < g[2]):
                        g[1], g[2] = v, s
    rows: dict[tuple[str, str], dict[str, Any]] = {}

    def row(m: str, d: str) -> dict[str, Any]:
        r = rows.get((m, d))
        if r is None:
            r = rows[(m, d)] = dict(module=m, device=d, depth=m.count("."), activation_bytes=0,
                                    own_activation_bytes=0, fwd_peak_bytes=None, fwd_peak_seq=None,
                                    bwd_peak_bytes=None, bwd_peak_seq=None, fwd_ops=0, bwd_ops=0)
        return r

    for (di, ph, code), (count, v, s) in sorted(groups.items()):
        path, phase, d = mods.names[code], ("fwd", "bwd")[ph], names[di]
        if path is None:
            continue
        for anc in _ancestors(path):
            r = row(anc, d)
            r[f"{phase}_ops"] += count
            if r[f"{phase}_peak_bytes"] is None or v > r[f"{phase}_peak_bytes"] or (
                    v == r[f"{phase}_peak_bytes"] and s < r[f"{phase}_peak_seq"]):
                r[f"{phase}_peak_bytes"], r[f"{phase}_peak_seq"] = v, s
    # activations: per (device, module that made the storage) the bytes of the activation storages
    smods = _Names()
    smods.learn(tensors.column("module"))
    smods.learn(ops.column("module"))
    act: dict[tuple[int, int], int] = {}
    devs = DeviceIndex()   # the same order as the sweep's names
    for b in tensors.select([c for c in ("device", "nbytes", "alloc_seq", "module", "category")
                             if c in tensors.column_names]).to_batches(max_chunksize=storage_step(step)):
        part = pa.Table.from_batches([b])
        hit = np.nonzero(_category_codes(part) == _CAT["activation"])[0]
        if not len(hit):
            continue
        mc = _storage_modules(smods, b.column(3), _filled(b.column(2), -1), hit, ops)
        dg = devs.codes(part)[hit]
        nb = _filled(b.column(1), 0)[hit]
        has = mc >= 0
        keys, inv = np.unique(dg[has] * (1 << 32) + mc[has], return_inverse=True)
        sums = np.bincount(inv, weights=nb[has].astype(np.float64), minlength=len(keys)).astype(np.int64)
        for k, w in zip(keys.tolist(), sums.tolist()):
            key = (k >> 32, k & 0xFFFFFFFF)
            act[key] = act.get(key, 0) + w
    for (di, code), bsum in sorted(act.items()):
        m = smods.names[code]
        if m is None:
            continue
        d = names[di]
        row(m, d)["own_activation_bytes"] += bsum
        for anc in _ancestors(m):
            row(anc, d)["activation_bytes"] += bsum
    out = sorted(rows.values(), key=lambda r: (-r["activation_bytes"], -(r["fwd_peak_bytes"] or 0), r["module"]))
    return pa.Table.from_pylist(out, schema=S.MODULE_MEMORY)
