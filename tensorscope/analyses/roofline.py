"""Roofline per op and per module: achieved FLOP/s and bytes/s against the machine's measured peaks.

``roofline(ops, peaks) -> pa.Table`` (schema ``ROOFLINE``). ``peaks`` maps a device type
(``cpu``, ``cuda``) to ``{"flops": {dtype: FLOP/s}, "bytes_per_s": B/s, "overhead_ns": ns}``
(``tensorscope._peaks.machine_peaks()``); without it the achieved rates are still given, the
roof columns and ``bound`` are null.

Per group of rows (``op`` level: one op and output dtype; ``module`` level: one module path):
``ideal_ns = max(flops / peak_flops[dtype], bytes / bandwidth)`` is the time at the roof and
``roof_fraction = min(ideal_ns / time_ns, 1)`` how close the rows came to it (never above 1: a group
faster than its roof means the peak is wrong, ``beats_peak`` finds such groups so the caller
re-measures the peak). ``bound``, one label that agrees with the numbers:

* ``overhead`` (latency-bound) when the ideal is under half the measured time and the ideal time per op
  is under ``OVERHEAD_FACTOR`` times the framework's per-op floor (``overhead_ns``, measured with the
  peaks): the work at the roof is shorter than dispatching it; on CUDA also when the host spent more than
  twice the device time on ops of under ``CUDA_TINY_NS`` each;
* else ``compute`` when ``flops / peak >= bytes / bandwidth`` (intensity at or past the ridge) and
  ``memory`` otherwise, but only when the rows reach ``ROOF_SHARE`` of that roof;
* else ``below_roof``: real work that reaches neither roof (the advisor says the likely reason);
* null when the rows count neither FLOPs nor bytes, or there are no peaks.

Time is ``cuda_ns`` where it was measured, else ``cpu_ns``. Rows with ``is_noise`` are left out, and
so are ``first_run`` rows when the caller drops them (``warm_only``): one-time initialisation is not
the op's speed.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .opview import codes_of, first_of

OVERHEAD_FACTOR = 2.0
CUDA_TINY_NS = 20_000
#: an op group is compute- or memory-bound only when it reaches this share of that roof
ROOF_SHARE = 0.25
#: an op group this many times faster than its dtype's peak proves the peak wrong
BEAT_MARGIN = 1.05

Peaks = Mapping[str, Mapping[str, Any]]


def device_type(dev: Optional[str]) -> Optional[str]:
    return dev.split(":", 1)[0] if dev else None


def peak_for(peaks: Optional[Peaks], dev: Optional[str], dtype: Optional[str]) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """(FLOP/s for ``dtype`` (float32's when the dtype was not measured), bytes/s, overhead ns) on ``dev``."""
    p = (peaks or {}).get(device_type(dev) or "")
    if not p:
        return None, None, None
    fl = p.get("flops") or {}
    f = fl.get(dtype or "") or fl.get("float32")
    return (float(f) if f else None, float(p["bytes_per_s"]) if p.get("bytes_per_s") else None,
            float(p["overhead_ns"]) if p.get("overhead_ns") else None)


def _groups_whole(ops: pa.Table) -> list[dict[str, Any]]:
    cols = ["op", "module", "out_dtypes", "in_dtypes", "in_devices", "out_devices", "cuda_ns", "cpu_ns", "flops",
            "bytes_read", "bytes_written"]
    work = ops.select(cols)
    if work.num_rows == 0:
        return []
    n = work.num_rows
    keys = [codes_of(work.column("op")), codes_of(work.column("module")),
            _first_codes(work, "out_dtypes", "in_dtypes"), _first_codes(work, "in_devices", "out_devices")]
    noise = pc.fill_null(ops.column("is_noise"), False).to_numpy(zero_copy_only=False)
    key = np.zeros(n, dtype=np.int64)
    space = 1
    for codes, values in keys:
        key = key * (len(values) + 1) + (codes + 1)
        space *= len(values) + 1
    if space <= 1 << 22:      # dense key space: count per key, no sort
        present = np.bincount(key[~noise], minlength=space) > 0
        remap = np.full(space, -1, dtype=np.int64)
        ids = np.flatnonzero(present)
        remap[ids] = np.arange(len(ids))
    else:
        ids = np.unique(key[~noise])
        remap = None
    inv = remap[key] if remap is not None else np.searchsorted(ids, key)
    inv = np.where(noise, len(ids), inv)            # noise rows go to a bin of their own, dropped below

    def col(name: str) -> np.ndarray:
        out: np.ndarray = pc.fill_null(work.column(name), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        return out

    cpu = col("cpu_ns")
    has_cuda = ~np.asarray(pc.is_null(work.column("cuda_ns")).to_numpy(zero_copy_only=False), dtype=bool)
    cuda = col("cuda_ns")
    sums = {}
    for name, v in (("time_sum", np.where(has_cuda, cuda, cpu)), ("cpu_sum", cpu), ("cuda_sum", cuda),
                    ("cuda_count", has_cuda.astype(np.int64)), ("flops_sum", col("flops")),
                    ("bytes_sum", col("bytes_read") + col("bytes_written")), ("op_count", np.ones(n, np.int64))):
        acc = np.zeros(len(ids) + 1, dtype=np.int64)
        np.add.at(acc, inv, v)                           # exact int64 sums (FLOPs can pass 2**53)
        sums[name] = acc
    first = np.full(len(ids) + 1, n, dtype=np.int64)
    np.minimum.at(first, inv, np.arange(n))
    out: list[dict[str, Any]] = []
    for j in range(len(ids)):
        i = int(first[j])
        r: dict[str, Any] = {name: int(v[j]) for name, v in sums.items()}
        for field, (codes, values) in zip(("op", "module", "dtype", "device"), keys):
            c = int(codes[i])
            r[field] = values[c] if c >= 0 else None
        out.append(r)
    return out


def _groups(ops: pa.Table) -> list[dict[str, Any]]:
    """Per (op, module, dtype, device) group of the rows that are not bookkeeping: the sums the roofline
    reads, in key order. A record batch at a time (two sweeps: the keys present, then the sums) when the
    batches share their dictionaries (every table a trace builds); else over the whole columns."""
    cols = ["op", "module", "out_dtypes", "in_dtypes", "in_devices", "out_devices", "cuda_ns", "cpu_ns", "flops",
            "bytes_read", "bytes_written"]
    if ops.num_rows == 0:
        return []
    work = ops.select(cols + ["is_noise"])
    batches = work.to_batches()
    plan = _batch_keys(batches)
    if plan is None:
        return _groups_whole(ops)
    values, meta, space = plan
    dense = space <= 1 << 22
    present = np.zeros(space if dense else 0, dtype=bool)
    seen: list[np.ndarray] = []
    for b in batches:
        key, noise = _key(b, values, meta)
        if dense:
            present[key[~noise]] = True
        else:
            seen.append(np.unique(key[~noise]))
    if dense:
        ids = np.flatnonzero(present)
        remap: Optional[np.ndarray] = np.full(space, -1, dtype=np.int64)
        assert remap is not None
        remap[ids] = np.arange(len(ids))
    else:
        ids = np.unique(np.concatenate(seen)) if seen else np.zeros(0, np.int64)
        remap = None
    del present, seen
    names = ("time_sum", "cpu_sum", "cuda_sum", "cuda_count", "flops_sum", "bytes_sum", "op_count")
    sums = {name: np.zeros(len(ids) + 1, dtype=np.int64) for name in names}
    for b in batches:
        key, noise = _key(b, values, meta)
        inv = remap[key] if remap is not None else np.searchsorted(ids, key)
        inv = np.where(noise, len(ids), inv)            # noise rows go to a bin of their own, dropped below

        def col(name: str, b: Any = b) -> np.ndarray:
            out: np.ndarray = pc.fill_null(b.column(name), 0).to_numpy(zero_copy_only=False).astype(np.int64)
            return out

        cpu = col("cpu_ns")
        has_cuda = ~np.asarray(pc.is_null(b.column("cuda_ns")).to_numpy(zero_copy_only=False), dtype=bool)
        cuda = col("cuda_ns")
        for name, v in (("time_sum", np.where(has_cuda, cuda, cpu)), ("cpu_sum", cpu), ("cuda_sum", cuda),
                        ("cuda_count", has_cuda.astype(np.int64)), ("flops_sum", col("flops")),
                        ("bytes_sum", col("bytes_read") + col("bytes_written")),
                        ("op_count", np.ones(b.num_rows, np.int64))):
            np.add.at(sums[name], inv, v)                # exact int64 sums (FLOPs can pass 2**53)
    out: list[dict[str, Any]] = []
    radix = [len(v) + 1 for v in values]
    for j, k in enumerate(ids.tolist()):
        r: dict[str, Any] = {name: int(v[j]) for name, v in sums.items()}
        digits = []
        for base in reversed(radix):                     # the key is mixed-radix: one digit per key column
            digits.append(k % base - 1)
            k //= base
        for field, c, vals in zip(("op", "module", "dtype", "device"), reversed(digits), values):
            r[field] = vals[c] if c >= 0 else None
        out.append(r)
    return out


def _dicts(b: Any, name: str) -> Optional[pa.Array]:
    col = b.column(name)
    if pa.types.is_list(col.type):
        col = col.values
    return col.dictionary if pa.types.is_dictionary(col.type) else None


def _batch_keys(batches: list[Any]) -> Optional[tuple[list[list[Any]], tuple[list[bool], int, int], int]]:
    """(the values of each key column, the key space) when every batch has the same dictionaries (the
    codes of one batch are the codes of the table), else None."""
    names = ("op", "module", "out_dtypes", "in_dtypes", "in_devices", "out_devices")
    got = {n: _dicts(batches[0], n) for n in names}
    first: dict[str, pa.Array] = {n: d for n, d in got.items() if d is not None}
    if len(first) != len(names):
        return None
    for b in batches[1:]:
        for n in names:
            d = _dicts(b, n)
            if d is None or not (d is first[n] or d.equals(first[n])):
                return None
    # a pair's second column is read only when some row has no first (``_first_codes``)
    need_b = [any(_first_missing(b, a) for b in batches) for a in ("out_dtypes", "in_devices")]
    values = [first["op"].to_pylist(), first["module"].to_pylist(),
              first["out_dtypes"].to_pylist() + (first["in_dtypes"].to_pylist() if need_b[0] else []),
              first["in_devices"].to_pylist() + (first["out_devices"].to_pylist() if need_b[1] else [])]
    meta = (need_b, len(first["out_dtypes"]), len(first["in_devices"]))
    space = 1
    for v in values:
        space *= len(v) + 1
    return values, meta, space


def _first_missing(b: Any, name: str) -> bool:
    ca, _ = codes_of(first_of(b.column(name), raw=True))
    return bool((ca < 0).any())


def _key(b: Any, values: list[list[Any]], meta: tuple[list[bool], int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(the group key of each row of batch ``b``, whether it is bookkeeping)."""
    need_b, n_out, n_in = meta

    def pair(a: str, other: str, use_other: bool, n_a: int) -> np.ndarray:
        ca, _ = codes_of(first_of(b.column(a), raw=True))
        if not use_other:
            return ca
        cb, _ = codes_of(first_of(b.column(other), raw=True))
        out: np.ndarray = np.where(ca >= 0, ca, np.where(cb >= 0, cb + n_a, -1))
        return out

    codes = [codes_of(b.column("op"))[0], codes_of(b.column("module"))[0],
             pair("out_dtypes", "in_dtypes", need_b[0], n_out), pair("in_devices", "out_devices", need_b[1], n_in)]
    key = np.zeros(b.num_rows, dtype=np.int64)
    for c, v in zip(codes, values):
        key = key * (len(v) + 1) + (c + 1)
    noise = np.asarray(pc.fill_null(b.column("is_noise"), False).to_numpy(zero_copy_only=False), dtype=bool)
    return key, noise


def _first_codes(t: pa.Table, a: str, b: str) -> tuple[np.ndarray, list[Any]]:
    """Codes of the first element of list column ``a``, else of ``b`` (read only where ``a`` is empty)."""
    ca, va = codes_of(first_of(t.column(a), raw=True))
    if (ca >= 0).all():
        return ca, va
    cb, vb = codes_of(first_of(t.column(b), raw=True))
    return np.where(ca >= 0, ca, np.where(cb >= 0, cb + len(va), -1)), va + vb


def _row(level: str, name: str, dtype: Optional[str], dev: Optional[str], n: int, time: int, cpu: int,
         cuda: Optional[int], n_cuda: int, flops: int, nbytes: int, compute_ns: Optional[float],
         memory_ns: Optional[float], overhead_ns: Optional[float], pf: Optional[float],
         bw: Optional[float]) -> dict[str, Any]:
    sec = time / 1e9 if time else None
    ideal = max(compute_ns or 0.0, memory_ns or 0.0) if (compute_ns is not None and memory_ns is not None) else None
    bound = None
    if ideal is not None and (flops or nbytes):
        tiny_host = (cuda or 0) / n_cuda < CUDA_TINY_NS and cpu > 2 * (cuda or 0) if n_cuda else False
        floor = overhead_ns or 0.0
        if (ideal < 0.5 * time and floor and ideal / max(n, 1) < OVERHEAD_FACTOR * floor) or tiny_host:
            bound = "overhead"
        elif time and ideal / time < ROOF_SHARE:
            bound = "below_roof"
        else:
            bound = "compute" if (compute_ns or 0.0) >= (memory_ns or 0.0) and flops else "memory"
    inten = flops / nbytes if nbytes else None
    roof = None
    if pf and bw and inten is not None:
        roof = min(pf, inten * bw)
    elif pf and flops and not nbytes:
        roof = pf
    return {"level": level, "name": name, "dtype": dtype, "device": device_type(dev), "n_ops": n, "time_ns": time,
            "flops": flops, "bytes": nbytes, "intensity": inten,
            "flops_per_s": flops / sec if sec else None, "bytes_per_s": nbytes / sec if sec else None,
            "peak_flops_per_s": pf, "peak_bytes_per_s": bw, "roof_flops_per_s": roof,
            "roof_fraction": min(ideal / time, 1.0) if (ideal is not None and time and (flops or nbytes)) else None,
            "ideal_ns": int(round(ideal)) if ideal is not None else None, "bound": bound}


def beats_peak(roof: pa.Table, min_ns: int = 1_000_000) -> dict[str, list[str]]:
    """``{device type: [dtype, ...]}``: op groups of at least ``min_ns`` whose achieved FLOP/s passed their
    dtype's measured peak by ``BEAT_MARGIN`` (the peak is wrong: measured on a busy machine)."""
    out: dict[str, set[str]] = {}
    for r in roof.to_pylist():
        if (r["level"] == "op" and r["peak_flops_per_s"] and r["flops_per_s"] and (r["time_ns"] or 0) >= min_ns
                and r["flops_per_s"] > BEAT_MARGIN * r["peak_flops_per_s"] and r["device"]):
            out.setdefault(r["device"], set()).add(r["dtype"] or "float32")
    return {k: sorted(v) for k, v in out.items()}


def roofline(ops: pa.Table, peaks: Optional[Peaks] = None, flops_known: bool = True) -> pa.Table:
    """The ROOFLINE rows of ``ops``: op level (by time, descending), then module level.

    ``flops_known=False`` (a trace recorded with ``flops=False``): no ideal time, roof or bound, since
    a matmul without its FLOPs would look memory-bound."""
    groups = _groups(ops)
    if not groups:
        return S.ROOFLINE.empty_table()
    for g in groups:
        pf, bw, ov = peak_for(peaks, g["device"], g["dtype"])
        g["pf"], g["bw"], g["ov"] = pf, bw, ov
        g["compute_ns"] = (g["flops_sum"] / pf * 1e9) if (pf and flops_known) else None
        g["memory_ns"] = (g["bytes_sum"] / bw * 1e9) if bw else None
    rows: list[dict[str, Any]] = []
    for level, key in (("op", lambda g: (g["op"], g["dtype"], g["device"])), ("module", lambda g: (g["module"],))):
        agg: dict[Any, dict[str, Any]] = {}
        for g in groups:
            k = key(g)
            if k[0] is None:
                continue
            a = agg.setdefault(k, {"n": 0, "time": 0, "cpu": 0, "cuda": 0, "n_cuda": 0, "flops": 0, "bytes": 0,
                                   "compute": 0.0, "memory": 0.0, "known": True, "dtimes": {}, "g": g})
            a["n"] += g["op_count"]
            a["time"] += g["time_sum"] or 0
            a["cpu"] += g["cpu_sum"] or 0
            a["cuda"] += g["cuda_sum"] or 0
            a["n_cuda"] += g["cuda_count"] or 0
            a["flops"] += g["flops_sum"] or 0
            a["bytes"] += g["bytes_sum"] or 0
            if g["compute_ns"] is None or g["memory_ns"] is None:
                a["known"] = False
            else:
                a["compute"] += g["compute_ns"]
                a["memory"] += g["memory_ns"]
            dk = (g["dtype"], g["device"])
            a["dtimes"][dk] = a["dtimes"].get(dk, 0) + (g["time_sum"] or 0)
        for k, a in agg.items():
            dtype, dev = max(a["dtimes"].items(), key=lambda kv: kv[1])[0]
            pf, bw, ov = peak_for(peaks, dev, dtype)
            known = a["known"]
            rows.append(_row(level, k[0], dtype, dev, a["n"], a["time"], a["cpu"], a["cuda"], a["n_cuda"],
                             a["flops"], a["bytes"], a["compute"] if known else None, a["memory"] if known else None,
                             ov, pf, bw))
    rows.sort(key=lambda r: (r["level"] != "op", -(r["time_ns"] or 0)))
    return pa.Table.from_pylist(rows, schema=S.ROOFLINE)
