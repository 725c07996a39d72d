"""Compare two runs: ``diff(a, b) -> TraceDiff`` (Traces or saved directories).

Runs are matched by *what* ran, never by row: ops by (module, phase, op), casts
by (op, from, to, kind), layout changes by (kind, op, from, to). So two cells of
different lengths, a refactored loop or a changed batch size compare
meaningfully. ``TraceDiff.table`` holds one row per changed key with counts,
CPU time and bytes on both sides and their deltas; ``totals`` the cell-level
numbers (ops, CPU time in ops, wall time, hidden copies, casts, peak live bytes
per device, leaked bytes). Changes are ranked by what ran before how long it took: ops,
hidden copies, casts and layout changes that appeared, vanished or changed count or bytes
first (by bytes, then time), then timing changes, which count only past the run-to-run noise
the two runs show (``run_noise``: the whole run's median ratio and spread over the keys
that ran alike, and each key's spread over its occurrences). Text and HTML list them in
that order.

``regressions(totals_a, totals_b, time=0.2, memory=0.1)`` is the baseline guard
(``%%tensorscope --baseline VAR`` / ``trace(baseline=...)``): it fails when the
CPU time in ops grows by more than ``time`` (a fraction, and at least
``MIN_TIME_NS`` so that noise on tiny cells never fails a cell) or when a
device's peak live bytes grow by more than ``memory`` (and at least
``MIN_BYTES``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S

#: absolute floors of the baseline guard (below them a relative change is noise)
MIN_TIME_NS = 100_000
MIN_BYTES = 1024
#: an op key with the same count is "slower"/"faster" past this relative and absolute time change, and past
#: the run-to-run noise the two runs show: NOISE_K standard deviations of the key's summed time (estimated
#: from the spread of its occurrences) and NOISE_K times the median relative change of the keys that ran
#: the same number of times (a loaded machine moves every op)
TIME_SHIFT = 0.2
MIN_SHIFT_NS = 50_000
NOISE_K = 3.0
#: ranking tiers: what ran (ops or storages that appeared, vanished or changed count/bytes) before timing
_TIER = {"appeared": 0, "disappeared": 0, "changed": 0, "slower": 1, "faster": 1, "same": 2}


def _group(t: pa.Table, keys: list[str], sums: list[str]) -> dict[tuple[Any, ...], dict[str, Any]]:
    if t.num_rows == 0:
        return {}
    aggs: list[Any] = [(keys[0], "count")] + [(c, "sum") for c in sums]
    if "cpu_ns" in sums:   # the spread of one occurrence's time: the key's own noise
        aggs.append(("cpu_ns", "stddev"))
    g = t.group_by(keys, use_threads=False).aggregate(aggs)
    out = {}
    for r in g.to_pylist():
        d: dict[str, Any] = dict(count=r[f"{keys[0]}_count"], **{c: r[f"{c}_sum"] or 0 for c in sums})
        if "cpu_ns" in sums:
            d["sd"] = r["cpu_ns_stddev"] or 0.0
        out[tuple(r[k] for k in keys)] = d
    return out


def run_noise(ga: dict[tuple[Any, ...], dict[str, Any]], gb: dict[tuple[Any, ...], dict[str, Any]]
              ) -> tuple[float, float]:
    """The run-to-run wobble: (ratio, spread). ``ratio`` is the median tb/ta of the keys that ran the same
    number of times with the same bytes in both runs (a busy machine slows every op alike), ``spread``
    the median relative deviation of a key from that ratio. (1, 0) with fewer than 3 such keys."""
    ratios = []
    for key, a in ga.items():
        b = gb.get(key)
        if b is None or a["count"] != b["count"] or a.get("bytes", 0) != b.get("bytes", 0):
            continue
        ta, tb = a.get("cpu_ns") or 0, b.get("cpu_ns") or 0
        if ta > 0 and tb > 0:
            ratios.append(tb / ta)
    if len(ratios) < 3:
        return 1.0, 0.0
    ratios.sort()
    r = ratios[len(ratios) // 2]
    dev = sorted(abs(x / r - 1.0) for x in ratios)
    return r, dev[len(dev) // 2]


def _ops_work(ops: pa.Table) -> pa.Table:
    """Ops minus bookkeeping (detach, alias…), with ``module`` null → "" so it can be a group key."""
    if ops.num_rows == 0:
        return pa.table({"module": pa.array([], pa.string()), "phase": pa.array([], pa.string()),
                         "op": pa.array([], pa.string()), "cpu_ns": pa.array([], pa.int64()),
                         "bytes": pa.array([], pa.int64()), "hidden_copy": pa.array([], pa.bool_())})
    keep = pc.invert(ops.column("is_noise").fill_null(False))
    t = ops.filter(keep).select(["module", "phase", "op", "cpu_ns", "bytes_written", "hidden_copy"])
    t = t.rename_columns(["module", "phase", "op", "cpu_ns", "bytes", "hidden_copy"])
    return t.set_column(0, "module", pc.fill_null(t.column("module"), ""))


def _hidden(w: pa.Table) -> pa.Table:
    return w.filter(pc.fill_null(w.column("hidden_copy"), False)) if w.num_rows else w


def _peak(t: Any) -> dict[str, int]:
    from .memory import memory_peak

    return {d: int(p["peak_bytes"]) for d, p in memory_peak(t.memory, t.ops).items()}


def totals(t: Any) -> dict[str, Any]:
    """Cell-level numbers of one Trace."""
    work = _ops_work(t.ops)
    leaks = t.leaks
    return dict(
        ops=work.num_rows,
        cpu_ns=int(pc.sum(work.column("cpu_ns")).as_py() or 0) if work.num_rows else 0,
        wall_ns=int((t.metadata or {}).get("wall_ns") or 0),
        hidden_copies=int(pc.sum(pc.cast(work.column("hidden_copy").fill_null(False), "int64")).as_py() or 0)
        if work.num_rows else 0,
        casts=t.casts.num_rows,
        layout_changes=t.layout_changes.num_rows,
        leaked_bytes=int(pc.sum(leaks.column("nbytes")).as_py() or 0) if leaks.num_rows else 0,
        peak_bytes=_peak(t),
    )


_Groups = dict[tuple[Any, ...], dict[str, Any]]


def _key_noise(a: Optional[dict[str, Any]], b: Optional[dict[str, Any]], noise: tuple[float, float]
               ) -> tuple[float, float]:
    """(the run's ratio, the noise of this key in ns): NOISE_K standard deviations of the change of the key's
    summed time (the spread of its occurrences), and NOISE_K times the run's spread (``run_noise``)."""
    ratio, spread = noise
    if a is None or b is None:
        return ratio, 0.0
    var = a["count"] * (a.get("sd") or 0.0) ** 2 + b["count"] * (b.get("sd") or 0.0) ** 2
    t = max(a.get("cpu_ns") or 0, b.get("cpu_ns") or 0)
    return ratio, NOISE_K * max(var ** 0.5, spread * t)


def _rows(section: str, ga: _Groups, gb: _Groups, keycols: list[str],
          label: Callable[[dict[str, Any]], Optional[str]], noise: tuple[float, float] = (1.0, 0.0)
          ) -> list[dict[str, Any]]:
    rows = []
    for key in set(ga) | set(gb):
        a, b = ga.get(key), gb.get(key)
        ca, cb = (a or {}).get("count", 0), (b or {}).get("count", 0)
        na, nb = (a or {}).get("cpu_ns"), (b or {}).get("cpu_ns")
        ba, bb = (a or {}).get("bytes", 0), (b or {}).get("bytes", 0)
        status = ("appeared" if a is None else "disappeared" if b is None
                  else "changed" if (ca != cb or ba != bb)
                  else _timing(na, nb, *_key_noise(a, b, noise)))
        d = dict(zip(keycols, key))
        rows.append(dict(section=section, status=status, module=d.get("module") or None, phase=d.get("phase"),
                         op=d.get("op"), detail=label(d), count_a=ca, count_b=cb, delta_count=cb - ca,
                         cpu_ns_a=na, cpu_ns_b=nb,
                         delta_cpu_ns=None if na is None and nb is None else (nb or 0) - (na or 0),
                         bytes_a=ba, bytes_b=bb, delta_bytes=bb - ba))
    return rows


def _timing(na: Optional[int], nb: Optional[int], ratio: float = 1.0, noise_ns: float = 0.0) -> str:
    """Same count and bytes: "slower"/"faster" when the time moved by TIME_SHIFT, MIN_SHIFT_NS and past the
    estimated noise ``noise_ns`` from where the whole run moved (``ratio``: b's time of a's), else "same"."""
    if na is None or nb is None:
        return "same"
    d = nb - na * ratio
    if abs(d) >= max(TIME_SHIFT * max(na, nb), MIN_SHIFT_NS, noise_ns):
        return "slower" if d > 0 else "faster"
    return "same"


def compare(a: Any, b: Any) -> tuple[pa.Table, dict[str, Any], dict[str, Any]]:
    """(changes table, totals of a, totals of b) for two Traces (see the module docstring)."""
    rows: list[dict[str, Any]] = []
    wa, wb = _ops_work(a.ops), _ops_work(b.ops)
    key = ["module", "phase", "op"]
    ga, gb = _group(wa, key, ["cpu_ns", "bytes"]), _group(wb, key, ["cpu_ns", "bytes"])
    noise = run_noise(ga, gb)
    rows += _rows("ops", ga, gb, key, lambda d: None, noise)
    rows += _rows("hidden_copies", _group(_hidden(wa), key, ["cpu_ns", "bytes"]),
                  _group(_hidden(wb), key, ["cpu_ns", "bytes"]), key, lambda d: "hidden copy", noise)
    ck = ["op", "from_dtype", "to_dtype", "kind"]
    rows += _rows("casts", _group(a.casts.select(ck + ["bytes"]), ck, ["bytes"]),
                  _group(b.casts.select(ck + ["bytes"]), ck, ["bytes"]), ck,
                  lambda d: f"{d['kind']} {d['from_dtype']} → {d['to_dtype']}")
    lk = ["kind", "op", "from_format", "to_format"]
    rows += _rows("layout", _group(a.layout_changes.select(lk + ["bytes"]), lk, ["bytes"]),
                  _group(b.layout_changes.select(lk + ["bytes"]), lk, ["bytes"]), lk,
                  lambda d: f"{d['kind']} {d['from_format']} → {d['to_format']}")
    # what ran differently (ops that appeared or vanished, counts, bytes) before what only took longer:
    # within a tier the bytes first, then the time
    rows.sort(key=lambda r: (_TIER[r["status"]], -abs(r["delta_bytes"] or 0), -abs(r["delta_cpu_ns"] or 0),
                             -abs(r["delta_count"]), r["section"], r["module"] or "", r["op"] or ""))
    table = pa.Table.from_pylist(rows, schema=S.DIFF) if rows else S.DIFF.empty_table()
    return table, totals(a), totals(b)


def regressions(ta: dict[str, Any], tb: dict[str, Any], time: float = 0.2, memory: float = 0.1) -> list[dict[str, Any]]:
    """Failures of the baseline guard: CPU time in ops up by more than ``time`` (a fraction) and
    ``MIN_TIME_NS``; a device's peak live bytes up by more than ``memory`` and ``MIN_BYTES``."""
    out = []
    a, b = ta["cpu_ns"], tb["cpu_ns"]
    if b - a > max(time * a, MIN_TIME_NS):
        out.append(dict(what="time", device=None, before=a, after=b, threshold=time))
    pa_, pb = ta["peak_bytes"], tb["peak_bytes"]
    for dev in sorted(set(pa_) | set(pb)):
        x, y = pa_.get(dev, 0), pb.get(dev, 0)
        if y - x > max(memory * x, MIN_BYTES):
            out.append(dict(what="memory", device=dev, before=x, after=y, threshold=memory))
    return out
