"""The CUDA caching allocator's view beside ours: its counters, its snapshot as tables, joined to ``tensors``.

Pure functions of plain values and trace tables (nothing here imports torch):

* ``allocator_rows(start, end, touched)``: one ``ALLOCATOR`` row per device from the
  ``torch.cuda.memory_stats`` dicts read at the trace's start and end (``source = "stats"``);
* ``snapshot_tables(snapshot, ...)``: a ``torch.cuda.memory._snapshot()`` dict (segments with
  blocks, ``device_traces`` of events) as ``allocator_segments``, ``allocator_blocks`` and
  ``allocator_events``, our storages joined to them; frames are not kept;
* ``allocator_timeline(events, allocator)``: reserved and allocated bytes after each event;
* ``with_history(allocator, timeline, ops, tensors)``: fragmentation at our peak from the timeline.

The join: a storage of ours is ``tensors.address`` on ``tensors.device`` while it is alive, from
the start of the op that made it (``alloc_seq``) to the start of the op after the one it died in
(``free_seq``). The allocator's events of one address are ordered and paired (an ``alloc``, then
its ``free_requested`` and ``free_completed``), so an ``alloc`` is matched to the next storage of
ours at that address, of that size (a storage's bytes are what it asked the allocator for), that
started before it; the frees take the storage their ``alloc`` was matched to (a free whose alloc
came before the trace is matched by time). Blocks of the snapshot are matched to our storages
alive at the end.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S

__all__ = ["allocator_rows", "allocator_table", "snapshot_tables", "allocator_timeline", "with_history",
           "cuda_index"]

#: slack (ns) between the allocator's clock (unix microseconds) and ours (perf_counter_ns)
SLACK_NS = 100_000
_INF = np.iinfo(np.int64).max
_NINF = np.iinfo(np.int64).min


def cuda_index(device: Any) -> Optional[int]:
    """``"cuda:1"`` -> 1, ``"cuda"`` -> 0, anything else None."""
    if not isinstance(device, str) or not device.startswith("cuda"):
        return None
    _, _, idx = device.partition(":")
    return int(idx) if idx.isdigit() else 0


def _stat(stats: Mapping[str, Any], key: str) -> int:
    v = stats.get(key, 0)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def allocator_rows(start: Mapping[int, Mapping[str, Any]], end: Mapping[int, Mapping[str, Any]],
                   touched: Iterable[int] = ()) -> list[dict[str, Any]]:
    """``ALLOCATOR`` rows (``source = "stats"``) for the devices the trace touched: those ``touched``
    (its storages were on them) and those whose allocator counters moved during the trace. ``start``
    and ``end``: device index -> ``memory_stats`` (flat keys); a device missing from ``start`` had no
    CUDA context then (every counter 0)."""
    rows = []
    for d in sorted(set(end) | set(start)):
        s, e = start.get(d, {}), end.get(d, {})
        moved = any(_stat(s, k) != _stat(e, k) for k in ("allocation.all.allocated", "segment.all.allocated",
                                                          "num_ooms", "num_alloc_retries"))
        if not (moved or d in set(touched)):
            continue
        a_end, r_end = _stat(e, "allocated_bytes.all.current"), _stat(e, "reserved_bytes.all.current")
        rows.append({
            "device": f"cuda:{d}", "source": "stats",
            "allocated_start": _stat(s, "allocated_bytes.all.current"), "allocated_end": a_end,
            "allocated_peak": _stat(e, "allocated_bytes.all.peak"),
            "reserved_start": _stat(s, "reserved_bytes.all.current"), "reserved_end": r_end,
            "reserved_peak": _stat(e, "reserved_bytes.all.peak"),
            "peak_in_trace": _stat(e, "allocated_bytes.all.peak") > _stat(s, "allocated_bytes.all.peak"),
            "inactive_split_bytes": _stat(e, "inactive_split_bytes.all.current"),
            "fragmentation_bytes": max(r_end - a_end, 0), "fragmentation_seq": None,
            "num_alloc_retries": _stat(e, "num_alloc_retries") - _stat(s, "num_alloc_retries"),
            "num_ooms": _stat(e, "num_ooms") - _stat(s, "num_ooms"),
        })
    return rows


def allocator_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    if not rows:
        return S.empty("allocator")
    return pa.Table.from_pylist([{f.name: r.get(f.name) for f in S.ALLOCATOR} for r in rows], schema=S.ALLOCATOR)


# -- the snapshot -----------------------------------------------------------------------------

class _Storages:
    """Our CUDA storages by (device index, address): (lo, hi, nbytes, storage_id, category), by lo."""

    def __init__(self, tensors: Optional[pa.Table], ops: Optional[pa.Table]) -> None:
        self.by_key: dict[tuple[int, int], list[tuple[int, int, int, int, Optional[str]]]] = {}
        self.alive_at_end: dict[tuple[int, int], tuple[int, Optional[str]]] = {}
        if tensors is None or tensors.num_rows == 0 or "address" not in tensors.column_names:
            return
        addr = tensors.column("address")
        if addr.null_count == len(addr):
            return
        dev = [cuda_index(d) for d in tensors.column("device").to_pylist()]
        addresses = np.asarray(pc.fill_null(addr, 0).to_numpy(zero_copy_only=False), np.int64)
        nbytes = np.asarray(pc.fill_null(tensors.column("nbytes"), -1).to_numpy(zero_copy_only=False), np.int64)
        alloc = np.asarray(pc.fill_null(tensors.column("alloc_seq"), -1).to_numpy(zero_copy_only=False), np.int64)
        free = np.asarray(pc.fill_null(tensors.column("free_seq"), -1).to_numpy(zero_copy_only=False), np.int64)
        sids = np.asarray(tensors.column("storage_id").to_numpy(zero_copy_only=False), np.int64)
        cats = tensors.column("category").to_pylist()
        starts = np.zeros(0, np.int64)
        if ops is not None and ops.num_rows:
            starts = np.asarray(pc.fill_null(ops.column("start_ns"), 0).to_numpy(zero_copy_only=False), np.int64)
        n = len(starts)
        for i in range(tensors.num_rows):
            d = dev[i]
            if d is None or addresses[i] <= 0:
                continue
            lo = int(starts[alloc[i]]) if 0 <= alloc[i] < n else _NINF
            if free[i] < 0:
                hi = _INF
                self.alive_at_end[(d, int(addresses[i]))] = (int(sids[i]), cats[i])
            else:
                hi = int(starts[free[i] + 1]) if free[i] + 1 < n else _INF
            self.by_key.setdefault((d, int(addresses[i])), []).append((lo, hi, int(nbytes[i]), int(sids[i]), cats[i]))
        for v in self.by_key.values():
            v.sort(key=lambda r: r[0])


def _events(snapshot: Mapping[str, Any], anchor_unix_ns: int) -> list[tuple[int, dict[str, Any]]]:
    """(device index, entry) of the snapshot's events since the trace started, in order."""
    out = []
    lo_us = (anchor_unix_ns - 1000) // 1000 if anchor_unix_ns else None
    for d, trace in enumerate(snapshot.get("device_traces") or []):
        for e in trace or []:
            t = e.get("time_us")
            if isinstance(t, int) and lo_us is not None and t < lo_us:
                continue
            out.append((d, e))
    return out


