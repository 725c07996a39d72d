"""Multi-rank dataset benchmark.

    python benchmarks/dataset.py [--ops 300000] [--ranks 8] [--rows 1000000] [--spark] [--json out.json]

1. ``dataset=`` overhead: the parquet write of a real trace (small ops), per million rows,
   resident bytes per op while recording ``--ops`` small ops with ``dataset=``, and the ops
   parts (spilled rows) another process can already read before the trace ends.
2. A dataset of ``--ranks`` ranks × ``--rows`` op rows: a real per-rank trace replicated and
   re-keyed (rank, seq, jittered times), written as torchrun would; then DuckDB's per-(rank, op)
   totals and the straggler query (per collective: last arrival, skew), each timed; with
   ``--spark`` the same two queries in Spark local mode beside them (start-up reported apart).

The issue's full sizes are ``--ops 10000000 --ranks 8 --rows 1000000``; the defaults keep a
run under two minutes on a small machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import torch

import tensorscope
from tensorscope import schema as S
from tensorscope.io.dataset import to_dataset_table, write_part


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def small_ops(n_ops):
    x = torch.rand(8, 8) * 0.5
    z = torch.rand(8, 8)
    for _ in range(n_ops // 3):
        z = x + z
        z = z * x
        z = z.relu()


def record(n_ops, root):
    """Record ``n_ops`` small ops with ``dataset=root``; spilled rows become parts while it runs."""
    import pyarrow.parquet as pq

    torch.set_num_threads(1)
    small_ops(300)
    r0 = rss_bytes()
    peak = [r0]
    spill = max(65536, min(2_000_000, n_ops // 4))
    live_parts = live_rows = 0
    os.environ.setdefault("TENSORSCOPE_RUN_ID", "bench")
    with tensorscope.trace(leaks=False, storages=False, nonfinite=False, dataset=root, spill_rows=spill) as t:
        x = torch.rand(8, 8) * 0.5
        z = torch.rand(8, 8)
        for i in range(n_ops // 3):
            z = x + z
            z = z * x
            z = z.relu()
            if i % 20000 == 0:
                peak[0] = max(peak[0], rss_bytes())
        peak[0] = max(peak[0], rss_bytes())   # while recording: before the tables are built
        d = os.path.join(root, "ops", "run=bench", "rank=0")
        if os.path.isdir(d):   # what another process can read now, mid-trace
            files = [f for f in os.listdir(d) if f.startswith("part-")]
            live_parts = len(files)
            live_rows = sum(pq.ParquetFile(os.path.join(d, f)).metadata.num_rows for f in files)
    t = t.result
    return t, (peak[0] - r0) / max(t.ops.num_rows, 1), live_parts, live_rows


def write_cost(t, root):
    t0 = time.perf_counter()
    write_part(root, "ops", "bench", 0, 0, to_dataset_table("ops", t.ops, 0, 0))
    dt = time.perf_counter() - t0
    return dt / t.ops.num_rows * 1e6   # seconds per million rows


def replicate(t, root, ranks, rows, rng):
    """``ranks`` ranks of ``rows`` op rows each from one real trace, plus a synthetic collective
    sequence (one all-reduce per 1000 ops) with per-rank arrival jitter."""
    base = to_dataset_table("ops", t.ops, 0, 0)
    reps = -(-rows // base.num_rows)
    big = pa.concat_tables([base] * reps).slice(0, rows)
    seq = pa.array(np.arange(rows, dtype=np.int64))
    big = big.set_column(big.schema.get_field_index("seq"), "seq", seq)
    n_coll = rows // 1000
    for r in range(ranks):
        cpu = big.column("cpu_ns").to_numpy() + rng.integers(0, 1000, rows)
        part = big.set_column(big.schema.get_field_index("cpu_ns"), "cpu_ns", pa.array(cpu.astype(np.int64)))
        write_part(root, "ops", "bench", r, 0, part)
        start = np.arange(n_coll, dtype=np.int64) * 1_000_000 + rng.integers(0, 50_000, n_coll) * (1 + (r == 3))
        coll = pa.table({"seq": pa.array(np.arange(n_coll, dtype=np.int64) * 1000), "op": ["c10d.allreduce_.default"] * n_coll,
                         "pg_name": ["0"] * n_coll, "pg_size": pa.array([ranks] * n_coll, pa.int64()),
                         "reduce_op": ["SUM"] * n_coll, "nbytes": pa.array([4096] * n_coll, pa.int64()),
                         "start_ns": pa.array(start), "enqueue_ns": pa.array([10_000] * n_coll, pa.int64()),
                         "done_ns": pa.array(start + 200_000), "coll_index": pa.array(np.arange(n_coll, dtype=np.int64))})
        write_part(root, "collectives", "bench", r, 0, to_dataset_table("collectives", coll, 0, 0))
        ranks_row = pa.Table.from_pylist([{"attempt": 0, "trace_id": 0, "local_rank": r, "world_size": ranks,
                                           "clock_synced": True, "clock_offset_ns": 0, "start_unix_ns": 0,
                                           "wall_ns": n_coll * 1_000_000, "schema_version": S.SCHEMA_VERSION}],
                                         schema=S.RANKS)
        write_part(root, "ranks", "bench", r, 0, ranks_row)


TOTALS = "SELECT rank, op, count(*) AS n, sum(cpu_ns) AS cpu_ns FROM ops GROUP BY rank, op"
STRAGGLER = """
SELECT coll_index, arg_max(c.rank, r.start_unix_ns + c.start_ns) AS straggler,
       max(r.start_unix_ns + c.start_ns) - min(r.start_unix_ns + c.start_ns) AS skew_ns
