"""The advisor's findings: why a traced block is slow, each finding proved by the rows it names.

``advise_tables(windows, peaks) -> dict`` takes one mapping per trace (``ops``, ``calls``,
``kernels``, ``layout_changes``, ``wall_ns``, ``steps``; optional ``cells``, the cell-file map, and
``flops_known``) and returns the ``findings``
(schema ``ADVICE``), ``syncs`` (``SYNCS``), ``roofline`` (``ROOFLINE``), ``outside`` (time
outside ops per window) and ``gpu_idle``. A finding says what was seen, which rows show it,
what they cost (their measured time) and the change that would remove it; a finding is made
only from rows, and a row with ``is_noise`` is never its subject (a scalar read's subject is
the torch-level call that read it). Thresholds are module constants, written in
docs/guide/performance-findings.md.

Which rows a finding may rest on:

* ``first_run`` rows (the first execution in the process of an op, shapes, dtypes and device: one-time
  initialisation) are left out of the timing findings (roofline, overhead, amp); when they hold at least
  ``COLD_SHARE`` of the op time, ``first_run`` ("run the cell again"; shown when they took at least
  ``COLD_NOTE_NS``) replaces every timing finding, and only the structural ones (syncs, layout, zero_grad, host copies: read from what ran) stay;
* a performance finding needs a cost of at least ``min_share`` of the op time (``DisplayOptions``
  ``min_finding_share``); one without a measured cost (a layout mix inside a convolution) is kept;
* a prediction (``predicted``: FakeTensor times) gets no timing finding, and the structural ones
  (syncs, layout, zero_grad, host copies, tiny ops) carry no cost;
* percentages of time are of the trace's wall time from enter to exit (``wall_ns``), the overview's base.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .._common import fmt_bytes, fmt_ns
from .findings import _CELLS, _advice_table, _finding, _rows_of, _where
from .idle import TRACER_NS, gpu_idle, outside_ops
from .layout_findings import _CONV, _layout_findings
from .opview import OpView, first_of, short_name
from .roofline import ROOF_SHARE, Peaks, roofline
from .syncs import infer_steps, sync_table, tiny_mask

TINY_BYTES = 64 * 1024          # an op moving less than this ...
TINY_FLOPS = 1 << 20            # ... and doing fewer FLOPs is "tiny": its time is mostly dispatch
TINY_MIN = 100                  # the overhead finding needs at least this many tiny ops ...
TINY_SHARE = 0.5                # ... making at least this share of the ops
OUTSIDE_SHARE = 0.3             # time outside ops worth a finding (share of the wall time) ...
OUTSIDE_MIN_NS = 5_000_000      # ... and at least this much
TOP_SHARE = 0.2                 # an op group taking this share of op time gets a roofline finding
AMP_GAIN = 1.5                  # a 16-bit GEMM this many times faster than fp32 (same shape) makes AMP worth suggesting
AMP_SHARE = 0.5                 # ... when compute-bound fp32 GEMMs/convolutions take this share of warm op time
COLD_SHARE = 0.5                # first-run rows holding this share of op time make the cell "cold" ...
COLD_NOTE_NS = 2_000_000        # ... and the first_run note is shown when they took at least this long (a cold
                                # cell of a few hundred µs has nothing a user would read as slowness)
MIN_SHARE = 0.01                # default significance: a performance finding costs this share of op time
SYNC_REPEAT = 3                 # a CPU sync seen this many times at one line (a loop) is a finding whatever its time
#: findings that say where the time goes rather than what to change: listed after the problems
DESCRIPTIVE = frozenset({"compute_bound", "memory_bound", "below_roof"})
#: findings read from timings (none on a prediction)
TIMING_KINDS = frozenset({"compute_bound", "memory_bound", "below_roof", "amp", "outside_ops", "gpu_idle"})
_GEMM = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation"} | _CONV)
_OPTIM_INPLACE = frozenset({"add_", "mul_", "addcmul_", "addcdiv_", "lerp_", "sqrt", "div_", "maximum", "sub_"})

_SYNC_FIX = {
    "scalar_read": "keep the value on the device: accumulate into a tensor (total += loss.detach()) and read it "
                   "once after the loop; replace `if t:` / Python branching on a tensor by torch.where or masking",
    "data_dependent_shape": "use a fixed-size form: torch.where(mask, x, 0) or masked_fill instead of x[mask], "
                            "torch.nonzero_static(x, size=N), or move it out of the loop",
    "host_copy": "move the copy out of the loop (collect on the device, copy once), or copy asynchronously into "
                 "pinned memory with .to('cpu', non_blocking=True) and synchronise once",
}


def _sync_findings(syncs: pa.Table, noise_ops: frozenset[str], multi: bool, steps: Optional[int]) -> list[dict[str, Any]]:
    if syncs.num_rows == 0:
        return []
    noise = np.array([short_name(o) in noise_ops for o in syncs.column("op").to_pylist()], dtype=bool)
    has_call = ~np.asarray(pc.is_null(syncs.column("call")).to_numpy(zero_copy_only=False), dtype=bool)
    keep = ~noise | has_call          # a bookkeeping row with no call to name: never a subject on its own
    st = syncs.filter(pa.array(keep))
    if st.num_rows == 0:
        return []
    subj = pc.if_else(pa.array(noise[keep]), st.column("call"), st.column("op"))
    g = st.append_column("subject", subj).group_by(
        ["kind", "subject", "source_file", "source_line"], use_threads=False).aggregate(
        [("seq", "list"), ("window", "list"), ("cpu_ns", "sum"), ("device", "distinct"), ("op", "min"),
         ("module", "min"), ("seq", "min")])
    out = []
    for r in sorted(g.to_pylist(), key=lambda r: (r["window_list"][0], r["seq_min"])):
        kind, subj_, f, line = r["kind"], r["subject"], r["source_file"], r["source_line"]
        n = len(r["seq_list"])
        devs = sorted({d or "?" for d in r["device_distinct"]})
        on_gpu = any(d not in ("cpu", "?") for d in devs)
        per = f" ({n / steps:g} per step)" if steps else ""
        seen = (f"{subj_} at {_where(f, line)} ran {n}x{per} on {', '.join(devs)} "
                f"({r['op_min']}: {kind.replace('_', ' ')})")
        seen += ("; each one waits for every kernel queued before it" if on_gpu else
                 "; on a GPU each one would wait for every kernel queued before it")
        pairs = (np.asarray(r["window_list"], dtype=np.int64), np.asarray(r["seq_list"], dtype=np.int64))
        f_ = _finding("sync", f"{subj_} ({kind.replace('_', ' ')})", seen, pairs, multi, r["cpu_ns_sum"] or 0,
                      _SYNC_FIX[kind], steps, r["module_min"], f, line)
        # on a CPU trace a sync's own time is not the wait it makes on a GPU: one repeated in a loop counts
        f_["cost_floor_exempt"] = not on_gpu and n >= SYNC_REPEAT
        out.append(f_)
    return out


def _zero_grad_findings(wins: Sequence[Mapping[str, Any]], multi: bool, steps: Optional[int]) -> list[dict[str, Any]]:
    groups: OrderedDict[tuple[Any, ...], list[dict[str, Any]]] = OrderedDict()
    for w, win in enumerate(wins):
        for r in _rows_of(w, win["view"], frozenset({"zero_", "_foreach_zero_"}),
                          ["seq", "op", "in_storages", "cpu_ns", "module", "source_file", "source_line"]):
            groups.setdefault((r["source_file"], r["source_line"]), []).append(r)
    out = []
    for (f, line), rs in groups.items():
        storages = {s for r in rs for s in (r["in_storages"] or []) if s is not None and s >= 0}
        if len(storages) < 2 or rs[0]["module"] is not None:
            continue
        seen = f"{len(rs)} in-place zero ops on {len(storages)} distinct tensors at {_where(f, line)}"
        out.append(_finding("zero_grad", f"zeroing at {_where(f, line)}", seen, [(r["window"], r["seq"]) for r in rs],
                            multi, sum(r["cpu_ns"] or 0 for r in rs),
                            "if these are gradients: optimizer.zero_grad(set_to_none=True) (the default since "
                            "torch 2.0) frees them instead of writing zeros", steps, None, f, line))
    return out


def _overhead_findings(wins: Sequence[Mapping[str, Any]], multi: bool, steps: Optional[int],
                       cuda: bool) -> list[dict[str, Any]]:
    ws: list[np.ndarray] = []
    ss: list[np.ndarray] = []
    cost = 0
    n_work = 0
    names: dict[tuple[str, Optional[str], Optional[int]], int] = {}
    optim = 0
    for w, win in enumerate(wins):
        ops, view = win["ops"], win["view"]
        if ops.num_rows == 0:
            continue
        m = tiny_mask(ops, TINY_BYTES, TINY_FLOPS, view.noise)
        n_work += int((~view.noise).sum())
        if not m.any():
            continue
        ss.append(view.seq[m])
        ws.append(np.full(int(m.sum()), w, dtype=np.int64))
        tiny = ops.select(["op", "source_file", "source_line", "module", "cuda_ns", "cpu_ns"]).filter(pa.array(m))
        cost += int(pc.sum(pc.coalesce(tiny.column("cuda_ns"), tiny.column("cpu_ns"))).as_py() or 0)
        g = tiny.select(["op", "source_file", "source_line", "module"]).group_by(
            ["op", "source_file", "source_line", "module"], use_threads=False).aggregate([("source_line", "count")])
        for r in S.plain_strings(g).to_pylist():
            k = (r["op"], r["source_file"], r["source_line"])
            names[k] = names.get(k, 0) + r["source_line_count"]
            if r["module"] is None and short_name(r["op"]) in _OPTIM_INPLACE:
                optim += r["source_line_count"]
    n_tiny = sum(len(x) for x in ss)
    if n_tiny < TINY_MIN or not n_work or n_tiny / n_work < TINY_SHARE:
        return []
    pairs = (np.concatenate(ws), np.concatenate(ss))
    top = sorted(names.items(), key=lambda kv: -kv[1])[:3]
    per = f" ({n_tiny / steps:g} per step)" if steps else ""
    seen = (f"{n_tiny} of {n_work} ops{per} move under {fmt_bytes(TINY_BYTES)} each, so their time is mostly "
            f"per-op dispatch: " + ", ".join(f"{short_name(op)} at {_where(f, ln)} x{c}" for (op, f, ln), c in top))
    fixes = ["torch.compile(model) fuses them into few kernels"]
    if cuda:
        fixes.append("CUDA graphs (torch.compile(mode='reduce-overhead')) remove the launches")
    if optim:
        fixes.append(f"{optim} of them are in-place updates outside any module: an optimizer with foreach=True "
                     "or fused=True runs them as a few multi-tensor kernels")
    fixes.append("a bigger batch amortises the per-op cost")
    return [_finding("overhead", f"{n_tiny} tiny ops", seen, pairs, multi, cost, "; ".join(fixes), steps)]


def _outside_findings(outs: list[Optional[dict[str, Any]]], wins: Sequence[Mapping[str, Any]],
                      multi: bool, steps: Optional[int]) -> list[dict[str, Any]]:
    wall = sum(o["wall_ns"] or o["span_ns"] for o in outs if o)   # enter to exit: the overview's base
    # the time the recording thread waited for a CPU (a busy machine) is other processes' time, not the program's:
    # left out of the gaps and of the wall it is compared with
    waited = sum(min(o.get("run_delay_ns") or 0, o["outside_ns"]) for o in outs if o)
    outside = sum(o["outside_ns"] for o in outs if o) - waited
    base = wall - sum(min(o.get("run_delay_ns") or 0, o["wall_ns"] or o["span_ns"]) for o in outs if o)
    if not wall or base <= 0 or outside < OUTSIDE_MIN_NS or outside / base < OUTSIDE_SHARE:
        return []
    gaps = sorted(((g, w, a, b) for w, o in enumerate(outs) if o for g, a, b in o["gaps"]), key=lambda x: -x[0])[:3]
    if not gaps:
        return []
    lines = []
    pairs: list[tuple[int, int]] = []
    for g, w, a, b in gaps:
        ops = wins[w]["ops"]
        loc = S.plain_strings(ops.select(["seq", "op", "source_file", "source_line"]).filter(
            pc.is_in(ops.column("seq"), value_set=pa.array([x for x in (a, b) if x is not None], pa.int64())))).to_pylist()
        by = {r["seq"]: r for r in loc}
        before = by.get(a)
        after = by[b]
        lines.append(f"{fmt_ns(g)} before {short_name(after['op'])} at {_where(after['source_file'], after['source_line'])}"
                     + (f" (after {short_name(before['op'])} at {_where(before['source_file'], before['source_line'])})"
                        if before else ""))
        pairs.extend((w, s) for s in (a, b) if s is not None)
    dl = sum(o["dataloader_ns"] for o in outs if o)
    where = (f"{100 * outside / wall:.0f}% of the wall time ({fmt_ns(outside)} of {fmt_ns(wall)})" if base == wall else
             f"{100 * outside / base:.0f}% of the thread's own time ({fmt_ns(outside)} of {fmt_ns(base)}: the wall "
             f"{fmt_ns(wall)} less {fmt_ns(wall - base)} waiting for a CPU)")
    seen = (f"{where} ran outside any op, each gap less tensorscope's own per-op work: Python, data loading, I/O; "
            f"largest gaps: " + "; ".join(lines))
    if dl:
        seen += f"; DataLoader calls took {fmt_ns(dl)}"
    fix = ("move Python work (per-element loops, logging, host-side metrics) out of the step; load data in "
           "DataLoader workers (num_workers>0, pin_memory=True); torch.compile removes the Python between ops")
    return [_finding("outside_ops", "time outside ops", seen, pairs, multi, outside, fix, None,
                     what="gaps next to ops seq")]


def _roofline_findings(roof: pa.Table, wins: Sequence[Mapping[str, Any]], peaks: Optional[Peaks], multi: bool,
                       steps: Optional[int], speedup: Optional[Any] = None) -> list[dict[str, Any]]:
    ops_rows = [r for r in roof.to_pylist() if r["level"] == "op"]
    total = sum(r["time_ns"] or 0 for r in ops_rows)
    out: list[dict[str, Any]] = []
    if not total:
        return out
    for r in ops_rows:
        share = (r["time_ns"] or 0) / total
        if share < TOP_SHARE or r["bound"] not in ("compute", "memory", "below_roof"):
            continue
        pairs = _seqs_of(wins, r["name"], r["dtype"])
        rate = _rate(r["flops_per_s"], "FLOP/s") if r["flops"] else _rate(r["bytes_per_s"], "B/s")
        frac = 100 * (r["roof_fraction"] or 0)
        if r["bound"] == "below_roof":
            seen = (f"{r['name']} ({r['dtype']}) took {100 * share:.0f}% of warm op time at {rate}, {frac:.0f}% of the "
                    f"{r['device']} roof (under {100 * ROOF_SHARE:.0f}%: neither compute- nor memory-bound); "
                    + _below_reason(r, wins, peaks))
            fix = ("bring the work to the roof: " + _below_fix(r, wins, peaks))
            out.append(_finding("below_roof", r["name"], seen, pairs, multi, r["time_ns"], fix, None))
            continue
        seen = (f"{r['name']} ({r['dtype']}) took {100 * share:.0f}% of warm op time; {r['bound']}-bound at {rate}, "
                f"{frac:.0f}% of the {r['device']} roof at intensity {r['intensity'] or 0:.1f} FLOP/byte")
        if r["bound"] == "compute":
            fix = (f"it runs at {frac:.0f}% of the measured peak: to go faster, fewer FLOPs (smaller layers), lower "
                   "precision or a faster device")
        else:
            fix = ("fuse it with its neighbours (torch.compile) so the data is read once; 16-bit dtypes halve the bytes")
        out.append(_finding(f"{r['bound']}_bound", r["name"], seen, pairs, multi, r["time_ns"], fix, None))
    amp = _amp_finding(ops_rows, total, wins, peaks, multi, steps, speedup)
    if amp:
        out.append(amp)
    return out


def _rate(v: Optional[float], unit: str) -> str:
    v = v or 0.0
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:.3g} {prefix}{unit}"
    return f"{v:.3g} {unit}"


def _gemm_shape(wins: Sequence[Mapping[str, Any]], op: str) -> Optional[tuple[int, int, int, int]]:
    """(batch, M, K, N) of the longest-running shape of matmul ``op`` (mm, addmm, bmm, baddbmm), or None."""
    if short_name(op) not in ("mm", "addmm", "bmm", "baddbmm"):
        return None
    best: dict[tuple[int, int, int, int], int] = {}
    for win in wins:
        view = win["view"]
        m = view.mask(lambda n: n == op)
        for r in view.rows(m, ["in_shapes", "cpu_ns"]):
            sh = [x for x in (r["in_shapes"] or []) if x is not None and len(x) >= 2]
            if len(sh) < 2:
                continue
            a, b = sh[-2], sh[-1]
            key = (int(a[0]) if len(a) == 3 else 1, int(a[-2]), int(a[-1]), int(b[-1]))
            best[key] = best.get(key, 0) + (r["cpu_ns"] or 0)
    return max(best, key=best.__getitem__) if best else None


def _amp_finding(ops_rows: list[dict[str, Any]], total: int, wins: Sequence[Mapping[str, Any]],
                 peaks: Optional[Peaks], multi: bool, steps: Optional[int], speedup: Optional[Any]
                 ) -> Optional[dict[str, Any]]:
    """``amp`` only where compute-bound float32 GEMMs/convolutions take ``AMP_SHARE`` of warm op time and a
    16-bit GEMM of the same shape measured ``AMP_GAIN`` times faster (``speedup``), or, for a trace read on
    another machine, its recorded peaks at the nearest measured size."""
    gemm = [r for r in ops_rows if r["dtype"] == "float32" and short_name(r["name"]) in _GEMM and r["bound"] == "compute"]
    fp32_gemm = sum(r["time_ns"] or 0 for r in gemm)
    if not gemm or fp32_gemm / total < AMP_SHARE:
        return None
    top = max(gemm, key=lambda r: r["time_ns"] or 0)
    shape = _gemm_shape(wins, top["name"])
    got: Optional[tuple[str, float, str]] = None
    if speedup is not None and shape is not None:
        got = speedup(shape)
    if got is None:
        got = _nearest_size_gain(peaks, top)
    if got is None or got[1] < AMP_GAIN:
        return None
    dtype16, gain, how = got
    sq = [_seqs_of(wins, r["name"], r["dtype"]) for r in gemm]
    pairs = (np.concatenate([g[0] for g in sq]), np.concatenate([g[1] for g in sq]))
    seen = (f"compute-bound float32 matmuls/convolutions took {100 * fp32_gemm / total:.0f}% of warm op time, and "
            f"{dtype16} {how} ran {gain:.1f}x faster than float32 on this device")
    return _finding("amp", "float32 matmuls and convolutions", seen, pairs, multi, fp32_gemm,
                    f"run the forward under torch.autocast(device_type, dtype=torch.{dtype16})", steps)


def _nearest_size_gain(peaks: Optional[Peaks], r: Mapping[str, Any]) -> Optional[tuple[str, float, str]]:
    """(16-bit dtype, its rate / float32's, how) at the measured GEMM size nearest the group's FLOPs per op."""
    p = (peaks or {}).get(r["device"] or "cpu") or {}
    det = p.get("detail") or {}
    f32 = (det.get("float32") or {}).get("sizes") or {}
    if not f32 or not r["n_ops"]:
        return None
    per_op = (r["flops"] or 0) / r["n_ops"]
    size = min(f32, key=lambda n: abs(np.log(max(2 * int(n) ** 3, 1)) - np.log(max(per_op, 1))))
    best: Optional[tuple[str, float, str]] = None
    for d16 in ("bfloat16", "float16"):
        s16 = ((det.get(d16) or {}).get("sizes") or {}).get(size)
        if s16 and f32[size].get("best"):
            g = s16["best"] / f32[size]["best"]
            if best is None or g > best[1]:
                best = (d16, g, f"at the nearest measured peak size ({size}^3 GEMM)")
    return best


def _below_reason(r: Mapping[str, Any], wins: Sequence[Mapping[str, Any]], peaks: Optional[Peaks]) -> str:
    """The likely reason an op group stays under the roof, from what the rows and the peaks say."""
    p = (peaks or {}).get(r["device"] or "cpu") or {}
    why = []
    per_op = (r["flops"] or 0) / max(r["n_ops"], 1)
    if short_name(r["name"]) in _GEMM and per_op and per_op < 2 * 256 ** 3:
        why.append(f"small work per op ({per_op / 1e6:.1f} MFLOP, under a 256^3 GEMM): libraries reach their peak on "
                   "larger shapes")
    if r["dtype"] in ("bfloat16", "float16") and r["device"] == "cpu" and p.get("bf16_native") is False:
        why.append(f"{r['dtype']} has no native support on this CPU (emulated)")
    threads, cores = p.get("threads"), p.get("cpu_count")
    if r["device"] == "cpu" and threads and cores and threads < cores:
        why.append(f"torch uses {threads} of {cores} cores")
    if p.get("contended"):
        why.append("this machine was busy when the peaks were measured, and may have been while the trace ran")
    if not why:
        why.append("the kernel does not reach the roof at these shapes and layouts (strided inputs, odd sizes, "
                   "or a competing load while the trace ran)")
    return "likely: " + "; ".join(why)


def _below_fix(r: Mapping[str, Any], wins: Sequence[Mapping[str, Any]], peaks: Optional[Peaks]) -> str:
    per_op = (r["flops"] or 0) / max(r["n_ops"], 1)
    if short_name(r["name"]) in _CONV and per_op and per_op < 2 * 256 ** 3:
        return "more work per call: a bigger batch"
    if short_name(r["name"]) in _GEMM and per_op and per_op < 2 * 256 ** 3:
        return "batch the small matmuls into fewer, larger ones (a bigger batch, torch.bmm over stacked inputs)"
    return "run the cell again on an idle machine to confirm; check torch.get_num_threads() and the input layouts"


def _seqs_of(wins: Sequence[Mapping[str, Any]], op: str, dtype: Optional[str] = None) -> tuple[np.ndarray, np.ndarray]:
    """The (window, seq) of the rows of ``op`` (of output dtype ``dtype`` when given) in each window's view."""
    ws, ss = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for w, win in enumerate(wins):
        view = win["view"]
        m = view.mask(lambda n: n == op)
        if dtype is not None and m.any():
            m &= pc.fill_null(pc.equal(win["out_dtype"], dtype), False).to_numpy(zero_copy_only=False)
        ss.append(view.seq[m])
        ws.append(np.full(int(m.sum()), w, dtype=np.int64))
    return np.concatenate(ws), np.concatenate(ss)


def _host_to_device(wins: Sequence[Mapping[str, Any]], multi: bool, steps: Optional[int]) -> list[dict[str, Any]]:
    rs = []
    for w, win in enumerate(wins):
        for r in _rows_of(w, win["view"], frozenset({"_to_copy", "copy_"}),
                          ["seq", "op", "in_devices", "out_devices", "cpu_ns", "module", "source_file", "source_line"]):
            ins, outs = r["in_devices"] or [], r["out_devices"] or []
            src = ins[1] if short_name(r["op"]) == "copy_" and len(ins) > 1 else (ins[0] if ins else None)
            if src == "cpu" and any(d and d.startswith("cuda") for d in outs):
                rs.append(r)
    if not rs:
        return []
    seen = f"{len(rs)} host-to-device copies, {fmt_ns(sum(r['cpu_ns'] or 0 for r in rs))} on the host"
    return [_finding("host_copy", "host-to-device copies", seen, [(r["window"], r["seq"]) for r in rs], multi,
                     sum(r["cpu_ns"] or 0 for r in rs),
                     "pin the host memory (DataLoader(pin_memory=True) or t.pin_memory()) and copy with "
                     ".to(device, non_blocking=True)", steps, rs[0]["module"], rs[0]["source_file"], rs[0]["source_line"])]


def _idle_findings(idle: list[dict[str, Any]], multi: bool) -> list[dict[str, Any]]:
    out = []
    for d in idle:
        if not d["span_ns"] or d["idle_ns"] / d["span_ns"] < OUTSIDE_SHARE or not d["gap_seqs"]:
            continue
        host = d["host_wait_ns"] >= d["launch_ns"]
        seen = (f"cuda:{d['device']} idle {100 * d['idle_ns'] / d['span_ns']:.0f}% of its {fmt_ns(d['span_ns'])} span "
                f"between {d['n_kernels']} kernels: {fmt_ns(d['host_wait_ns'])} waiting for the host to issue work, "
                f"{fmt_ns(d['launch_ns'])} in launch gaps")
        fix = ("the host is the bottleneck: remove syncs and Python from the step, prefetch data"
               if host else "launch-bound: CUDA graphs (torch.compile(mode='reduce-overhead')) or fewer, larger kernels")
        out.append(_finding("gpu_idle", f"cuda:{d['device']} idle time", seen, [(d.get("window", 0), s) for s in d["gap_seqs"]],
                            multi, d["idle_ns"], fix, None, what="kernels after the largest gaps, ops seq"))
    return out


def advise_tables(windows: Sequence[Mapping[str, Any]], peaks: Optional[Peaks] = None, *,
                  min_share: float = MIN_SHARE, predicted: bool = False, speedup: Optional[Any] = None) -> dict[str, Any]:
    """Every finding of ``windows`` (one mapping per trace), with the tables behind them.

    ``min_share``: the least cost, as a share of the op time, of a performance finding; ``predicted``:
    the traces are predictions (no timing finding); ``speedup``: ``(batch, M, K, N) -> (dtype, gain, how)``
    or None, the measured 16-bit speed-up of a GEMM of that shape (the ``amp`` finding's proof)."""
    from .._common import NOISE_OPS

    cells: dict[str, int] = {}
    for w in windows:
        cells.update(w.get("cells") or {})
    token = _CELLS.set(cells or None)
    try:
        return _advise(windows, peaks, NOISE_OPS, min_share, predicted, speedup)
    finally:
        _CELLS.reset(token)


def _drop_amp_on(over: Mapping[str, Any], found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``found`` less the ``amp`` findings that name a (window, row) pair the finding ``over`` names."""
    if not any(f["kind"] == "amp" for f in found):
        return found
    tiny = _row_keys(over)
    return [f for f in found if f["kind"] != "amp" or not np.isin(_row_keys(f), tiny).any()]


def _row_keys(f: Mapping[str, Any]) -> np.ndarray:
    """A finding's (window, row) pairs as one int64 each (a row is an ``ops.seq``, under 2**43): compared
    with ``np.isin``, not as a set of Python tuples (the overhead finding of a trace of small ops names
    every row: ~100 bytes a row as tuples)."""
    out: np.ndarray = np.asarray(f["rows_w"], np.int64) * (1 << 43) + np.asarray(f["rows"], np.int64)
    return out


def _times(ops: pa.Table) -> np.ndarray:
    out: np.ndarray = pc.fill_null(pc.coalesce(ops.column("cuda_ns"), ops.column("cpu_ns")), 0).to_numpy(
        zero_copy_only=False).astype(np.int64)
    return out


def _first_run(ops: pa.Table) -> np.ndarray:
    if "first_run" not in ops.column_names:
        return np.zeros(ops.num_rows, dtype=bool)
    out: np.ndarray = pc.fill_null(ops.column("first_run"), False).to_numpy(zero_copy_only=False).astype(bool)
    return out


def _keep_rows(ops: pa.Table, keep: np.ndarray) -> pa.Table:
    """``ops.filter(keep)``, as zero-copy slices when the kept rows are long runs (the first runs of a
    cell are in its first step): a filter copies every column of a table that may be memory-mapped.
    Runs of under 1024 rows on average (a small trace) are filtered: many short chunks cost more."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], keep.astype(np.int8), [0]))))
    starts, ends = edges[0::2], edges[1::2]
    if len(starts) == 0 or len(starts) * 1024 > len(keep):
        return ops.filter(pa.array(keep))
    return pa.concat_tables([ops.slice(int(a), int(b - a)) for a, b in zip(starts.tolist(), ends.tolist())])


def _out_dtype(ops: pa.Table) -> pa.Array:
    """Per row, the first output dtype (else the first input's): the roofline's dtype of the row (an
    Arrow string array, compared column-wise: no Python string per row)."""
    out: pa.Array = pc.coalesce(first_of(ops.column("out_dtypes")), first_of(ops.column("in_dtypes")))
    return out


def _cold_finding(windows: Sequence[Mapping[str, Any]], first_ns: int, op_ns: int, multi: bool) -> dict[str, Any]:
    ws, ss = [], []
    for w, win in enumerate(windows):
        m = win["first"] & ~win["view"].noise
        ss.append(win["view"].seq[m])
        ws.append(np.full(int(m.sum()), w, dtype=np.int64))
    pairs = (np.concatenate(ws), np.concatenate(ss))
    seen = (f"{100 * first_ns / op_ns:.0f}% of the op time ({fmt_ns(first_ns)} of {fmt_ns(op_ns)}) was the first "
            f"execution in this process of {len(pairs[1])} op/shape/dtype combinations: timings include one-time "
            "initialisation (kernel selection, lazy library set-up, first allocations), so no performance advice is "
            "drawn from them")
    return _finding("first_run", "timings include one-time initialisation", seen, pairs, multi, first_ns,
                    "run the cell again: the next run shows the warm timings the advisor can read", None)


def _advise(windows: Sequence[Mapping[str, Any]], peaks: Optional[Peaks], NOISE_OPS: frozenset[str],
            min_share: float = MIN_SHARE, predicted: bool = False, speedup: Optional[Any] = None) -> dict[str, Any]:
    multi = len(windows) > 1
    steps_each: list[Optional[int]] = [w.get("steps") if w.get("steps") is not None else infer_steps(w["calls"])
                                       for w in windows]
    steps = sum(int(s) for s in steps_each if s) if steps_each and all(steps_each) else None
    wins: list[dict[str, Any]] = [dict(w, view=OpView(w["ops"])) for w in windows]
    windows = wins
    op_ns = first_ns = 0
    warm_wins: list[dict[str, Any]] = []
    for w in wins:
        ops, view = w["ops"], w["view"]
        first = _first_run(ops)
        t = _times(ops)
        work = ~view.noise
        op_ns += int(t[work].sum())
        first_ns += int(t[work & first].sum())
        w["first"] = first
        w["out_dtype"] = _out_dtype(ops) if ops.num_rows else pa.array([], pa.string())
        if first.any():   # the warm rows: what the timing findings read
            wops = _keep_rows(ops, ~first)
            warm_wins.append(dict(w, ops=wops, view=OpView(wops), out_dtype=w["out_dtype"].filter(pa.array(~first))))
        else:
            warm_wins.append(w)
    syncs = [sync_table(w["ops"], w["calls"], i, w["view"]) for i, w in enumerate(windows)]
    sync_t = pa.concat_tables(syncs) if syncs else S.SYNCS.empty_table()
    all_ops = [w["ops"] for w in warm_wins if w["ops"].num_rows]
    ops = S.unify_dictionaries(pa.concat_tables(all_ops)) if len(all_ops) > 1 else (all_ops[0] if all_ops else None)
    flops_known = all(w.get("flops_known", True) for w in windows)
    roof = roofline(ops, peaks, flops_known) if ops is not None else S.ROOFLINE.empty_table()
    outs = [outside_ops(w["ops"], w["calls"], w.get("wall_ns"), TRACER_NS.get(str(w.get("engine")), 0))
            for w in windows]
    for o, w, s in zip(outs, windows, steps_each):
        if o is not None:   # tiny ops per window (and per step), shown whether or not they make a finding
            o["tiny_ops"] = int(tiny_mask(w["ops"], TINY_BYTES, TINY_FLOPS, w["view"].noise).sum())
            o["steps"] = s
            o["run_delay_ns"] = int(w.get("run_delay_ns") or 0)
    idle = []
    for i, w in enumerate(windows):
        k = w.get("kernels")
        if k is not None and k.num_rows:
            for d in gpu_idle(w["ops"], k):
                idle.append(dict(d, window=i))
    cuda = any(r == "cuda" for r in roof.column("device").to_pylist()) if roof.num_rows else False
    found: list[dict[str, Any]] = []
    cold = bool(op_ns) and first_ns >= COLD_SHARE * op_ns and not predicted
    # structural findings: read from what ran, not from how long it took
    found += _sync_findings(sync_t, NOISE_OPS, multi, steps)
    found += _layout_findings(windows, multi, steps)
    found += _zero_grad_findings(windows, multi, steps)
    found += _host_to_device(windows, multi, steps)
    if cold:   # the timings are one-time initialisation: one note instead of the timing findings
        floor = min_share * op_ns
        found = [f for f in found if f["cost_ns"] is None or f["cost_ns"] >= floor or f.get("cost_floor_exempt")]
        if first_ns >= COLD_NOTE_NS:
            found.insert(0, _cold_finding(windows, first_ns, op_ns, multi))
    else:
        over = _overhead_findings(warm_wins, multi, steps, cuda)
        found += over
        if not predicted:
            found += _outside_findings(outs, windows, multi, steps)
            found += _idle_findings(idle, multi)
            roof_found = _roofline_findings(roof, warm_wins, peaks, multi, steps, speedup)
            if over:   # one event, one finding: rows the overhead finding names are no compute-bound amp proof
                roof_found = _drop_amp_on(over[0], roof_found)
            found += roof_found
        else:
            for f in found:
                f["cost_ns"] = None
        floor = min_share * op_ns
        found = [f for f in found if f["cost_ns"] is None or f["cost_ns"] >= floor or not op_ns
                 or f.get("cost_floor_exempt")]
    # the cold note, then the problems by cost, then where the time goes, then amp (which rests on it)
    rank = {"first_run": 0, "amp": 3}
    found.sort(key=lambda f: (rank.get(f["kind"], 2 if f["kind"] in DESCRIPTIVE else 1),
                              -(f["cost_ns"] if f["cost_ns"] is not None else 0)))
    return {"findings": _advice_table(found), "syncs": sync_t, "roofline": roof,
            "outside": outs, "gpu_idle": idle, "steps": steps, "op_ns": op_ns, "first_run_ns": first_ns,
            "cold": cold, "predicted": predicted}