def _match_events(evs: Sequence[tuple[int, dict[str, Any]]], starts_ns: Sequence[Optional[int]],
                  st: _Storages) -> list[tuple[Optional[int], Optional[str]]]:
    """Per event, (storage_id, category) of ours it was for (see the module docstring)."""
    nxt: dict[tuple[int, int], int] = {}        # next unmatched candidate per address
    current: dict[tuple[int, int], tuple[int, Optional[str]]] = {}
    out: list[tuple[Optional[int], Optional[str]]] = []
    for (d, e), t in zip(evs, starts_ns):
        action = e.get("action")
        addr = e.get("addr")
        got: tuple[Optional[int], Optional[str]] = (None, None)
        if not isinstance(addr, int) or t is None:
            out.append(got)
            continue
        key = (d, int(addr))
        cands = st.by_key.get(key)
        if cands:
            if action == "alloc":
                k = nxt.get(key, 0)
                while k < len(cands) and cands[k][1] < t - SLACK_NS:   # died before this: its alloc is not here
                    k += 1
                for j in range(k, len(cands)):
                    lo, _hi, nb, sid, cat = cands[j]
                    if lo > t + SLACK_NS:
                        break
                    if nb == e.get("size"):
                        got = (sid, cat)
                        current[key] = got
                        nxt[key] = j + 1
                        break
            elif action in ("free_requested", "free_completed"):
                if key in current:
                    got = current[key]
                else:   # allocated before the trace (or before the history): by time
                    los = [c[0] for c in cands]
                    j = bisect_right(los, t + SLACK_NS) - 1
                    if j >= 0 and cands[j][1] >= t - SLACK_NS:
                        got = (cands[j][3], cands[j][4])
                        current[key] = got
                        nxt[key] = max(nxt.get(key, 0), j + 1)
                if action == "free_completed":
                    current.pop(key, None)
        out.append(got)
    return out


