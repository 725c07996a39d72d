"""Live bytes per op in bounded memory: one sweep of the ops in blocks, the storages read a chunk at a time.

Every live-bytes view (``memory``, ``memory_timeline``, ``module_memory``, the summary's
``memory_digest``) is the same rule (``memory.live_mask``): a storage counts from the op that made it
(``alloc_seq``; before the first op when null) to the op it died in (``free_seq``; the end when
null). As events: +bytes at ``alloc_seq``, -bytes at ``free_seq + 1``. ``LiveSweep`` turns the
``tensors`` table into those events and hands them out op block by op block, so a caller holds one
block of live bytes per key (device, or device and category) and the events not yet reached,
never a column of the storages nor an array per op.

Bounded because a recorded trace lists its storages in the order the ops first showed them: the
``alloc_seq`` of the storages an op made never decreases down the table, so the storages made before
the end of a block are a prefix of the rows not yet read. What is carried from one block to the
next is the free events of storages alive across it (bounded by what was alive, not by the op count)
and the pre-trace storages' frees (read in a first pass, with the baseline). A table not in that
order (not one this package records) is read whole into the carried events: the same results.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Optional

import numpy as np
import pyarrow as pa

from .memory_columns import CATS, _category_codes, _devices, _filled

__all__ = ["LiveSweep", "STORAGE_STEP", "storage_step", "DeviceIndex", "device_names"]

#: storages (tensors rows) read at a time
STORAGE_STEP = 1 << 14


def storage_step(step: Optional[int] = None) -> int:
    """Storages read at a time: ``step``, or ``STORAGE_STEP`` when None."""
    return max(1, int(step)) if step else STORAGE_STEP


class DeviceIndex:
    """Device codes of storages read a chunk at a time: each chunk's devices (``memory._devices`` of the
    chunk) merged in the order the chunks first list them (``_devices`` of the whole table)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._index: dict[str, int] = {}

    def codes(self, part: pa.Table) -> np.ndarray:
        """Per row of ``part`` (a table with a ``device`` column) the index of its device in ``names``."""
        cnames, dev = _devices(part)
        for v in cnames:
            if v not in self._index:
                self._index[v] = len(self.names)
                self.names.append(v)
        out: np.ndarray = np.array([self._index[v] for v in cnames] + [0], np.int64)[dev]
        return out


def device_names(tensors: pa.Table, step: Optional[int] = None) -> list[str]:
    """The devices ``memory._devices(tensors)`` names, read ``step`` storages at a time."""
    devs = DeviceIndex()
    for b in tensors.select(["device"]).to_batches(max_chunksize=storage_step(step)):
        devs.codes(pa.Table.from_batches([b]))
    return devs.names


