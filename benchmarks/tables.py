"""Table building and python-engine per-op cost, for the string-column work (schema 1.2).

(a) Per engine (``--engines``), records an ``--ops``-op trace of small ops once, then
times decoding it into the Arrow ``ops`` table (``_Ctx`` + ``_ops_table``, best of
``--reps``; also the ``calls`` and ``tensors`` tables) and the whole table build (``finish.finish_tables`` + the Trace)
once, in µs per op, and the ops table's in-memory size. A one-op trace runs first, so
one-time imports are not counted (they are the fixed cost overhead.py measures).
(b) Per-op overhead of ``trace(leaks=False)`` and of ``trace()`` over eager on a loop
of small 8x8 ops, eager and traced rounds interleaved, median of ``--rounds``.

    python benchmarks/tables.py [--ops 1000000] [--reps 3] [--rounds 15] [--engines native,python] [--json out.json]

Run it against another checkout (PYTHONPATH) to compare before/after; single thread.
Times are the thread's CPU time (``time.thread_time_ns``): on a shared machine wall time
measures the neighbours; CPU time of a single-threaded loop barely does.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import numpy as np
import torch

import tensorscope

_clock = time.thread_time_ns


def record(n_ops, engine="python"):
    """A trace of ``n_ops`` small ops, stopped (modes and observer off) but not built yet."""
    from tensorscope.options import TraceOptions
    from tensorscope.recording.session import new_session

    x = torch.rand(8, 8) * 0.5
    sess = new_session(TraceOptions(leaks=False, nonfinite=False, engine=engine))
    sess.start()
    try:
        z = x
        for _ in range(n_ops // 2):
            z = x + z
            z = z.relu_()
    finally:
        sess._restore()
    sess.engine.finish(sess.ctx)   # the native engine hands its packed chunks over (part of the timed build below)
    sess.ctx.rec.end_chunk()
    return sess


def _warm(engine):
    """One tiny trace first: one-time imports and pyarrow's lazy initialisation are the fixed
    cost (measured by overhead.py), not the per-op cost measured here."""
    with tensorscope.trace(engine=engine, leaks=False):
        torch.ones(2) + 1


def build_cost(n_ops, reps, engine="python"):
    from tensorscope.recording import decode, finish

    _warm(engine)
    t0 = time.perf_counter()
    sess = record(n_ops, engine)
    rec_s = time.perf_counter() - t0
    best = {}
    ops = None
    for _ in range(reps):
        gc.collect()
        t = [_clock()]
        ctx = decode.Decoder(sess.ctx.rec, cell=sess.cell, screen=sess.ctx.screen, links=type(sess.links)())
        t.append(_clock())
        ops, _ = decode.ops_table(ctx, sess.options.spill_dir)
        t.append(_clock())
        decode.calls_table(ctx)
        t.append(_clock())
        decode.tensors_table(ctx)
        t.append(_clock())
        for k, dt in zip(("context", "ops", "calls", "tensors"), np.diff(t)):
            best[k] = dt if k not in best else min(best[k], dt)
    n = ops.num_rows
    gc.collect()
    t0 = _clock()
    tables, _, _ = finish.finish_tables(sess)
    trace = tensorscope.Trace(tables, finish.metadata(sess, tables["ops"].num_rows, []))
    full = _clock() - t0
    sess.ctx.rec.close()
    res = {"engine": sess.engine.name, "n_ops": n, "record_s": rec_s,
           "ops_table_us_per_op": (best["context"] + best["ops"]) / n / 1e3,
           "parts_us_per_op": {k: v / n / 1e3 for k, v in best.items()},
           "finish_us_per_op": full / n / 1e3, "ops_table_bytes_per_op": ops.nbytes / n,
           "string_columns": {f.name: str(f.type) for f in ops.schema
                              if "string" in str(f.type)}}
    print(f"(a) [{res['engine']}] {n} ops: ops table {(best['context'] + best['ops']) / 1e6:.0f} ms = "
          f"{res['ops_table_us_per_op']:.3f} µs/op (best of {reps}; " +
          ", ".join(f"{k} {v:.3f}" for k, v in res["parts_us_per_op"].items()) + " µs/op); "
          f"whole finish {full / 1e6:.0f} ms = {res['finish_us_per_op']:.3f} µs/op; "
          f"ops table {res['ops_table_bytes_per_op']:.0f} B/op in memory")
    del trace
    return res


def per_op(rounds, n_iter=1000):
    from overhead import small_ops  # the same small-op workload as benchmarks/overhead.py

    run, n = small_ops(n_iter)
    ctx = {"eager": None, "trace(leaks=False)": dict(leaks=False), "trace()": {}}
    samples = {k: [] for k in ctx}
    for kw in ctx.values():   # warm-up
        if kw is None:
            run()
        else:
            with tensorscope.trace(**kw):
                run()
    for _ in range(rounds):
        for k, kw in ctx.items():
            gc.collect()
            t0 = _clock()
            if kw is None:
                run()
            else:
                with tensorscope.trace(**kw):
                    run()
            samples[k].append(_clock() - t0)
    med = {k: statistics.median(v) / n / 1e3 for k, v in samples.items()}
    res = {k: {"us_per_op": v, "overhead_us": v - med["eager"]} for k, v in med.items()}
    print(f"(b) small ops, {n} per run, median of {rounds}: " +
          ", ".join(f"{k} {v['us_per_op']:.2f} µs/op (+{v['overhead_us']:.2f})" for k, v in res.items()))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--engines", default="native,python", help="engines to measure the build under")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from tensorscope import schema

    out = {"schema": schema.SCHEMA_VERSION, "tensorscope": tensorscope.__file__}
    print(f"schema {schema.SCHEMA_VERSION} from {tensorscope.__file__}")
    if a.rounds:
        out["per_op"] = per_op(a.rounds)
    if a.ops:
        out["build"] = {}
        for eng in a.engines.split(","):
            out["build"][eng] = build_cost(a.ops, a.reps, eng)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