def snapshot_tables(snapshot: Mapping[str, Any], *, anchor_unix_ns: int, tensors: Optional[pa.Table] = None, ops: Optional[pa.Table] = None) -> dict[str, pa.Table]:
    """``allocator_segments``, ``allocator_blocks`` and ``allocator_events`` of a
    ``torch.cuda.memory._snapshot()`` dict. ``anchor_unix_ns``: the trace start on the unix clock
    (``ops.start_ns == 0``); events before it (older history) are left out."""
    st = _Storages(tensors, ops)
    seg_rows: list[dict[str, Any]] = []
    block_rows: list[dict[str, Any]] = []
    for seg in snapshot.get("segments") or []:
        d = int(seg.get("device", 0) or 0)
        dev = f"cuda:{d}"
        base = seg.get("address")
        blocks = seg.get("blocks") or []
        seg_rows.append({"device": dev, "address": base, "total_size": seg.get("total_size"),
                         "allocated_size": seg.get("allocated_size"), "active_size": seg.get("active_size"),
                         "requested_size": seg.get("requested_size"), "stream": seg.get("stream"),
                         "segment_type": seg.get("segment_type"), "is_expandable": seg.get("is_expandable"),
                         "n_blocks": len(blocks)})
        for b in blocks:
            addr = b.get("address")
            sid, cat = (None, None)
            if b.get("state") == "active_allocated" and isinstance(addr, int):
                sid, cat = st.alive_at_end.get((d, addr), (None, None))
            block_rows.append({"device": dev, "segment_address": base, "address": addr, "size": b.get("size"),
                               "requested_size": b.get("requested_size"), "state": b.get("state"),
                               "storage_id": sid, "category": cat})
    evs = _events(snapshot, anchor_unix_ns)
    starts_ns: list[Optional[int]] = [int(e["time_us"]) * 1000 - anchor_unix_ns
                                      if isinstance(e.get("time_us"), int) else None for _d, e in evs]
    matched = _match_events(evs, starts_ns, st)
    seqs = _seq_of(starts_ns, ops)
    ev_rows = []
    for (d, e), t, (sid, cat), seq in zip(evs, starts_ns, matched, seqs):
        oom = e.get("action") == "oom"
        ev_rows.append({"device": f"cuda:{d}", "action": e.get("action"), "address": None if oom else e.get("addr"),
                        "size": e.get("size"), "stream": e.get("stream"), "time_us": e.get("time_us"),
                        "start_ns": t, "seq": seq, "device_free": e.get("device_free") if oom else None,
                        "storage_id": sid, "category": cat})
    return {"allocator_segments": _table("allocator_segments", seg_rows),
            "allocator_blocks": _table("allocator_blocks", block_rows),
            "allocator_events": _table("allocator_events", ev_rows)}


def _table(name: str, rows: list[dict[str, Any]]) -> pa.Table:
    schema = S.TABLES[name]
    if not rows:
        return S.empty(name)
    return pa.Table.from_pylist([{f.name: _plain(r.get(f.name), f.type) for f in schema} for r in rows], schema=schema)


def _plain(v: Any, typ: pa.DataType) -> Any:
    """A snapshot value as the column's type (None when it is not one: never a guess)."""
    if v is None:
        return None
    if pa.types.is_integer(typ):
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else None
    if pa.types.is_boolean(typ):
        return bool(v) if isinstance(v, (bool, int)) else None
    return v if isinstance(v, str) else str(v)


