"""Linking GPU activities to the ops that launched them: the pure half of the ``kernels`` table.

``link_kernels(kernel_events, op_windows, launch_events, *, clock, window, ...)``
returns ``(pyarrow.Table in the KERNELS schema, [warning strings])``. A kernel's
CUPTI ``correlation_id`` equals that of the runtime/driver call that launched it
(``cudaLaunchKernel``, ``cuLaunchKernelEx``, ``cudaMemcpyAsync``...). The
launch's CPU start time, mapped onto our clock, falls inside exactly one op's
``[start_ns, start_ns + cpu_ns)`` (dispatch-mode ops do not nest), which gives
``seq``. When the runtime event is missing, the kernel's
``linked_correlation_id`` (the external id Kineto pushes for the enclosing ATen
op) and that op's CPU event are used. Timestamps are checked: a kernel must
start after its launch, end after it starts, have non-zero timestamps (CUPTI's
"no timing") and lie inside the cell window. A failing kernel keeps its row
(name, seq, stream) with a null ``start_ns`` so no timeline draws it at a wrong
place, and the check yields a warning string (the builder puts these in the
trace notes).

Also here: the records both halves share (``KernelRecord``, ``LaunchRecord``),
the ops' CPU windows (``OpWindows``) and the Kineto -> trace clock map
(``ClockMap``; how its calibration points are taken: ``timing/kernels.py``).
No torch: collecting the events from Kineto is ``timing/kernels.py``.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from typing import Callable, NamedTuple, Optional

import pyarrow as pa

from .. import schema as S

__all__ = ["KernelRecord", "LaunchRecord", "OpWindows", "ClockMap", "link_kernels"]


class KernelRecord(NamedTuple):
    """One GPU activity, times in the profiler's clock (Kineto ns)."""
    name: str
    device: int
    stream: int
    start_ns: int
    end_ns: int
    correlation_id: int          # CUPTI correlation id, shared with the launching runtime call
    linked_id: int = 0           # external id: correlation id of the enclosing ATen op's CPU event
    grid: Optional[tuple[int, int, int]] = None
    block: Optional[tuple[int, int, int]] = None
    kind: str = "kernel"         # kernel / memcpy / memset


class LaunchRecord(NamedTuple):
    """A CPU-side event that can launch GPU work (runtime/driver call, or an ATen op's CPU event)."""
    name: str
    start_ns: int
    end_ns: int
    correlation_id: int
    linked_id: int = 0
    kind: str = "runtime"        # runtime / cpu_op


class OpWindows(NamedTuple):
    """Ops' CPU windows on the trace clock (ns since the trace's t0), sorted by start."""
    seq: list[int]
    start: list[int]
    end: list[int]

    @classmethod
    def from_ops(cls, ops) -> OpWindows:
        """From an ``ops`` table (``seq``, ``start_ns``, ``cpu_ns``) or a ``(seq, start_ns, cpu_ns)`` triple."""
        if isinstance(ops, OpWindows):
            return ops
        if isinstance(ops, pa.Table):
            if ops.num_rows == 0:
                return cls([], [], [])
            seq = ops.column("seq").to_pylist()
            start = ops.column("start_ns").to_pylist()
            dur = ops.column("cpu_ns").to_pylist()
        else:
            seq, start, dur = (list(x) for x in ops)
        rows = sorted((s, q, (s + (d or 0))) for q, s, d in zip(seq, start, dur) if s is not None)
        return cls([r[1] for r in rows], [r[0] for r in rows], [r[2] for r in rows])

    def find(self, t: int) -> Optional[int]:
        """``seq`` of the op whose ``[start, end)`` contains ``t``, else None."""
        i = bisect.bisect_right(self.start, t) - 1
        if i >= 0 and t < self.end[i]:
            return self.seq[i]
        return None


