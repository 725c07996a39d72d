"""Chrome / Perfetto trace-event JSON export: ``t.to_perfetto(path)``.

Draws a Trace (calls and ops, kernels per CUDA stream with flow arrows from their ops, memory
counters) as a timeline ui.perfetto.dev and chrome://tracing open. ``trace_events(trace)``
builds the document, ``write_perfetto(trace, path)`` writes it (``.gz``: gzipped),
``validate_trace_events(doc)`` lists its structural problems.

Rules and details: docs/development/render.md#perfetto--chrome-trace-event-json-renderperfettopy
"""
from __future__ import annotations

import gzip
import json
import os
from typing import Any, Optional

from ..errors import ExportError

__all__ = ["trace_events", "write_perfetto", "validate_trace_events", "CPU_PID", "GPU_PID_BASE"]

CPU_PID = 1
CPU_TID = 1
GPU_PID_BASE = 100          # pid of cuda:N is GPU_PID_BASE + N


def _table(trace, name: str):
    """A table of the trace, or None (derived tables may be unavailable)."""
    try:
        fn = getattr(trace, "table", None)
        if callable(fn):
            return fn(name)
        return trace.tables.get(name)
    except Exception:
        return None


def _us(ns: int) -> float:
    return ns / 1000.0


def _loc(file, line, cells=None) -> Optional[str]:
    if not file:
        return None
    from .._location import format_location

    # the trace's cell map; without one (a trace made outside IPython) the running IPython is asked
    return format_location(file, line, cells or None)


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None and v != []}