def _seq_of(starts_ns: Sequence[Optional[int]], ops: Optional[pa.Table]) -> list[Optional[int]]:
    """The last op started at or before each time (null before the first, or without a time)."""
    if ops is None or ops.num_rows == 0:
        return [None] * len(starts_ns)
    st = np.asarray(pc.fill_null(ops.column("start_ns"), 0).to_numpy(zero_copy_only=False), np.int64)
    order = np.argsort(st, kind="stable")
    sorted_st = st[order]
    out: list[Optional[int]] = []
    for t in starts_ns:
        if t is None:
            out.append(None)
            continue
        j = int(np.searchsorted(sorted_st, t, side="right")) - 1
        out.append(int(order[j]) if j >= 0 else None)
    return out


# -- reserved / allocated over time -----------------------------------------------------------

_RESERVE = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_ALLOC = {"alloc": 1, "free_requested": -1}


def allocator_timeline(events: pa.Table, allocator: pa.Table) -> pa.Table:
    """``ALLOCATOR_TIMELINE``: per device, the bytes the cache reserved and the bytes of live blocks
    after each event: ``reserved_start`` and ``allocated_start`` (``allocator``) plus the sizes of the
    events since (segments; blocks at the sizes asked for, which the allocator rounds up)."""
    if events.num_rows == 0:
        return S.ALLOCATOR_TIMELINE.empty_table()
    base: dict[str, tuple[int, int]] = {}
    for r in allocator.select(["device", "reserved_start", "allocated_start"]).to_pylist():
        base[r["device"]] = (int(r["reserved_start"] or 0), int(r["allocated_start"] or 0))
    cols = events.select(["device", "action", "size", "time_us", "start_ns", "seq"]).to_pydict()
    running: dict[str, list[int]] = {}
    res, alc = [], []
    for dev, action, size in zip(cols["device"], cols["action"], cols["size"]):
        cur = running.get(dev)
        if cur is None:
            cur = running[dev] = list(base.get(dev, (0, 0)))
        n = int(size or 0)
        cur[0] += _RESERVE.get(action, 0) * n
        cur[1] += _ALLOC.get(action, 0) * n
        res.append(cur[0])
        alc.append(cur[1])
    return pa.Table.from_arrays([pa.array(cols["device"], pa.string()), pa.array(cols["time_us"], pa.int64()),
                                 pa.array(cols["start_ns"], pa.int64()), pa.array(cols["seq"], pa.int64()),
                                 pa.array(res, pa.int64()), pa.array(alc, pa.int64())], schema=S.ALLOCATOR_TIMELINE)


def with_history(allocator: pa.Table, timeline: pa.Table, ops: pa.Table, tensors: pa.Table) -> pa.Table:
    """``allocator`` with ``source = "history"`` for the devices the timeline covers, and
    ``fragmentation_bytes`` = reserved − allocated when our live bytes on the device peaked (after
    op ``fragmentation_seq``; the timeline's last row at or before that op's end)."""
    if allocator.num_rows == 0 or timeline.num_rows == 0:
        return allocator
    from .memory import memory_peak, memory_table

    peaks = memory_peak(memory_table(tensors, ops.num_rows), ops)
    starts = np.asarray(pc.fill_null(ops.column("start_ns"), 0).to_numpy(zero_copy_only=False), np.int64)
    durs = np.asarray(pc.fill_null(ops.column("cpu_ns"), 0).to_numpy(zero_copy_only=False), np.int64)
    tl = timeline.select(["device", "start_ns", "reserved_bytes", "allocated_bytes"]).to_pydict()
    rows = allocator.to_pylist()
    for r in rows:
        dev = r["device"]
        idx = [i for i, d in enumerate(tl["device"]) if d == dev]
        if not idx:
            continue
        r["source"] = "history"
        peak = peaks.get(dev)
        if peak is None or not (0 <= peak["peak_seq"] < len(starts)):
            continue
        at = int(starts[peak["peak_seq"]] + durs[peak["peak_seq"]])
        before = [i for i in idx if tl["start_ns"][i] is not None and tl["start_ns"][i] <= at]
        if before:
            reserved, allocated = int(tl["reserved_bytes"][before[-1]]), int(tl["allocated_bytes"][before[-1]])
        else:   # no event yet: the start
            reserved, allocated = int(r["reserved_start"] or 0), int(r["allocated_start"] or 0)
        r["fragmentation_bytes"] = max(reserved - allocated, 0)
        r["fragmentation_seq"] = peak["peak_seq"]
    return pa.Table.from_pylist(rows, schema=S.ALLOCATOR)
