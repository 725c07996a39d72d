"""Memory over time: live bytes per device while each op runs, from the storages' alloc/free events.

A pure function of the ``tensors`` table (one row per storage the trace saw):
``alloc_seq`` is the op whose output first showed the storage (null: it existed
before the trace and was first seen as an input), ``free_seq`` the last op that
started before it died (null: alive at the end). A storage is live *while* op ``s``
runs when ``alloc_seq <= s <= free_seq`` (``live_mask``, the one rule every timeline
here uses): an op's inputs count until it returns, also those that die when it
does (``relu(a * 2)``: the product is live while relu writes its result), and an
output freed right away counts during the op that made it. One that existed before
the trace counts from the start. So ``live_bytes`` is the memory of the storages
this trace saw, not the allocator's total (memory it never touched is not in the
table); each storage's bytes count once, however many views share it. It is what
torch.profiler's ``profile_memory`` allocation events give for the same storages.

``memory_peak`` reads the result: the largest ``live_bytes`` per device and the op
during which it happened.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .live_sweep import DeviceIndex, device_names, storage_step
from .memory_batches import device_peaks, memory_batches
from .memory_columns import _array, _devices, _filled, _int_column, live_mask  # noqa: F401  (read here by name)

__all__ = ["memory_table", "memory_peak", "live_mask"]


def memory_devices(tensors: pa.Table) -> int:
    """How many devices ``_devices(tensors)`` names (each has a row per op in ``memory``), read a
    chunk of storages at a time."""
    return len(device_names(tensors))


def memory_table(tensors: pa.Table, n_ops: int) -> pa.Table:
    """MEMORY rows ``(seq, device, live_bytes, delta_bytes)``: one per op and device, device by device,
    seq order; ``live_bytes`` while the op runs (``live_mask``; built a block of ops at a time:
    ``memory_batches.memory_batches``).

    ``delta_bytes`` is the change against the previous op (against the pre-trace baseline for
    seq 0). Devices are listed in the order they first appear in ``tensors``.
    """
    if int(n_ops) <= 0 or tensors.num_rows == 0:
        return S.empty("memory")
    return pa.Table.from_batches(list(memory_batches(tensors, int(n_ops))), schema=S.MEMORY).combine_chunks()


def memory_peak(memory: pa.Table, ops: Optional[pa.Table] = None, tensors: Optional[pa.Table] = None) -> dict[str, dict[str, Any]]:
    """Per device: ``peak_bytes`` and ``peak_seq`` (first op during which live bytes were largest),
    ``peak_op`` (its name, when ``ops`` is given), ``start_bytes`` (before seq 0), ``end_bytes``
    (during the last op) and, when ``tensors`` is given, ``high_water_bytes``/``high_water_seq``:
    the same rule over every storage of ``tensors`` (equal to the peak since live bytes count what
    an op allocates and what it frees within itself; kept for readers of the key)."""
    out: dict[str, dict[str, Any]] = {}
    if memory.num_rows == 0:
        return out
    op_col = ops.column("op") if ops is not None and ops.num_rows else None
    noise: Optional[np.ndarray] = None   # a byte per op
    if ops is not None and op_col is not None and "is_noise" in ops.column_names:
        noise = np.asarray(pc.fill_null(ops.column("is_noise"), False).to_numpy(zero_copy_only=False)).astype(bool)
    devs = DeviceIndex()
    # per device [start, end, peak bytes, its first row's seq, the first such row's seq past bookkeeping (None)]
    state: list[list[Any]] = []
    for b in memory.select(["device", "seq", "live_bytes", "delta_bytes"]).to_batches(max_chunksize=storage_step()):
        if b.num_rows == 0:
            continue
        dev = devs.codes(pa.Table.from_batches([b]))
        seq, live, delta = (_filled(b.column(i), 0) for i in (1, 2, 3))
        for di in np.unique(dev).tolist():
            m = dev == di
            sq, lv = seq[m], live[m]
            while len(state) <= di:
                state.append([None, None, None, 0, None])
            st = state[di]
            if st[0] is None:
                st[0] = int(lv[0] - delta[m][0])
            st[1] = int(lv[-1])
            k = int(np.argmax(lv))
            if st[2] is None or int(lv[k]) > st[2]:
                st[2], st[3], st[4] = int(lv[k]), int(sq[k]), None
            if int(lv[k]) == st[2] and st[4] is None and noise is not None:
                # the first op after which live bytes were largest that is not eager's bookkeeping (a lift or
                # detach moves no data: never the op a peak is named after); none: the peak names no op
                sp = sq[lv == lv[k]]
                sp = sp[(sp >= 0) & (sp < len(noise))]
                sp = sp[~noise[sp]]
                st[4] = int(sp[0]) if len(sp) else None
    hw = _high_water(tensors) if tensors is not None else {}
    for di, d in enumerate(devs.names):
        if di >= len(state) or state[di][0] is None:
            continue
        start, end, peak, at, named = state[di]
        info = {"peak_bytes": peak, "peak_seq": at if named is None else named, "start_bytes": start,
                "end_bytes": end}
        if op_col is not None and 0 <= info["peak_seq"] < len(op_col) and not (noise is not None and noise[info["peak_seq"]]):
            info["peak_op"] = op_col[info["peak_seq"]].as_py()
        if d in hw:
            info["high_water_bytes"], info["high_water_seq"] = hw[d]
        out[d] = info
    return out


def _high_water(tensors: pa.Table) -> dict[str, tuple[int, int]]:
    """Per device (bytes, seq): the largest live bytes while an op runs, over every op a storage of
    ``tensors`` names (``live_mask``), the first such op; one sweep of those ops."""
    if tensors.num_rows == 0:
        return {}
    last = -1
    for b in tensors.select(["alloc_seq", "free_seq"]).to_batches(max_chunksize=storage_step()):
        last = max(last, int(_filled(b.column(0), -1).max(initial=-1)), int(_filled(b.column(1), -1).max(initial=-1)))
    if last < 0:
        return {}
    names, at, peak = device_peaks(tensors, last + 1)
    return {d: (peak[di], at[di]) for di, d in enumerate(names)}
