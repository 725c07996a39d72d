"""All ranks of a dataset run on one Perfetto timeline: ``Dataset.to_perfetto(path)``.

Each rank's trace is drawn by ``render.perfetto.trace_events`` and moved onto
rank 0's clock (``ranks.start_unix_ns``: the rank's anchor plus its measured
offset), its processes renumbered so every rank is its own process group
(``rank R``, ``rank R cuda:N``); a second track per rank shows each collective
from its call to its completion, where completion is known.
"""
from __future__ import annotations

import gzip
import json
import os
from typing import Any

from ..errors import ExportError
from .perfetto import CPU_PID, GPU_PID_BASE, trace_events

PID_STRIDE = 1000


def dataset_events(ds, run: str) -> dict[str, Any]:
    keys = ds._con.execute("SELECT rank, attempt, trace_id, start_unix_ns FROM ranks WHERE run = ? "
                           "ORDER BY rank, attempt, trace_id", [run]).fetchall()
    if not keys:
        return {"traceEvents": [], "displayTimeUnit": "ns", "otherData": {"run": run}}
    t_min = min(k[3] or 0 for k in keys)
    events: list[dict[str, Any]] = []
    ranks_seen = set()
    lanes_named = set()
    for rank, attempt, trace_id, start in keys:
        t = ds.trace(rank=rank, run=run, attempt=attempt, trace_id=trace_id)
        doc = trace_events(t)
        shift_us = ((start or 0) - t_min) / 1e3
        base = (rank + 1) * PID_STRIDE
        for ev in doc["traceEvents"]:
            ev = dict(ev)
            pid = ev.get("pid", CPU_PID)
            ev["pid"] = base + (pid - CPU_PID if pid < GPU_PID_BASE else pid)
            if ev.get("ph") == "M":
                if ev.get("name") == "process_name":
                    name = ev["args"]["name"]
                    ev["args"] = {"name": f"rank {rank}" + ("" if pid == CPU_PID else f" {name}")}
                elif ev.get("name") == "process_sort_index":
                    ev["args"] = {"sort_index": rank * 100 + ev["args"].get("sort_index", 0)}
                if rank in ranks_seen and trace_id:
                    continue   # one set of process names per rank
            elif "ts" in ev:
                ev["ts"] = ev["ts"] + shift_us
            events.append(ev)
        coll = t.table("collectives").to_pylist()
        # call-to-completion spans of async collectives overlap without nesting: one lane (track)
        # per overlap depth, so every track's slices stay properly nested
        lanes: list[int] = []
        for c in sorted(coll, key=lambda c: c["start_ns"]):
            end = c["done_ns"] if c["done_ns"] is not None else c["start_ns"] + (c["enqueue_ns"] or 0)
            end = max(end, c["start_ns"])
            lane = next((i for i, e in enumerate(lanes) if e <= c["start_ns"]), None)
            if lane is None:
                lane = len(lanes)
                lanes.append(end)
                if (rank, lane) not in lanes_named:
                    lanes_named.add((rank, lane))
                    events.append({"ph": "M", "pid": base, "tid": 2 + lane, "name": "thread_name",
                                   "args": {"name": "collectives (call to completion)" + (f" {lane + 1}" if lane else "")}})
            lanes[lane] = end
            events.append({"ph": "X", "pid": base, "tid": 2 + lane, "ts": c["start_ns"] / 1e3 + shift_us,
                           "dur": (end - c["start_ns"]) / 1e3, "name": c["op"], "cat": "collective",
                           "args": {"pg_name": c["pg_name"], "coll_index": c["coll_index"],
                                    "nbytes": c["nbytes"], "reduce_op": c["reduce_op"],
                                    "completion_known": c["done_ns"] is not None, "seq": c["seq"]}})
        ranks_seen.add(rank)
    # metadata first, then every rank's events merged in timestamp order (the format wants ts sorted)
    meta = [e for e in events if e.get("ph") == "M"]
    timed = sorted((e for e in events if e.get("ph") != "M"), key=lambda e: e.get("ts", 0))
    events = meta + timed
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"run": run, "ranks": sorted(ranks_seen), "dataset": ds.root,
                          "time_unit_note": "ts in microseconds since the first rank's trace start, rank 0's clock"}}


def write_dataset_perfetto(ds, path, run: str) -> str:
    p = os.fspath(path)
    doc = dataset_events(ds, run)
    try:
        opener = gzip.open if p.endswith(".gz") else open
        with opener(p, "wt", encoding="utf-8") as f:
            json.dump(doc, f, allow_nan=False, separators=(",", ":"))
    except OSError as e:
        raise ExportError(f"cannot write the Perfetto trace to {p!r}: {e.strerror or e}") from e
    return p
