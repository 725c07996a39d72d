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

How the rows are read: a record batch at a time (``opview.views``, zero-copy slices of at most
``BATCH_ROWS`` rows; ``batch_rows`` in tests), keeping only sums, counts, per-group aggregates, the largest
gaps (``idle.outside_ops``, one pass in start order) and each finding's rows as runs of seq
(``findings.Runs``): no array with an entry per row of the trace. The warm rows are the rows less
``first_run`` ones (an ``OpView(warm_only=True)`` counts them as bookkeeping; the roofline reads the table
with them marked ``is_noise``), never a filtered copy. The result is the same whatever the batch size.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .._common import fmt_bytes, fmt_ns, fmt_rate
from .findings import _CELLS, Runs, _advice_table, _finding, _rows_of, _where
from .idle import TRACER_NS, UNTIMED_RATIO, gpu_idle, outside_ops
from .layout_findings import _CONV, _COPY, _layout_findings
from .layout_mix import mix_findings
from .lineage import from_data
from .opview import first_run, short_name, window_views
from .roofline import Peaks, roofline
from .roofline_findings import _roofline_findings, _warm_views
from .syncs import infer_steps, sync_table, tiny_mask

TINY_BYTES = 64 * 1024          # an op moving less than this ...
TINY_FLOPS = 1 << 20            # ... and doing fewer FLOPs is "tiny": its time is mostly dispatch
TINY_MIN = 100                  # the overhead finding needs at least this many tiny ops ...
TINY_SHARE = 0.5                # ... making at least this share of the ops
OUTSIDE_SHARE = 0.3             # time outside ops worth a finding (share of the wall time) ...
OUTSIDE_MIN_NS = 5_000_000      # ... and at least this much
COLD_SHARE = 0.5                # first-run rows holding this share of op time make the cell "cold" ...
COLD_NOTE_NS = 2_000_000        # ... and the first_run note is shown when they took at least this long (a cold
                                # cell of a few hundred µs has nothing a user would read as slowness)
MIN_SHARE = 0.01                # default significance: a performance finding costs this share of op time
BUSY_SHARE = 0.1                # the thread waited this share of the wall for a CPU: a busy machine, no finding read
                                # from op times (and the headline says so)
_LINEAGE_READS = 3              # scalar reads per source line whose lineage is read (advisor._host_only)
SYNC_REPEAT = 3                 # a CPU sync seen this many times at one line (a loop) is a finding whatever its time
#: findings that say where the time goes rather than what to change: listed after the problems
DESCRIPTIVE = frozenset({"compute_bound", "memory_bound", "below_roof"})
#: findings read from timings (none on a prediction)
TIMING_KINDS = frozenset({"compute_bound", "memory_bound", "below_roof", "amp", "outside_ops", "gpu_idle"})
_OPTIM_INPLACE = frozenset({"add_", "mul_", "addcmul_", "addcdiv_", "lerp_", "sqrt", "div_", "maximum", "sub_"})

_SYNC_FIX = {
    "scalar_read": "keep the value on the device: accumulate into a tensor (total += loss.detach()) and read it "
                   "once after the loop; replace `if t:` / Python branching on a tensor by torch.where or masking",
    "data_dependent_shape": "use a fixed-size form: torch.where(mask, x, 0) or masked_fill instead of x[mask], "
                            "torch.nonzero_static(x, size=N), or move it out of the loop",
    "host_copy": "move the copy out of the loop (collect on the device, copy once), or copy asynchronously into "
                 "pinned memory with .to('cpu', non_blocking=True) and synchronise once",
}