class ClockMap:
    """Kineto ns -> trace ns (``perf_counter_ns() - t0``): a line through calibration points.

    ``points`` are ``(kineto_ns, perf_ns)`` or ``(kineto_ns, perf_ns, bracket_ns)``
    where ``bracket_ns`` is the width of the perf bracket around the marker
    (its uncertainty). A slope is fitted only when the points are far enough
    apart for the brackets to matter less than ~1 ppm; otherwise the map is an
    offset taken at the tightest point.
    """

    __slots__ = ("k0", "p0", "slope", "t0")

    def __init__(self, points: Sequence[tuple[int, ...]], t0_ns: int = 0):
        pts = sorted((p[0], p[1], p[2] if len(p) > 2 else 0) for p in points)
        if not pts:
            raise ValueError("ClockMap needs at least one (kineto_ns, perf_ns) point")
        tight = min(pts, key=lambda p: p[2])
        self.k0, self.p0 = tight[0], tight[1]
        self.slope = 1.0
        if len(pts) >= 2:
            (ka, pa_, wa), (kb, pb, wb) = pts[0], pts[-1]
            span = kb - ka
            if span > 0 and (wa + wb) * 1_000_000 <= span:
                self.k0, self.p0 = ka, pa_
                self.slope = (pb - pa_) / span
        self.t0 = t0_ns

    @classmethod
    def from_wall_clock(cls, t0_ns: int = 0) -> ClockMap:
        """The REALTIME - MONOTONIC offset, read in the tightest of a few brackets."""
        best = None
        for _ in range(5):
            a = time.perf_counter_ns()
            w = time.time_ns()
            b = time.perf_counter_ns()
            if best is None or b - a < best[0]:
                best = (b - a, w, (a + b) // 2)
        assert best is not None
        return cls([(best[1], best[2], best[0])], t0_ns)

    def __call__(self, kineto_ns: int) -> int:
        return int(round(self.p0 + (kineto_ns - self.k0) * self.slope)) - self.t0

    def inverse(self, perf_ns: int) -> int:
        """Absolute ``perf_counter_ns`` back to Kineto ns."""
        return int(round(self.k0 + (perf_ns - self.p0) / self.slope))

    @property
    def offset_ns(self) -> int:
        """perf_counter_ns - kineto_ns at the reference point."""
        return self.p0 - self.k0


def _check_counts():
    return {"no_timestamps": [0, None], "before_launch": [0, None], "end_before_start": [0, None],
            "outside_window": [0, None], "no_launch": [0, None], "outside_ops": [0, None]}


_CHECK_TEXT = {
    "no_timestamps": "kernel(s) have no timestamps (CUPTI could not time them); their start/duration are null",
    "before_launch": "kernel(s) are stamped before their own launch (a corrupted CUPTI timestamp, cf. pytorch#192021); "
                     "their start is null so the timeline does not show them at a wrong place",
    "end_before_start": "kernel(s) end before they start; their start/duration are null",
    "outside_window": "kernel(s) fall outside the cell's time window; their start is null",
    "no_launch": "kernel(s) have no launch event in the profiler trace; they are not linked to an op",
    "outside_ops": "kernel(s) were launched outside every traced op (tracer probes or untraced threads); seq is null",
}


def link_kernels(kernel_events: Sequence[KernelRecord], op_windows, launch_events: Sequence[LaunchRecord], *,
                 clock: Optional[Callable[[int], int]] = None, window: Optional[tuple[int, int]] = None,
                 cpu_ops: Sequence[LaunchRecord] = (), tolerance_ns: int = 2_000) -> tuple[pa.Table, list[str]]:
    """Link GPU activities to ops and check their timestamps (pure function).

    kernel_events: ``KernelRecord``s (Kineto clock). op_windows: ``OpWindows``,
    an ``ops`` table or a ``(seq, start_ns, cpu_ns)`` triple, on the trace
    clock. launch_events: runtime/driver ``LaunchRecord``s (Kineto clock).
    clock: Kineto ns -> trace ns (a ``ClockMap``; identity when None).
    window: the cell's ``(start, end)`` on the trace clock, after the final
    synchronise; kernels outside it fail the check. cpu_ops: CPU op events
    for the ``linked_id`` fallback. tolerance_ns: slack of every timestamp
    check (clock conversion jitter). Returns the KERNELS table, sorted by
    start (unplaced kernels last), and human-readable warnings.
    """
    conv = clock or (lambda k: k)
    ops = OpWindows.from_ops(op_windows)
    by_corr: dict = {}
    for launch in launch_events:
        by_corr.setdefault(launch.correlation_id, launch)
    cpu_by_corr = None
    counts = _check_counts()

    def bad(what, name):
        c = counts[what]
        c[0] += 1
        if c[1] is None:
            c[1] = name

    rows: dict[str, list] = {f: [] for f in ("seq", "name", "device", "stream", "start_ns", "dur_ns", "grid", "block", "correlation_id")}
    for k in kernel_events:
        start, end = k.start_ns, k.end_ns
        launch_t = None
        launch_start_k = None
        ln = by_corr.get(k.correlation_id) if k.correlation_id else None
        if ln is not None:
            launch_start_k = ln.start_ns
            launch_t = conv(ln.start_ns)
        elif k.linked_id:
            if cpu_by_corr is None:
                cpu_by_corr = {c.correlation_id: c for c in cpu_ops}
            op = cpu_by_corr.get(k.linked_id)
            if op is not None:
                launch_start_k = op.start_ns
                # the ATen op's CPU event sits inside our op's window; its midpoint is safely inside
                launch_t = conv((op.start_ns + op.end_ns) // 2)
        seq = ops.find(launch_t) if launch_t is not None else None
        if launch_t is None:
            bad("no_launch", k.name)
        elif seq is None:
            bad("outside_ops", k.name)
        rel_start = dur = None
        if start == 0 and end == 0:
            bad("no_timestamps", k.name)
        elif end < start:
            bad("end_before_start", k.name)
        else:
            dur = end - start
            if launch_start_k is not None and start + tolerance_ns < launch_start_k:
                bad("before_launch", k.name)
            else:
                rs = conv(start)
                if window is not None and (rs < window[0] - tolerance_ns or rs + dur > window[1] + tolerance_ns):
                    bad("outside_window", k.name)
                else:
                    rel_start = rs
        rows["seq"].append(seq)
        rows["name"].append(k.name)
        rows["device"].append(k.device)
        rows["stream"].append(k.stream)
        rows["start_ns"].append(rel_start)
        rows["dur_ns"].append(dur)
        rows["grid"].append(list(k.grid) if k.grid else None)
        rows["block"].append(list(k.block) if k.block else None)
        rows["correlation_id"].append(k.correlation_id)
    n = len(rows["name"])
    order = sorted(range(n), key=lambda i: (rows["start_ns"][i] is None, rows["start_ns"][i] or 0, i))
    cols = [pa.array([rows[f.name][i] for i in order], f.type) for f in S.KERNELS]
    table = pa.Table.from_arrays(cols, schema=S.KERNELS)
    warnings = [f"{c} {_CHECK_TEXT[what]} (e.g. {example})" for what, (c, example) in counts.items() if c]
    return table, warnings