class LiveSweep:
    """The ``tensors`` table's storages as live-bytes events over ``n_ops`` ops (module docstring).

    ``categories``: the key of a storage is (device, category) (``key = device * C + category``,
    C = len(MEMORY_CATEGORIES)), else the device alone. After construction (one pass over the
    storages): ``names`` (devices, the order ``memory._devices`` gives), ``K`` keys, ``baseline[K]``
    (bytes before the first op), ``last`` (the largest op any storage names, -1: none)."""

    def __init__(self, tensors: pa.Table, n_ops: int, categories: bool = False,
                 step: Optional[int] = None) -> None:
        self.tensors, self.n, self.step = tensors, int(n_ops), storage_step(step)
        self.C = len(CATS) if categories else 1
        self.categories = categories
        self._devices = DeviceIndex()
        self.names = self._devices.names
        self.last = -1
        self.ordered = True
        #: the storages' one chunk when the table is at most ``step`` rows (a small trace): read once,
        #: kept for ``blocks`` (32 B a storage, at most ``step`` of them); None: read again each pass
        self._one: Optional[list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = None
        base: list[np.ndarray] = []
        pre_ev: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        frontier = -1
        for key, nbytes, alloc, free in self._chunks():
            self.last = max(self.last, int(alloc.max(initial=-1)), int(free.max(initial=-1)))
            pre = alloc < 0
            base.append(np.stack([key[pre], nbytes[pre]]))
            fr = pre & (free >= 0) & (free + 1 < self.n)
            pre_ev.append((free[fr] + 1, key[fr], -nbytes[fr]))
            made = alloc[(alloc >= 0) & (alloc < self.n)]
            if len(made) and (made[0] < frontier or bool((made[1:] < made[:-1]).any())):
                self.ordered = False
            if len(made):
                frontier = int(made[-1])
            both = (alloc >= 0) & (free >= 0)
            if bool((free[both] < alloc[both]).any()):
                self.ordered = False
        self.K = len(self.names) * self.C
        kb = np.concatenate(base, axis=1) if base else np.zeros((2, 0), np.int64)
        self.baseline = np.bincount(kb[0], weights=kb[1].astype(np.float64),
                                    minlength=self.K)[:self.K].astype(np.int64) if kb.shape[1] else \
            np.zeros(self.K, np.int64)
        self._pre = tuple(np.concatenate([e[i] for e in pre_ev]) if pre_ev else np.zeros(0, np.int64)
                          for i in range(3))

    def _chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """(key, nbytes, alloc (-1: null), free (-1: null)) per chunk of ``step`` storages, in row order;
        a table of one chunk is read once (``_one``), the sweep's passes share it."""
        if self._one is not None:
            return iter(self._one)
        if self.tensors.num_rows <= self.step:
            self._one = list(self._read_chunks())
            return iter(self._one)
        return self._read_chunks()

    def _read_chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        t = self.tensors
        cols = ["device", "nbytes", "alloc_seq", "free_seq"]
        if self.categories and "category" in t.column_names:
            cols.append("category")
        for b in t.select(cols).to_batches(max_chunksize=self.step):
            if b.num_rows == 0:
                continue
            part = pa.Table.from_batches([b])
            key = self._devices.codes(part)
            if self.categories:
                key = key * self.C + _category_codes(part)
            yield (key, _filled(b.column(1), 0), _filled(b.column(2), -1), _filled(b.column(3), -1))

    def blocks(self, bounds: Sequence[int]) -> Iterator[tuple[int, int, np.ndarray]]:
        """(a, b, live[K, b - a]) per op block ``[a, b)`` of ``bounds`` (increasing, from 0): the bytes of
        each key live while each op of the block runs."""
        K, n = self.K, self.n
        ev_seq, ev_key, ev_w = self._pre
        chunks: Optional[Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = self._chunks()
        frontier = -1

        def add(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
            nonlocal ev_seq, ev_key, ev_w
            ev_seq = np.concatenate([ev_seq] + [p[0] for p in parts])
            ev_key = np.concatenate([ev_key] + [p[1] for p in parts])
            ev_w = np.concatenate([ev_w] + [p[2] for p in parts])

        def events(key: np.ndarray, nbytes: np.ndarray, alloc: np.ndarray,
                   free: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
            made = (alloc >= 0) & (alloc < n)
            freed = made & (free >= 0) & (free + 1 < n)
            return [(alloc[made], key[made], nbytes[made]), (free[freed] + 1, key[freed], -nbytes[freed])]

        if not self.ordered:   # not in first-sighting order: every event at once, in seq order
            add([e for c in self._chunks() for e in events(*c)])
            order = np.argsort(ev_seq, kind="stable")
            ev_seq, ev_key, ev_w = ev_seq[order], ev_key[order], ev_w[order]
            del order
            chunks = None
        running = self.baseline.copy()
        for a, b in zip(bounds[:-1], bounds[1:]):
            if chunks is not None:
                got: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
                while frontier < b:
                    c = next(chunks, None)
                    if c is None:
                        chunks = None
                        break
                    alloc = c[2]
                    made = alloc[(alloc >= 0) & (alloc < n)]
                    if len(made):
                        frontier = int(made[-1])
                    got.extend(events(*c))
                if got:
                    add(got)
            width = b - a
            if not self.ordered:   # sorted: the block's events are a prefix
                hi = int(np.searchsorted(ev_seq, b, side="left"))
                s_now, k_now, w_now = ev_seq[:hi], ev_key[:hi], ev_w[:hi]
                ev_seq, ev_key, ev_w = ev_seq[hi:], ev_key[hi:], ev_w[hi:]
                now = None
            else:   # the events of this block (none is before it: earlier blocks took theirs)
                now = ev_seq < b
            if now is None:
                pass
            elif now.all():
                s_now, k_now, w_now = ev_seq, ev_key, ev_w
                ev_seq, ev_key, ev_w = ev_seq[:0], ev_key[:0], ev_w[:0]
            else:
                s_now, k_now, w_now = ev_seq[now], ev_key[now], ev_w[now]
                later = ~now
                ev_seq, ev_key, ev_w = ev_seq[later], ev_key[later], ev_w[later]
            # (bincount's float64 sums are exact below 2**53 bytes)
            d = np.bincount(k_now * width + (s_now - a), weights=w_now.astype(np.float64),
                            minlength=K * width)[:K * width].astype(np.int64).reshape(K, width)
            del s_now, k_now, w_now
            np.cumsum(d, axis=1, out=d)
            d += running[:, None]
            running = d[:, -1].copy() if width else running
            yield a, b, d
