"""The memory timeline's digest: what the summary reads of ``memory_timeline`` and ``memory``, in
bounded memory (one sweep of the ops in blocks), without building either (see ``memory_digest``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .live_sweep import LiveSweep
from .memory_columns import CATS, _op_columns


def memory_digest(tensors: pa.Table, ops: pa.Table, columns: int, block: int = 1 << 14,
                  step: Optional[int] = None) -> dict[str, Any]:
    """What the summary reads of ``memory_timeline`` and ``memory``, without building either: per device
    the peak (the timeline's ``is_peak`` row and ``memory_peak``'s tie-break past bookkeeping ops), the
    bytes before the first op and during the last, and the rows the memory chart draws on ``columns``
    pixel columns (render/svg_memory.py: per column the op with the most live bytes, the first such).

    The ops are swept in blocks of about ``block`` (whole chart columns) by ``live_sweep.LiveSweep``
    (the storages read ``step`` rows at a time): what it holds is one block of live bytes per
    (device, category), the events of the storages alive across it and the chart's points. Equal to
    reading the same from ``memory_timeline(tensors, ops)`` (tests/analyses/test_memory_digest.py).
    """
    n = ops.num_rows
    if n == 0 or tensors.num_rows == 0:
        return {"n": 0, "devices": [], "last": -1}
    sweep = LiveSweep(tensors, n, categories=True, step=step)
    names, baseline = sweep.names, sweep.baseline
    D, C = len(names), len(CATS)
    edges = np.linspace(0, n, columns + 1).astype(np.int64) if n > columns else np.arange(n + 1, dtype=np.int64)
    edges = edges[np.concatenate(([True], edges[1:] > edges[:-1]))]   # empty columns draw nothing
    per = max(1, block // max(1, n // max(len(edges) - 1, 1)))
    bounds = edges[::per].tolist()
    if bounds[-1] != n:
        bounds.append(n)
    has_noise = "is_noise" in ops.column_names
    best: list[Optional[int]] = [None] * D
    best_seq = [0] * D
    best_cats: list[Any] = [None] * D
    named: list[Optional[int]] = [None] * D
    drawn: list[list[np.ndarray]] = [[] for _ in range(D)]
    drawn_live: list[list[np.ndarray]] = [[] for _ in range(D)]
    end = np.zeros(D, np.int64)
    for a, b, d in sweep.blocks(bounds):
        width = b - a
        live3 = d.reshape(D, C, width)
        tot = live3.sum(axis=1)
        end = tot[:, -1].copy()
        noise = (pc.fill_null(ops.column("is_noise").slice(a, width), False).to_numpy(zero_copy_only=False)
                 .astype(bool) if has_noise else None)
        cut = edges[(edges >= a) & (edges < b)] - a
        lens = np.diff(np.append(cut, width))
        pos = np.arange(width)
        for di in range(D):
            row = tot[di]
            j = int(np.argmax(row))
            m = int(row[j])
            prev = best[di]
            if prev is None or m > prev:
                best[di], best_seq[di], best_cats[di], named[di] = m, a + j, live3[di, :, j].copy(), None
            if m == best[di] and named[di] is None and noise is not None:
                ok = np.flatnonzero((row == m) & ~noise)
                named[di] = a + int(ok[0]) if len(ok) else None
            segmax = np.maximum.reduceat(row, cut)
            first = np.minimum.reduceat(np.where(row == np.repeat(segmax, lens), pos, width), cut)
            drawn[di].append(a + first)
            drawn_live[di].append(live3[di][:, first])
    out = []
    for di, name in enumerate(names):
        out.append({"device": name, "peak_bytes": int(best[di] or 0), "peak_seq": int(best_seq[di]),
                    "peak_categories": np.asarray(best_cats[di], np.int64), "named_peak_seq": named[di],
                    "start_bytes": int(baseline[di * C:(di + 1) * C].sum()), "end_bytes": int(end[di]),
                    "drawn": np.concatenate(drawn[di]), "drawn_live": np.concatenate(drawn_live[di], axis=1)})
    return {"n": n, "devices": out, "has_noise": has_noise, "last": sweep.last}


def digest_peaks(digest: Mapping[str, Any], ops: pa.Table) -> list[dict[str, Any]]:
    """``peaks(memory_timeline(tensors, ops))`` from a ``memory_digest``: each device's peak row."""
    rows = []
    for p in digest["devices"]:
        s = p["peak_seq"]
        opc = _op_columns(ops, digest["n"], np.array([s], np.int64))
        r: dict[str, Any] = {"seq": s, "device": p["device"]}
        r.update({k: v[0].as_py() for k, v in opc.items()})
        r["live_bytes"] = p["peak_bytes"]
        r.update({f"{c}_bytes": int(p["peak_categories"][ci]) for ci, c in enumerate(CATS)})
        r["is_peak"] = True
        rows.append({f.name: r[f.name] for f in S.MEMORY_TIMELINE})
    return rows


def digest_memory_peak(digest: Mapping[str, Any], ops: pa.Table, tensors: pa.Table) -> Optional[dict[str, dict[str, Any]]]:
    """``analyses.memory.memory_peak(memory_table(tensors, n), ops, tensors)`` from a ``memory_digest``;
    None where it cannot say the same (storages naming ops past the last: read the tables then)."""
    out: dict[str, dict[str, Any]] = {}
    if not digest["devices"]:
        return out
    n, last = digest["n"], digest["last"]
    if last >= n:
        return None
    noise_col = ops.column("is_noise") if digest.get("has_noise") else None
    for p in digest["devices"]:
        s = p["peak_seq"] if p["named_peak_seq"] is None else p["named_peak_seq"]
        info: dict[str, Any] = {"peak_bytes": p["peak_bytes"], "peak_seq": s, "start_bytes": p["start_bytes"],
                                "end_bytes": p["end_bytes"]}
        if noise_col is None or not noise_col[s].as_py():
            info["peak_op"] = ops.column("op")[s].as_py()
        if last >= 0:   # the high-water mark: the same rule over the ops the storages name (0..last)
            info["high_water_bytes"], info["high_water_seq"] = p["peak_bytes"], p["peak_seq"]
        out[p["device"]] = info
    return out