FROM collectives c JOIN ranks r USING (run, rank, attempt, trace_id) GROUP BY coll_index
"""


def timed(fn, reps=3):
    best = None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best, out


def duckdb_queries(root):
    ds = tensorscope.open_dataset(root)
    t_totals, a = timed(lambda: ds.sql(TOTALS, arrow=True))
    t_strag, b = timed(lambda: ds.sql(STRAGGLER, arrow=True))
    return {"duckdb_totals_s": t_totals, "duckdb_straggler_s": t_strag, "totals_rows": a.num_rows,
            "collectives": b.num_rows}


def spark_queries(root):
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    t0 = time.perf_counter()
    spark = (SparkSession.builder.master("local[2]").appName("tensorscope-bench").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    start = time.perf_counter() - t0
    try:
        for name in ("ops", "collectives", "ranks"):
            spark.read.option("mergeSchema", "true").parquet(os.path.join(root, name)).createOrReplaceTempView(name)
        t_totals, _ = timed(lambda: spark.sql(TOTALS).collect(), reps=2)
        t_strag, _ = timed(lambda: spark.sql(STRAGGLER.replace("arg_max", "max_by")).collect(), reps=2)
    finally:
        spark.stop()
    return {"spark_start_s": start, "spark_totals_s": t_totals, "spark_straggler_s": t_strag}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--ops", type=int, default=300_000)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--spark", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    out = {}
    tmp = tempfile.mkdtemp(prefix="tensorscope-bench-")
    try:
        t, b_op, live_parts, live_rows = record(a.ops, os.path.join(tmp, "live"))
        out["recorded_ops"] = t.ops.num_rows
        out["resident_bytes_per_op"] = round(b_op, 1)
        out["parts_readable_while_running"] = live_parts
        out["rows_readable_while_running"] = live_rows
        print(f"while recording: {live_parts} ops parts ({live_rows:,} rows) already readable")
        out["write_s_per_million_rows"] = round(write_cost(t, os.path.join(tmp, "w")), 3)
        print(f"recorded {t.ops.num_rows:,} small ops: {b_op:.1f} B/op resident; "
              f"dataset= write {out['write_s_per_million_rows']:.3f} s per million rows")
        root = os.path.join(tmp, "ds")
        t0 = time.perf_counter()
        replicate(t, root, a.ranks, a.rows, np.random.default_rng(0))
        out["replicate_s"] = round(time.perf_counter() - t0, 2)
        out.update({k: round(v, 3) if isinstance(v, float) else v for k, v in duckdb_queries(root).items()})
        print(f"{a.ranks} ranks x {a.rows:,} rows: DuckDB per-(rank, op) totals {out['duckdb_totals_s']:.3f} s, "
              f"straggler query {out['duckdb_straggler_s']:.3f} s")
        if a.spark:
            sp = spark_queries(root)
            out.update({k: round(v, 3) for k, v in sp.items()})
            print(f"Spark local: start {sp['spark_start_s']:.1f} s, totals {sp['spark_totals_s']:.2f} s, "
                  f"straggler {sp['spark_straggler_s']:.2f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
