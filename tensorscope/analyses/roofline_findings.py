"""The advisor's timing findings read from the roofline: op groups that take a large share of the warm op
time (``compute_bound``, ``memory_bound``, ``below_roof``) and ``amp``, each proved by the warm rows of its
group (used by advisor.py; the roofline table itself is analyses/roofline.py's). The rows are read a
record batch at a time (``opview.views``): what a finding keeps is its runs of rows, never a per-row
array of the trace."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .findings import Runs, _finding
from .layout_findings import _CONV
from .opview import first_of, short_name, window_views
from .roofline import ROOF_SHARE, Peaks

TOP_SHARE = 0.2                 # an op group taking this share of op time gets a roofline finding
AMP_GAIN = 1.5                  # a 16-bit GEMM this many times faster than fp32 (same shape) makes AMP worth suggesting
AMP_SHARE = 0.5                 # ... when compute-bound fp32 GEMMs/convolutions take this share of warm op time
_GEMM = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation"} | _CONV)


def _warm_views(win: Mapping[str, Any]) -> Any:
    """The window's rows a slice at a time, ``first_run`` rows counted as bookkeeping (the warm rows)."""
    return window_views(win, warm_only=True)


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
        for view in _warm_views(win):
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
    pairs = Runs()
    for r in gemm:
        pairs.extend(_seqs_of(wins, r["name"], r["dtype"]))
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
        why.append("the kernel does not reach the roof at these shapes and layouts (strided inputs, odd sizes"
                   + (")" if _quiet(wins) else ", or a competing load while the trace ran)"))
    return "likely: " + "; ".join(why)


def _quiet(wins: Sequence[Mapping[str, Any]]) -> bool:
    """Whether no thread of the process is known to have waited for a CPU in the windows (``run_delay_ns``
    and ``worker_run_delay_ns`` measured, under 1% of the wall): a competing load is then no likely reason."""
    delays = [max(w.get("run_delay_ns") or 0, w.get("worker_run_delay_ns") or 0) for w in wins]
    known = all(w.get("run_delay_ns") is not None and w.get("worker_run_delay_ns") is not None for w in wins)
    wall = sum(int(w.get("wall_ns") or 0) for w in wins)
    return bool(wins) and known and wall > 0 and sum(delays) <= 0.01 * wall


def _below_fix(r: Mapping[str, Any], wins: Sequence[Mapping[str, Any]], peaks: Optional[Peaks]) -> str:
    per_op = (r["flops"] or 0) / max(r["n_ops"], 1)
    if short_name(r["name"]) in _CONV and per_op and per_op < 2 * 256 ** 3:
        return "more work per call: a bigger batch"
    if short_name(r["name"]) in _GEMM and per_op and per_op < 2 * 256 ** 3:
        return "batch the small matmuls into fewer, larger ones (a bigger batch, torch.bmm over stacked inputs)"
    if _quiet(wins):
        return "check torch.get_num_threads() and the input layouts (strides, memory format) of these calls"
    return "run the cell again on an idle machine to confirm; check torch.get_num_threads() and the input layouts"


def _seqs_of(wins: Sequence[Mapping[str, Any]], op: str, dtype: Optional[str] = None) -> Runs:
    """The (window, seq) runs of the warm rows of ``op`` (of output dtype ``dtype`` when given)."""
    out = Runs()
    for w, win in enumerate(wins):
        for view in _warm_views(win):
            m = view.mask(lambda n: n == op)
            if dtype is not None and m.any():
                m &= pc.fill_null(pc.equal(_out_dtype(view.ops), dtype), False).to_numpy(zero_copy_only=False)
            out.add(w, view.seq[m])
    return out


def _out_dtype(ops: pa.Table) -> pa.Array:
    """Per row, the first output dtype (else the first input's): the roofline's dtype of the row (an
    Arrow string array, compared column-wise: no Python string per row)."""
    out: pa.Array = pc.coalesce(first_of(ops.column("out_dtypes")), first_of(ops.column("in_dtypes")))
    return out