def _host_only(syncs: pa.Table, wins: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Per sync row: a CPU scalar read whose value derives from 0-d tensors only (``lineage.from_data``:
    an optimizer's step counter), which stays on the host when the model runs on a GPU: no wait there."""
    out = np.zeros(syncs.num_rows, bool)
    # per source line (what a finding groups): its first few reads decide for all of them (a loop's reads
    # at one line read the same kind of value), so the cost is per line, not per step
    verdict: dict[tuple[Any, ...], list[bool]] = {}
    rows = syncs.select(["window", "seq", "device", "kind", "source_file", "source_line"]).to_pylist()
    for r in rows:
        if r["kind"] != "scalar_read" or (r["device"] or "cpu") != "cpu":
            continue
        got = verdict.setdefault((r["window"], r["source_file"], r["source_line"]), [])
        if len(got) < _LINEAGE_READS:
            ops = wins[r["window"]]["ops"]
            first = ops.column("seq")[0].as_py() if ops.num_rows else 0
            pos = r["seq"] - first
            ok = 0 <= pos < ops.num_rows and ops.column("seq")[pos].as_py() == r["seq"]
            got.append(ok and not from_data(ops, pos))
    for i, r in enumerate(rows):
        line = verdict.get((r["window"], r["source_file"], r["source_line"])) or []
        out[i] = bool(line) and all(line) and r["kind"] == "scalar_read" and (r["device"] or "cpu") == "cpu"
    return out


def _sync_findings(syncs: pa.Table, noise_ops: frozenset[str], multi: bool, steps: Optional[int],
                   wins: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    if syncs.num_rows == 0:
        return []
    noise = np.array([short_name(o) in noise_ops for o in syncs.column("op").to_pylist()], dtype=bool)
    has_call = ~np.asarray(pc.is_null(syncs.column("call")).to_numpy(zero_copy_only=False), dtype=bool)
    keep = ~noise | has_call          # a bookkeeping row with no call to name: never a subject on its own
    if wins:   # a CPU trace's sync is a claim about a GPU run: not for values that stay on the host there
        keep &= ~_host_only(syncs, wins)
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
        per = f" ({fmt_rate(n / steps)} per step)" if steps else ""
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
    # per (file, line): [rows, distinct storages, the first row's module, cpu time, runs of rows]
    groups: OrderedDict[tuple[Any, ...], list[Any]] = OrderedDict()
    for w, win in enumerate(wins):
        for view in _views(win):
            for r in _rows_of(w, view, frozenset({"zero_", "_foreach_zero_"}),
                              ["seq", "op", "in_storages", "cpu_ns", "module", "source_file", "source_line"]):
                g = groups.get((r["source_file"], r["source_line"]))
                if g is None:
                    g = groups[(r["source_file"], r["source_line"])] = [0, set(), r["module"], 0, Runs()]
                g[0] += 1
                g[1].update(s for s in (r["in_storages"] or []) if s is not None and s >= 0)
                g[3] += r["cpu_ns"] or 0
                g[4].add_one(w, r["seq"])
    out = []
    for (f, line), (n, storages, module, cost, runs) in groups.items():
        if len(storages) < 2 or module is not None:
            continue
        seen = f"{n} in-place zero ops on {len(storages)} distinct tensors at {_where(f, line)}"
        out.append(_finding("zero_grad", f"zeroing at {_where(f, line)}", seen, runs, multi, cost,
                            "if these are gradients: optimizer.zero_grad(set_to_none=True) (the default since "
                            "torch 2.0) frees them instead of writing zeros", steps, None, f, line))
    return out


def _overhead_findings(wins: Sequence[Mapping[str, Any]], multi: bool, steps: Optional[int],
                       cuda: bool) -> list[dict[str, Any]]:
    rows = Runs()
    cost = 0
    n_work = 0
    names: dict[tuple[str, Optional[str], Optional[int]], int] = {}
    optim = 0
    for w, win in enumerate(wins):
        for view in _warm_views(win):      # a record batch at a time: sums, counts and runs of rows
            ops = view.ops
            m = tiny_mask(ops, TINY_BYTES, TINY_FLOPS, view.noise)
            n_work += int((~view.noise).sum())
            if not m.any():
                continue
            rows.add(w, view.seq[m])
            tiny = ops.select(["op", "source_file", "source_line", "module", "cuda_ns", "cpu_ns"]).filter(pa.array(m))
            cost += int(pc.sum(pc.coalesce(tiny.column("cuda_ns"), tiny.column("cpu_ns"))).as_py() or 0)
            g = tiny.select(["op", "source_file", "source_line", "module"]).group_by(
                ["op", "source_file", "source_line", "module"], use_threads=False).aggregate([("source_line", "count")])
            for r in S.plain_strings(g).to_pylist():
                k = (r["op"], r["source_file"], r["source_line"])
                names[k] = names.get(k, 0) + r["source_line_count"]
                if r["module"] is None and short_name(r["op"]) in _OPTIM_INPLACE:
                    optim += r["source_line_count"]
    n_tiny = len(rows)
    if n_tiny < TINY_MIN or not n_work or n_tiny / n_work < TINY_SHARE:
        return []
    top = sorted(names.items(), key=lambda kv: -kv[1])[:3]
    per = f" ({fmt_rate(n_tiny / steps)} per step)" if steps else ""
    seen = (f"{n_tiny} of {n_work} ops{per} move under {fmt_bytes(TINY_BYTES)} each, so their time is mostly "
            f"per-op dispatch: " + ", ".join(f"{short_name(op)} at {_where(f, ln)} x{c}" for (op, f, ln), c in top))
    fixes = ["torch.compile(model) fuses them into few kernels"]
    if cuda:
        fixes.append("CUDA graphs (torch.compile(mode='reduce-overhead')) remove the launches")
    if optim:
        fixes.append(f"{optim} of them are in-place updates outside any module: an optimizer with foreach=True "
                     "or fused=True runs them as a few multi-tensor kernels")
    fixes.append("a bigger batch amortises the per-op cost")
    return [_finding("overhead", f"{n_tiny} tiny ops", seen, rows, multi, cost, "; ".join(fixes), steps)]


def outside_totals(outs: Sequence[Optional[Mapping[str, Any]]]) -> dict[str, int]:
    """The windows' time outside ops (``idle.outside_ops``), summed: ``wall`` (enter to exit),
    ``gaps`` (between ops, past tensorscope's own per-op work), ``delay`` (the recording thread's wait
    for a CPU: other processes' time) and ``waited`` (the part of the gaps that wait may explain; the
    ``outside_ops`` finding counts only ``gaps - waited``)."""
    got = [o for o in outs if o]
    return {"wall": sum(o["wall_ns"] or o["span_ns"] for o in got),
            "gaps": sum(o["outside_ns"] for o in got),
            "delay": sum(o.get("run_delay_ns") or 0 for o in got),
            "waited": sum(min(o.get("run_delay_ns") or 0, o["outside_ns"]) for o in got)}


def _outside_findings(outs: list[Optional[dict[str, Any]]], wins: Sequence[Mapping[str, Any]],
                      multi: bool, steps: Optional[int]) -> list[dict[str, Any]]:
    tot = outside_totals(outs)
    wall = tot["wall"]   # enter to exit: the overview's base
    # the time the recording thread waited for a CPU (a busy machine) is other processes' time, not the program's:
    # left out of the gaps and of the wall it is compared with
    outside = tot["gaps"] - tot["waited"]
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


def _host_to_device(wins: Sequence[Mapping[str, Any]], multi: bool, steps: Optional[int]) -> list[dict[str, Any]]:
    runs, n, cost, first = Runs(), 0, 0, None
    for w, win in enumerate(wins):
        for view in _views(win):
            for r in _rows_of(w, view, frozenset({"_to_copy", "copy_"}),
                              ["seq", "op", "in_devices", "out_devices", "cpu_ns", "module", "source_file",
                               "source_line"]):
                ins, outs = r["in_devices"] or [], r["out_devices"] or []
                src = ins[1] if short_name(r["op"]) == "copy_" and len(ins) > 1 else (ins[0] if ins else None)
                if src == "cpu" and any(d and d.startswith("cuda") for d in outs):
                    first = first or r
                    n += 1
                    cost += r["cpu_ns"] or 0
                    runs.add_one(w, r["seq"])
    if first is None:
        return []
    seen = f"{n} host-to-device copies, {fmt_ns(cost)} on the host"
    return [_finding("host_copy", "host-to-device copies", seen, runs, multi, cost,
                     "pin the host memory (DataLoader(pin_memory=True) or t.pin_memory()) and copy with "
                     ".to(device, non_blocking=True)", steps, first["module"], first["source_file"],
                     first["source_line"])]


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
                  min_share: float = MIN_SHARE, predicted: bool = False, speedup: Optional[Any] = None,
                  batch_rows: Optional[int] = None) -> dict[str, Any]:
    """Every finding of ``windows`` (one mapping per trace), with the tables behind them.

    ``min_share``: the least cost, as a share of the op time, of a performance finding; ``predicted``:
    the traces are predictions (no timing finding); ``speedup``: ``(batch, M, K, N) -> (dtype, gain, how)``
    or None, the measured 16-bit speed-up of a GEMM of that shape (the ``amp`` finding's proof);
    ``batch_rows``: the rows read at a time (``opview.BATCH_ROWS``; the result is the same whatever it is)."""
    from .._common import NOISE_OPS

    cells: dict[str, int] = {}
    for w in windows:
        cells.update(w.get("cells") or {})
    token = _CELLS.set(cells or None)
    try:
        return _advise([dict(w, batch_rows=batch_rows) for w in windows], peaks, NOISE_OPS, min_share, predicted,
                       speedup)
    finally:
        _CELLS.reset(token)


def _drop_amp_on(over: Mapping[str, Any], found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``found`` less the ``amp`` findings that name a (window, row) pair the finding ``over`` names (their
    runs compared run against run: the overhead finding of a trace of small ops names every row)."""
    if not any(f["kind"] == "amp" for f in found):
        return found
    return [f for f in found if f["kind"] != "amp" or not over["runs"].overlaps(f["runs"])]


def cpu_wait(win: Mapping[str, Any]) -> int:
    """How long the op times of a window may hold other processes' time: the longer wait for a CPU of the
    recording thread (``run_delay_ns``) and of any one thread of the process (``worker_run_delay_ns``: an
    intra-op parallel kernel waits for its slowest worker)."""
    return max(int(win.get("run_delay_ns") or 0), int(win.get("worker_run_delay_ns") or 0))


def _explained_by(mixes: Sequence[Mapping[str, Any]], found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``found`` less the roofline findings a layout-mix finding explains (one event, one finding): those
    naming its rows whose cost the mix's own cost is at least half of."""
    return [f for f in found if not any(m["runs"].overlaps(f["runs"]) and 2 * m["cost_ns"] >= (f["cost_ns"] or 0)
                                        for m in mixes)]


def _views(win: Mapping[str, Any]) -> Any:
    """The window's rows a slice at a time (every row: the structural findings read what ran)."""
    return window_views(win)


def _op_time(win: Mapping[str, Any]) -> tuple[int, int, int]:
    """(op time, the part of it in ``first_run`` rows, the warm rows that are not bookkeeping) of a window,
    a record batch at a time; the time of a row is ``cuda_ns`` where measured, else ``cpu_ns``."""
    op_ns = first_ns = n_warm = 0
    for view in _views(win):
        ops = view.ops
        t = pc.fill_null(pc.coalesce(ops.column("cuda_ns"), ops.column("cpu_ns")), 0).to_numpy(
            zero_copy_only=False).astype(np.int64)
        work = ~view.noise
        first = first_run(ops)
        op_ns += int(t[work].sum())
        first_ns += int(t[work & first].sum())
        n_warm += int((~first).sum())
    return op_ns, first_ns, n_warm


def _warm_table(ops: pa.Table) -> pa.Table:
    """``ops`` with its ``first_run`` rows marked bookkeeping (``is_noise``): what the roofline reads as the warm
    rows, without copying a column (the rows kept, a bit-packed column replaced)."""
    if "first_run" not in ops.column_names or ops.column("first_run").null_count == ops.num_rows:
        return ops
    noise = pc.or_(pc.fill_null(ops.column("is_noise"), False), pc.fill_null(ops.column("first_run"), False))
    i = ops.schema.get_field_index("is_noise")
    return ops.set_column(i, ops.schema.field(i), noise)


def _cold_finding(windows: Sequence[Mapping[str, Any]], first_ns: int, op_ns: int, multi: bool) -> dict[str, Any]:
    pairs = Runs()
    for w, win in enumerate(windows):
        for view in _views(win):
            pairs.add(w, view.seq[first_run(view.ops) & ~view.noise])
    seen = (f"{100 * first_ns / op_ns:.0f}% of the op time ({fmt_ns(first_ns)} of {fmt_ns(op_ns)}) was the first "
            f"execution in this process of {len(pairs)} op/shape/dtype combinations: timings include one-time "
            "initialisation (kernel selection, lazy library set-up, first allocations), so no performance advice is "
            "drawn from them")
    return _finding("first_run", "timings include one-time initialisation", seen, pairs, multi, first_ns,
                    "run the cell again: the next run shows the warm timings the advisor can read", None)


def _advise(windows: Sequence[Mapping[str, Any]], peaks: Optional[Peaks], NOISE_OPS: frozenset[str],
            min_share: float = MIN_SHARE, predicted: bool = False, speedup: Optional[Any] = None) -> dict[str, Any]:
    multi = len(windows) > 1
    steps_each: list[Optional[int]] = [w["steps"] if w.get("steps") is not None
                                       else infer_steps(w["calls"], w.get("batch_rows")) for w in windows]
    steps = sum(int(s) for s in steps_each if s) if steps_each and all(steps_each) else None
    op_ns = first_ns = 0
    warm_ops = []
    for w in windows:
        w_op, w_first, n_warm = _op_time(w)
        op_ns += w_op
        first_ns += w_first
        if n_warm:   # the warm rows: what the timing findings read
            warm_ops.append(_warm_table(w["ops"]))
    syncs = [sync_table(w["ops"], w["calls"], i, w.get("batch_rows")) for i, w in enumerate(windows)]
    sync_t = pa.concat_tables(syncs) if syncs else S.SYNCS.empty_table()
    ops = S.unify_dictionaries(pa.concat_tables(warm_ops)) if len(warm_ops) > 1 else (warm_ops[0] if warm_ops else None)
    flops_known = all(w.get("flops_known", True) for w in windows)
    roof = roofline(ops, peaks, flops_known) if ops is not None else S.ROOFLINE.empty_table()
    outs = [outside_ops(w["ops"], w["calls"], w.get("wall_ns"), TRACER_NS.get(str(w.get("engine")), 0),
                        rows=w.get("batch_rows"), own_op_ns=int(w.get("tracer_op_ns") or 0),
                        untimed_ratio=UNTIMED_RATIO.get(str(w.get("engine")), 0.0)) for w in windows]
    for o, w, s in zip(outs, windows, steps_each):
        if o is not None:   # tiny ops per window (and per step), shown whether or not they make a finding
            o["tiny_ops"] = sum(int(tiny_mask(v.ops, TINY_BYTES, TINY_FLOPS, v.noise).sum()) for v in _views(w))
            o["steps"] = s
            o["run_delay_ns"] = int(w.get("run_delay_ns") or 0)
    idle = []
    for i, w in enumerate(windows):
        k = w.get("kernels")
        if k is not None and k.num_rows:
            for d in gpu_idle(w["ops"], k, rows=w.get("batch_rows")):
                idle.append(dict(d, window=i))
    cuda = any(r == "cuda" for r in roof.column("device").to_pylist()) if roof.num_rows else False
    delay = sum(cpu_wait(w) for w in windows)
    busy_left = 0
    found: list[dict[str, Any]] = []
    cold = bool(op_ns) and first_ns >= COLD_SHARE * op_ns and not predicted
    # structural findings: read from what ran, not from how long it took
    found += _sync_findings(sync_t, NOISE_OPS, multi, steps, windows)
    found += _layout_findings(windows, multi, steps)
    found += _zero_grad_findings(windows, multi, steps)
    found += _host_to_device(windows, multi, steps)
    if cold:   # the timings are one-time initialisation: one note instead of the timing findings
        floor = min_share * op_ns
        found = [f for f in found if f["cost_ns"] is None or f["cost_ns"] >= floor or f.get("cost_floor_exempt")]
        if first_ns >= COLD_NOTE_NS:
            found.insert(0, _cold_finding(windows, first_ns, op_ns, multi))
    else:
        over = _overhead_findings(windows, multi, steps, cuda)
        found += over
        if not predicted:
            found += _outside_findings(outs, windows, multi, steps)
            found += _idle_findings(idle, multi)
            roof_found = _roofline_findings(roof, windows, peaks, multi, steps, speedup)
            if over:   # one event, one finding: rows the overhead finding names are no compute-bound amp proof
                roof_found = _drop_amp_on(over[0], roof_found)
            mixes = mix_findings(windows, multi, steps, _CONV | _COPY)
            roof_found = mixes + _explained_by(mixes, roof_found)
            # a busy machine: the op times hold the time the thread waited for a CPU (other processes'); a
            # finding read from op times (the roofline's, a layout mix's) that this wait could explain whole
            # is not proven by them; past BUSY_SHARE of the wall, none is (every rate holds the wait)
            wall = sum(int(w.get("wall_ns") or 0) for w in windows)
            busy = wall > 0 and delay >= BUSY_SHARE * wall
            kept = [f for f in roof_found if not busy and (f["cost_ns"] is None or f["cost_ns"] > delay)]
            busy_left = len(roof_found) - len(kept)
            found += kept
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
            "cold": cold, "predicted": predicted, "run_delay_ns": delay, "busy_left": busy_left}
