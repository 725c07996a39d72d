"""Time outside ops and GPU idle time: where a traced block spent its wall time when no op ran.

``outside_ops(ops, calls, wall_ns)``: the union of the ops' host intervals
(``start_ns``, ``start_ns + cpu_ns``) against the span from the first op to the last; the rest
is Python, data loading and everything else between ops. The largest gaps are named by the ops around them;
``DataLoader`` time is the calls whose qualname names one (when data loading ran through a
recorded torch-level call). A traced gap also holds tensorscope's own work between two ops (the
probes after one op, the bookkeeping before the next), which eager never runs. The engine times that
work: the python engine all of it, per row (``ops.probe_ns`` of the op before the gap: its modes'
segments, probes and hooks), the native engine its callbacks' part on a sample of the rows
(``metadata["tracer_op_ns"]``, a mean per op: ``own_op_ns`` here); either grows with a slower or
busier machine. A gap counts past that and past what the engine cannot time itself (torch calling
into its modes and callbacks, the dispatcher's boxing): ``tracer_ns`` (``TRACER_NS``), or
``untimed_ratio`` (``UNTIMED_RATIO``) times the timed part where that is more. So a gap the tracer
alone could explain is no finding, on a fast machine or a slow one.

On a busy machine the gaps also hold other processes' time: the advisor leaves out the time the
recording thread was runnable but waiting for a CPU (``metadata["run_delay_ns"]``, from
``/proc/thread-self/schedstat``), from the gaps and from the wall it compares them with.

``gpu_idle(ops, kernels)``: per device, the time between kernels (their intervals merged), each
gap split into ``host_wait`` (the GPU idle before the host even started the op that launched the
next kernel: the host was busy elsewhere) and ``launch`` (the op had started: launch latency
and queueing). Needs the ``kernels`` table (``trace(kernels=True)`` on CUDA).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .opview import BATCH_ROWS, string_mask

_GAPS_LISTED = 3
#: the least of tensorscope's own cost per op that it does not time, by engine (ns): the part of a gap between
#: two traced ops that may be the tracer's rather than the program's. Upper bounds of a whole gap between
#: back-to-back ops on the development machine (native ~3.5 us, python ~20-25 us there)
TRACER_NS = {"native": 6_000, "python": 50_000}
#: what the engine does not time, per unit of what it does (both scale with the machine). Measured between
#: back-to-back ops on the development machine: python 0.6-0.8 of ``ops.probe_ns`` (p90 1.2-1.4); native
#: 1.5-4.6 of its sampled callbacks (the function mode and RecordFunction's own work are not timed)
UNTIMED_RATIO = {"native": 5.0, "python": 1.5}


def _np(col: Any, fill: Any = 0) -> np.ndarray:
    out: np.ndarray = pc.fill_null(col, fill).to_numpy(zero_copy_only=False)
    return out


def outside_ops(ops: pa.Table, calls: pa.Table, wall_ns: Optional[int],
                tracer_ns: int = 0, rows: Optional[int] = None, *, own_op_ns: int = 0,
                untimed_ratio: float = 0.0) -> Optional[dict[str, Any]]:
    """``{wall_ns, span_ns, in_ops_ns, outside_ns, share, gaps: [(gap_ns, seq_before, seq_after)], dataloader_ns}``:
    the advisor adds ``tiny_ops`` and ``steps``. The span runs from the first op's start to the last op's end (the trace's own start and stop are
    not the program's), ``share`` is ``outside_ns / span_ns``. One pass in start order, ``rows`` (``opview.BATCH_ROWS``)
    at a time (``_start_order``): the running end of the ops so far, the sum of the gaps and the largest gaps."""
    if not wall_ns or ops.num_rows == 0:
        return None
    probe = "probe_ns" in ops.column_names and ops.column("probe_ns").null_count < ops.num_rows
    g = _Gaps(tracer_ns, untimed_ratio)
    for part in _start_order(ops, rows, probe, "is_noise" in ops.column_names, own_op_ns):
        g.feed(*part)
    span = g.run_end - g.first_start
    in_ops = max(span - g.outside, 0)
    gaps = [(gap, before, after) for _, _, gap, before, after in sorted(g.top) if gap > 0 and after is not None]
    dl = 0
    step = max(int(rows or BATCH_ROWS), 1)
    for off in range(0, calls.num_rows, step):     # the calls a record batch at a time
        b = calls.slice(off, step)
        m = string_mask(b.column("qualname"), lambda v: "DataLoader" in v)
        if m.any():
            dl += int(pc.sum(pc.filter(b.column("dur_ns"), pa.array(m))).as_py() or 0)
    return {"wall_ns": int(wall_ns), "span_ns": span, "in_ops_ns": in_ops, "outside_ns": g.outside,
            "share": g.outside / span if span else 0.0, "gaps": gaps, "dataloader_ns": dl}


def _largest(v: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` largest values of ``v`` (ties: the earliest), in position order."""
    if k >= len(v):
        return np.arange(len(v))
    kth = np.partition(v, len(v) - k)[len(v) - k]
    above = np.flatnonzero(v > kth)
    return np.sort(np.concatenate((above, np.flatnonzero(v == kth)[:k - len(above)])))


Part = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _start_order(ops: pa.Table, rows: Optional[int], probe: bool, noise: bool, own: int = 0) -> Iterator[Part]:
    """``(start, end, seq, own, is_noise)`` of the rows in start order (ties in row order: a stable sort), a
    slice at a time. Rows in dispatch order start in order, and each slice goes as it is; where they do not,
    a slice's rows that start after the earliest start of a later slice are held back (``held``) and merged
    into the next slice. What is held is bounded by the disorder, not the trace: the rows that start after
    some later row (an outer op recorded after the ops inside it); only rows in reverse start order all along
    would hold the window."""
    step = max(int(rows or BATCH_ROWS), 1)
    n = ops.num_rows
    starts = [ops.column("start_ns").slice(off, step) for off in range(0, n, step)]
    # the earliest start of every later slice: the rows held until then (one min per slice, read once)
    mins = [pc.min(pc.fill_null(c, 0)).as_py() for c in starts]
    later = np.minimum.accumulate(np.array(mins[1:] + [np.iinfo(np.int64).max], dtype=np.int64)[::-1])[::-1]
    held: Optional[Part] = None
    for k, off in enumerate(range(0, n, step)):
        sl = ops.slice(off, step)
        s = _np(starts[k])
        e = s + _np(sl.column("cpu_ns"))
        part: Part = (s, e, _np(sl.column("seq")),   # the tracer's own time after each row: timed per row, or a mean
                      _np(sl.column("probe_ns"), own) if probe else np.full(len(s), own, np.int64),
                      _np(sl.column("is_noise"), False).astype(bool) if noise else np.zeros(len(s), bool))
        if held is not None:
            part = tuple(np.concatenate((a, b)) for a, b in zip(held, part))  # type: ignore[assignment]
        s = part[0]
        if len(s) > 1 and not bool((s[1:] >= s[:-1]).all()):
            order = np.argsort(s, kind="stable")
            part = tuple(a[order] for a in part)  # type: ignore[assignment]
        cut = int(np.searchsorted(part[0], later[k], side="right"))   # rows no later row starts before
        held = tuple(a[cut:] for a in part) if cut < len(part[0]) else None  # type: ignore[assignment]
        if cut:
            yield tuple(a[:cut] for a in part)  # type: ignore[misc]


class _Gaps:
    """The time outside ops, fed the rows in start order a part at a time: a gap opens where an op starts after
    every earlier op ended (less ``tracer_ns`` and the probes of the op before it); its sum, the span, and the
    ``_GAPS_LISTED`` largest gaps (largest first, ties by position), each named by the real ops around it."""

    def __init__(self, tracer_ns: int, untimed_ratio: float = 0.0) -> None:
        self.tracer_ns = tracer_ns
        self.untimed_ratio = untimed_ratio
        self.n = 0                       # rows fed so far (the position of the next)
        self.first_start = 0
        self.run_end = 0                 # the latest end so far
        self.prev_probe = 0              # the probe time of the last row fed
        self.outside = 0
        self.last_real: Optional[int] = None   # the seq of the last real (not bookkeeping) row fed
        #: (-gap, position, gap, seq before, seq after): a gap whose real op after it is not fed yet has None
        self.top: list[list[Any]] = []

    def feed(self, s: np.ndarray, e: np.ndarray, q: np.ndarray, probe: np.ndarray, noise: np.ndarray) -> None:
        if not len(s):
            return
        first = self.n == 0
        if first:
            self.first_start = int(s[0])
        prev_end = np.maximum.accumulate(np.concatenate(([self.run_end], e)))
        gap = np.maximum(s - prev_end[:-1], 0)
        if first:
            gap[0] = 0                   # before the first op: the trace starting, not the program
        # the tracer's own timed work after an op (python engine: bookkeeping, probes, hooks) ran in the gap
        # before the next op to start; what it could not time is at least tracer_ns, or in proportion
        own = np.concatenate(([self.prev_probe], probe[:-1]))
        gap = np.maximum(gap - own - np.maximum(self.tracer_ns, (self.untimed_ratio * own).astype(np.int64)), 0)
        self.outside += int(gap.sum())
        # a gap is named by the ops around it that the program asked for: eager's own bookkeeping rows
        # (``is_noise``: lift_fresh, detach_ inside torch.tensor) are never its subject, the next real op is
        real = np.flatnonzero(~noise)
        if len(real):
            for t in self.top:           # gaps before this part still waiting for the real op after them
                if t[4] is None:
                    t[4] = int(q[real[0]])
        for i in _largest(gap, _GAPS_LISTED).tolist():
            j = int(np.searchsorted(real, i))   # the first real op at or after the gap
            after = int(q[real[j]]) if j < len(real) else None
            before = int(q[real[j - 1]]) if j > 0 else self.last_real
            self.top.append([-int(gap[i]), self.n + i, int(gap[i]), before, after])
        self.top = sorted(self.top)[:_GAPS_LISTED]
        if len(real):
            self.last_real = int(q[real[-1]])
        self.run_end = int(prev_end[-1])
        self.prev_probe = int(probe[-1])
        self.n += len(s)


def gpu_idle(ops: pa.Table, kernels: pa.Table, rows: Optional[int] = None) -> list[dict[str, Any]]:
    """One dict per device: ``device, busy_ns, idle_ns, host_wait_ns, launch_ns, n_gaps, span_ns, n_kernels,
    gap_seqs`` (the ops that launched the kernels after the largest gaps)."""
    if kernels.num_rows == 0:
        return []
    k = kernels.filter(pc.invert(pc.is_null(kernels.column("start_ns"))))
    if k.num_rows == 0:
        return []
    op_start: dict[int, int] = {}       # the start of the ops that launched a kernel (not of every op)
    need = np.unique(_np(k.column("seq"), -1))
    need = need[need >= 0]
    step = max(int(rows or BATCH_ROWS), 1)
    for off in range(0, ops.num_rows if len(need) else 0, step):
        sl = ops.slice(off, step)
        sq = _np(sl.column("seq"))
        m = np.isin(sq, need)
        if m.any():
            op_start.update(zip(sq[m].tolist(), _np(sl.column("start_ns"))[m].tolist()))
    out = []
    devs = _np(k.column("device"), -1)
    for dev in sorted(set(devs.tolist())):
        m = devs == dev
        s = _np(k.column("start_ns"))[m]
        e = s + _np(k.column("dur_ns"))[m]
        seqs = _np(k.column("seq"), -1)[m]
        order = np.argsort(s, kind="stable")
        s, e, seqs = s[order], e[order], seqs[order]
        run_end = np.maximum.accumulate(e)
        busy = 0
        host_wait = launch = n_gaps = 0
        gap_list: list[Any] = []
        cur_s, cur_e = int(s[0]), int(e[0])
        for i in range(1, len(s)):
            if s[i] <= run_end[i - 1]:
                cur_e = max(cur_e, int(e[i]))
                continue
            busy += cur_e - cur_s
            g0, g1 = int(run_end[i - 1]), int(s[i])
            n_gaps += 1
            launched = op_start.get(int(seqs[i])) if seqs[i] >= 0 else None
            hw = min(max(launched - g0, 0), g1 - g0) if launched is not None else 0
            host_wait += hw
            if seqs[i] >= 0:
                gap_list.append((g1 - g0, int(seqs[i])))
            launch += (g1 - g0) - hw
            cur_s, cur_e = int(s[i]), int(e[i])
        busy += cur_e - cur_s
        span = int(run_end[-1]) - int(s[0])
        out.append({"device": int(dev), "busy_ns": busy, "idle_ns": span - busy, "host_wait_ns": host_wait,
                    "launch_ns": launch, "n_gaps": n_gaps, "span_ns": span, "n_kernels": int(len(s)),
                    "gap_seqs": [q for _, q in sorted(gap_list, key=lambda x: -x[0])[:_GAPS_LISTED]]})
    return out