def _flat_metadata(md: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in (md or {}).items():
        if v is None or isinstance(v, (str, int, float, bool)):
            out[k] = v
        else:
            out[k] = json.dumps(v, default=str, sort_keys=True)
    return out


def trace_events(trace) -> dict[str, Any]:
    """The trace-event JSON document (a dict) for ``trace``."""
    ops = _table(trace, "ops")
    calls = _table(trace, "calls")
    kernels = _table(trace, "kernels")
    memory = _table(trace, "memory")
    md = getattr(trace, "metadata", {}) or {}

    slices: list[tuple[int, int, int, dict[str, Any]]] = []  # (start, end, order, payload)
    if calls is not None and calls.num_rows:
        cols = calls.select([c for c in ("call_id", "name", "qualname", "module", "source_file", "source_line",
                                          "start_ns", "dur_ns", "n_ops", "autocast", "error_id")
                             if c in calls.column_names]).to_pydict()
        c = lambda name, i: cols[name][i] if name in cols else None  # noqa: E731
        for i in range(calls.num_rows):
            s = cols["start_ns"][i]
            if s is None:
                continue
            e = s + (c("dur_ns", i) or 0)
            args = _clean({"call_id": c("call_id", i), "qualname": c("qualname", i), "module": c("module", i),
                           "line": _loc(c("source_file", i), c("source_line", i), md.get("cell_files")), "n_ops": c("n_ops", i),
                           "autocast": c("autocast", i), "error_id": c("error_id", i)})
            slices.append((s, e, 0, {"name": c("name", i) or "?", "cat": "call", "args": args}))
    op_names: dict[int, str] = {}
    op_span: dict[int, tuple[int, int]] = {}
    if ops is not None and ops.num_rows:
        want = ("seq", "op", "phase", "module", "source_file", "source_line", "in_shapes", "in_dtypes", "in_formats",
                "out_shapes", "out_dtypes", "out_formats", "flops", "bytes_read", "bytes_written", "start_ns",
                "cpu_ns", "cuda_ns", "autograd_node", "call_id", "error_id")
        cols = ops.select([c for c in want if c in ops.column_names]).to_pydict()
        g = lambda name, i: cols[name][i] if name in cols else None  # noqa: E731
        for i in range(ops.num_rows):
            s = cols["start_ns"][i]
            if s is None:
                continue
            e = s + (cols["cpu_ns"][i] or 0)
            seq = cols["seq"][i]
            name = cols["op"][i] or "?"
            op_names[seq] = name
            flops = g("flops", i)
            args = _clean({"seq": seq, "phase": g("phase", i), "module": g("module", i),
                           "line": _loc(g("source_file", i), g("source_line", i), md.get("cell_files")),
                           "in_shapes": g("in_shapes", i), "in_dtypes": g("in_dtypes", i), "in_formats": g("in_formats", i),
                           "out_shapes": g("out_shapes", i), "out_dtypes": g("out_dtypes", i),
                           "out_formats": g("out_formats", i), "flops": flops if (flops is not None and flops >= 0) else None,
                           "bytes_read": g("bytes_read", i), "bytes_written": g("bytes_written", i),
                           "cuda_ns": g("cuda_ns", i), "autograd_node": g("autograd_node", i),
                           "call_id": g("call_id", i), "error_id": g("error_id", i)})
            slices.append((s, e, 1, {"name": name, "cat": "op", "args": args, "_seq": seq}))

    # nest: a child never outlives its parent on the one CPU track
    slices.sort(key=lambda x: (x[0], -x[1], x[2]))
    stack: list[int] = []
    clamped = 0
    events: list[tuple[tuple, dict[str, Any]]] = []
    for s, e, _order, p in slices:
        while stack and s >= stack[-1]:
            stack.pop()
        if stack and e > stack[-1]:
            e = stack[-1]
            clamped += 1
        stack.append(e)
        seq = p.pop("_seq", None)
        if seq is not None:
            op_span[seq] = (s, e)
        ev = {"ph": "X", "pid": CPU_PID, "tid": CPU_TID, "ts": _us(s), "dur": _us(e - s), **p}
        events.append(((s, 0, -(e - s)), ev))

    gpu_tracks: dict[int, set] = {}
    dropped_kernels = 0
    flows = 0
    if kernels is not None and kernels.num_rows:
        k = kernels.to_pydict()
        for i in range(kernels.num_rows):
            s = k["start_ns"][i]
            if s is None:
                dropped_kernels += 1
                continue
            dur = k["dur_ns"][i] or 0
            dev = k["device"][i] or 0
            stream = k["stream"][i] if k["stream"][i] is not None else 0
            pid = GPU_PID_BASE + dev
            gpu_tracks.setdefault(dev, set()).add(stream)
            seq = k["seq"][i]
            args = _clean({"seq": seq, "op": op_names.get(seq) if seq is not None else None,
                           "correlation_id": k["correlation_id"][i], "grid": k["grid"][i], "block": k["block"][i],
                           "device": dev, "stream": stream})
            events.append(((s, 0, -dur), {"ph": "X", "pid": pid, "tid": stream, "ts": _us(s), "dur": _us(dur),
                                          "name": k["name"][i] or "?", "cat": "kernel", "args": args}))
            span = op_span.get(seq) if seq is not None else None
            if span is not None:
                flows += 1
                mid = (span[0] + span[1]) // 2
                events.append(((mid, 1, 0), {"ph": "s", "id": flows, "pid": CPU_PID, "tid": CPU_TID, "ts": _us(mid),
                                             "name": "launch", "cat": "launch"}))
                events.append(((s, 1, 0), {"ph": "f", "bp": "e", "id": flows, "pid": pid, "tid": stream,
                                           "ts": _us(s), "name": "launch", "cat": "launch"}))

    counters = 0
    if memory is not None and memory.num_rows and op_span:
        m = memory.to_pydict()
        for i in range(memory.num_rows):
            seq = m["seq"][i]
            span = op_span.get(seq)
            if span is None or m["live_bytes"][i] is None:
                continue
            dev = m["device"][i] or "cpu"
            pid = CPU_PID
            if dev.startswith("cuda"):
                _, _, idx = dev.partition(":")
                pid = GPU_PID_BASE + (int(idx) if idx.isdigit() else 0)
                gpu_tracks.setdefault(pid - GPU_PID_BASE, set())
            counters += 1
            events.append(((span[1], 2, 0), {"ph": "C", "pid": pid, "ts": _us(span[1]), "name": f"live bytes {dev}",
                                             "args": {"live_bytes": int(m["live_bytes"][i])}}))

    events.sort(key=lambda x: x[0])
    meta: list[dict[str, Any]] = [
        {"ph": "M", "pid": CPU_PID, "name": "process_name", "args": {"name": "CPU (tensorscope)"}},
        {"ph": "M", "pid": CPU_PID, "name": "process_sort_index", "args": {"sort_index": 0}},
        {"ph": "M", "pid": CPU_PID, "tid": CPU_TID, "name": "thread_name", "args": {"name": "torch calls + ATen ops"}},
    ]
    for dev in sorted(gpu_tracks):
        pid = GPU_PID_BASE + dev
        meta.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"GPU cuda:{dev}"}})
        meta.append({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": 1 + dev}})
        for st in sorted(gpu_tracks[dev]):
            meta.append({"ph": "M", "pid": pid, "tid": st, "name": "thread_name", "args": {"name": f"stream {st}"}})
    other = _flat_metadata(md)
    other.update({"clamped_slices": clamped, "kernels_not_drawn": dropped_kernels, "flows": flows,
                  "memory_counters": counters, "time_unit_note": "ts/dur in microseconds since the trace start"})
    return {"traceEvents": meta + [e for _, e in events], "displayTimeUnit": "ns", "otherData": other}


def write_perfetto(trace, path) -> str:
    """Write ``trace_events(trace)`` to ``path`` (``.gz``: gzipped). Returns the path as a string."""
    p = os.fspath(path)
    doc = trace_events(trace)
    try:
        if p.endswith(".gz"):
            with gzip.open(p, "wt", encoding="utf-8") as f:
                json.dump(doc, f, allow_nan=False, separators=(",", ":"))
        else:
            with open(p, "w", encoding="utf-8") as f:
                json.dump(doc, f, allow_nan=False, separators=(",", ":"))
    except OSError as e:
        raise ExportError(f"cannot write the Perfetto trace to {p!r}: {e.strerror or e}. "
                          "The trace is still in memory; choose a writable path.") from e
    return p


_PHASES = {"X", "M", "C", "s", "f", "t", "i", "I", "B", "E"}


def validate_trace_events(doc) -> list[str]:
    """Structural problems of a trace-event document (empty list: well-formed).

    Checks: the object form; every event's required fields and types; slices
    (``X``) with non-negative duration; per track, slices emitted in
    non-decreasing start order and properly nested; non-metadata events in
    non-decreasing ``ts`` overall; each flow start has one finish, inside a
    slice of its own track, and each finish lands on a slice start of its
    track; counter values numeric.
    """
    probs: list[str] = []
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["document is not an object with a traceEvents list"]
    last_ts = None
    tracks: dict[tuple[Any, Any], list[tuple[float, float]]] = {}
    flows_s: dict[Any, dict] = {}
    flows_f: dict[Any, dict] = {}
    for i, e in enumerate(doc["traceEvents"]):
        if not isinstance(e, dict):
            probs.append(f"event {i} is not an object")
            continue
        ph = e.get("ph")
        if ph not in _PHASES:
            probs.append(f"event {i}: unknown ph {ph!r}")
            continue
        if not isinstance(e.get("name"), str):
            probs.append(f"event {i}: name missing")
        if not isinstance(e.get("pid"), int):
            probs.append(f"event {i}: pid missing or not an int")
        if ph == "M":
            if not isinstance(e.get("args"), dict):
                probs.append(f"event {i}: metadata without args")
            continue
        ts = e.get("ts")
        if not isinstance(ts, (int, float)) or ts < 0:
            probs.append(f"event {i}: bad ts {ts!r}")
            continue
        if last_ts is not None and ts < last_ts:
            probs.append(f"event {i}: ts {ts} goes back (previous {last_ts})")
        last_ts = ts
        if ph in ("X", "s", "f") and "tid" not in e:
            probs.append(f"event {i}: tid missing")
        if ph == "X":
            dur = e.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                probs.append(f"event {i}: bad dur {dur!r}")
                continue
            tracks.setdefault((e["pid"], e.get("tid")), []).append((ts, ts + dur))
        elif ph == "s":
            if e.get("id") in flows_s:
                probs.append(f"event {i}: duplicate flow start id {e.get('id')}")
            flows_s[e.get("id")] = e
        elif ph == "f":
            flows_f[e.get("id")] = e
        elif ph == "C":
            args = e.get("args")
            if not isinstance(args, dict) or not args or not all(isinstance(v, (int, float)) for v in args.values()):
                probs.append(f"event {i}: counter args must be numbers")
    eps = 1e-6
    for key, sl in tracks.items():
        stack: list[float] = []
        prev = None
        for s, e in sl:
            if prev is not None and s < prev - eps:
                probs.append(f"track {key}: slice at {s} emitted after one starting at {prev}")
            prev = s
            while stack and s >= stack[-1] - eps:
                stack.pop()
            if stack and e > stack[-1] + eps:
                probs.append(f"track {key}: slice [{s}, {e}] overlaps its parent ending at {stack[-1]}")
            stack.append(e)
    for fid, fs in flows_s.items():
        f = flows_f.get(fid)
        if f is None:
            probs.append(f"flow {fid}: start without finish")
            continue
        own = tracks.get((fs["pid"], fs.get("tid")), [])
        if not any(a - eps <= fs["ts"] <= b + eps for a, b in own):
            probs.append(f"flow {fid}: start at {fs['ts']} is inside no slice of its track")
        dst = tracks.get((f["pid"], f.get("tid")), [])
        if not any(abs(a - f["ts"]) <= eps for a, _ in dst):
            probs.append(f"flow {fid}: finish at {f['ts']} binds to no slice start")
    for fid in flows_f:
        if fid not in flows_s:
            probs.append(f"flow {fid}: finish without start")
    return probs
