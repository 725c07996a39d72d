"""Time outside ops and GPU idle time: where a traced block spent its wall time when no op ran.

``outside_ops(ops, calls, wall_ns)``: the union of the ops' host intervals
(``start_ns``, ``start_ns + cpu_ns``) against the span from the first op to the last; the rest
is Python, data loading and everything else between ops. The largest gaps are named by the ops around them;
``DataLoader`` time is the calls whose qualname names one (when data loading ran through a
recorded torch-level call). A traced gap also holds tensorscope's own work between two ops (the
probes after one op, the bookkeeping before the next), which eager never runs: each gap counts only
past ``tracer_ns``, the engine's per-op cost (``TRACER_NS``, upper bounds of what
``benchmarks/overhead.py`` measures for a whole op), so a gap the tracer alone could explain is no finding,
and past the recorded time of tensorscope's own probes after the op before it (``ops.probe_ns``: the
non-finite screen, the numerics shadow, op hooks), which can be far longer than the op itself.

On a busy machine the gaps also hold other processes' time: the advisor leaves out the time the
recording thread was runnable but waiting for a CPU (``metadata["run_delay_ns"]``, from
``/proc/thread-self/schedstat``), from the gaps and from the wall it compares them with.

``gpu_idle(ops, kernels)``: per device, the time between kernels (their intervals merged), each
gap split into ``host_wait`` (the GPU idle before the host even started the op that launched the
next kernel: the host was busy elsewhere) and ``launch`` (the op had started: launch latency
and queueing). Needs the ``kernels`` table (``trace(kernels=True)`` on CUDA).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .opview import string_mask

_GAPS_LISTED = 3
#: tensorscope's own cost per op, by engine (ns): an upper bound of the per-op overhead benchmarks/overhead.py
#: measures end to end (native ~2-6 us, python ~25-50 us on the development machine), the part of a gap
#: between two traced ops that may be the tracer's rather than the program's
TRACER_NS = {"native": 6_000, "python": 50_000}


def _np(col: Any, fill: Any = 0) -> np.ndarray:
    out: np.ndarray = pc.fill_null(col, fill).to_numpy(zero_copy_only=False)
    return out


def outside_ops(ops: pa.Table, calls: pa.Table, wall_ns: Optional[int],
                tracer_ns: int = 0) -> Optional[dict[str, Any]]:
    """``{wall_ns, span_ns, in_ops_ns, outside_ns, share, gaps: [(gap_ns, seq_before, seq_after)], dataloader_ns}``:
    the advisor adds ``tiny_ops`` and ``steps``. The span runs from the first op's start to the last op's end (the trace's own start and stop are
    not the program's), ``share`` is ``outside_ns / span_ns``."""
    if not wall_ns or ops.num_rows == 0:
        return None
    start = _np(ops.column("start_ns"))
    end = start + _np(ops.column("cpu_ns"))
    seq = _np(ops.column("seq"))
    if len(start) < 2 or bool((start[1:] >= start[:-1]).all()):
        s, e, q = start, end, seq                 # rows in dispatch order already start in order
    else:
        order = np.argsort(start, kind="stable")
        s, e, q = start[order], end[order], seq[order]
    run_end = np.maximum.accumulate(e)
    # a gap opens where an op starts after every earlier op ended
    prev_end = np.concatenate([[0], run_end[:-1]])
    gap = np.maximum(s - prev_end, 0)
    gap[0] = 0                              # before the first op: the trace starting, not the program
    if tracer_ns:                           # what the tracer itself may have spent between two ops
        gap = np.maximum(gap - tracer_ns, 0)
    if "probe_ns" in ops.column_names and ops.column("probe_ns").null_count < ops.num_rows:
        probe = _np(ops.column("probe_ns"))
        probe = probe if s is start else probe[order]
        # the probes after an op (screen, numerics shadow) ran in the gap before the next op to start
        gap[1:] = np.maximum(gap[1:] - probe[:-1], 0)
    span = int(run_end[-1]) - int(s[0])
    outside = int(gap.sum())
    in_ops = max(span - outside, 0)
    k = min(_GAPS_LISTED, len(gap))
    part = np.argpartition(-gap, k - 1)[:k] if k < len(gap) else np.arange(len(gap))
    top = part[np.argsort(-gap[part], kind="stable")]
    # a gap is named by the ops around it that the program asked for: eager's own bookkeeping rows
    # (``is_noise``: lift_fresh, detach_ inside torch.tensor) are never its subject, the next real op is
    real = np.arange(len(q))                     # positions (in start order) of the real ops
    if "is_noise" in ops.column_names:
        noise = _np(ops.column("is_noise"), False).astype(bool)
        real = real[~(noise if q is seq else noise[order])]
    gaps = []
    for i in top:
        j = int(np.searchsorted(real, i))        # the first real op at or after the gap
        if gap[i] <= 0 or j == len(real):        # (only bookkeeping after it: nothing to name)
            continue
        after = int(q[real[j]])
        before = int(q[real[j - 1]]) if j > 0 else None
        gaps.append((int(gap[i]), before, after))
    dl = 0
    if calls.num_rows:
        m = string_mask(calls.column("qualname"), lambda v: "DataLoader" in v)
        if m.any():
            dl = int(pc.sum(pc.filter(calls.column("dur_ns"), pa.array(m))).as_py() or 0)
    return {"wall_ns": int(wall_ns), "span_ns": span, "in_ops_ns": in_ops, "outside_ns": outside,
            "share": outside / span if span else 0.0, "gaps": gaps, "dataloader_ns": dl}


def gpu_idle(ops: pa.Table, kernels: pa.Table) -> list[dict[str, Any]]:
    """One dict per device: ``device, busy_ns, idle_ns, host_wait_ns, launch_ns, n_gaps, span_ns, n_kernels,
    gap_seqs`` (the ops that launched the kernels after the largest gaps)."""
    if kernels.num_rows == 0:
        return []
    k = kernels.filter(pc.invert(pc.is_null(kernels.column("start_ns"))))
    if k.num_rows == 0:
        return []
    op_start: dict[int, int] = {}
    if ops.num_rows:
        op_start = dict(zip(_np(ops.column("seq")).tolist(), _np(ops.column("start_ns")).tolist()))
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
