"""Cross-rank analyses (analyses/ranks.py) on hand-made tables: pure functions, exact answers."""
from __future__ import annotations

import pyarrow as pa

from tensorscope.analyses import ranks as A


def _ranks(starts, synced=True):
    n = len(starts)
    return pa.table({"run": ["r1"] * n, "rank": list(range(n)), "attempt": [0] * n, "trace_id": [0] * n,
                     "start_unix_ns": starts, "wall_ns": [1000 + 10 * r for r in range(n)],
                     "clock_synced": [synced] * n})


def _colls(rows):
    keys = ("rank", "coll_index", "op", "start_ns", "enqueue_ns", "done_ns")
    cols = {k: [r[i] for r in rows] for i, k in enumerate(keys)}
    n = len(rows)
    return pa.table({"run": ["r1"] * n, "attempt": [0] * n, "trace_id": [0] * n, "pg_name": ["0"] * n,
                     "nbytes": [64] * n, **cols})


def test_collective_skew_uses_the_global_clock_and_names_the_last_rank():
    # rank 1's trace started 500 ns later on rank 0's clock: its local 100 is global 600
    ranks = _ranks([1_000, 1_500, 1_000])
    colls = _colls([(0, 0, "c10d.allreduce_.default", 300, 5, 400),
                    (1, 0, "c10d.allreduce_.default", 100, 5, 200),
                    (2, 0, "c10d.allreduce_.default", 250, 5, None),
                    (0, 1, "c10d.barrier.default", 900, 5, 950),
                    (1, 1, "c10d.barrier.default", 300, 5, 350),
                    (2, 1, "c10d.barrier.default", 1_200, 5, 1_300)])
    sk = {r["coll_index"]: r for r in A.collective_skew(colls, ranks).to_pylist()}
    # arrivals idx 0: 1300, 1600, 1250 -> straggler 1, first 2, skew 350
    assert (sk[0]["straggler_rank"], sk[0]["first_rank"], sk[0]["skew_ns"]) == (1, 2, 350)
    # arrivals idx 1: 1900, 1800, 2200 -> straggler 2, first 1, skew 400
    assert (sk[1]["straggler_rank"], sk[1]["first_rank"], sk[1]["skew_ns"]) == (2, 1, 400)
    assert sk[0]["n_ranks"] == 3 and sk[0]["n_ops_seen"] == 1 and sk[0]["clock_synced"]


def test_rank_times_split_compute_and_communication():
    ranks = _ranks([0, 0])
    totals = pa.table({"run": ["r1"] * 4, "rank": [0, 0, 1, 1], "attempt": [0] * 4, "trace_id": [0] * 4,
                       "op": ["aten.mm.default", "c10d.allreduce_.default", "aten.mm.default",
                              "c10d.allreduce_.default"],
                       "n": [2, 1, 2, 1], "cpu_ns": [700, 50, 900, 60]})
    colls = _colls([(0, 0, "c10d.allreduce_.default", 100, 50, 400),
                    (1, 0, "c10d.allreduce_.default", 100, 60, None)])
    rt = {r["rank"]: r for r in A.rank_times(ranks, totals, colls).to_pylist()}
    assert (rt[0]["compute_ns"], rt[0]["comm_ns"], rt[0]["n_done"]) == (700, 300, 1)
    # completion unknown: the call's own duration counts
    assert (rt[1]["compute_ns"], rt[1]["comm_ns"], rt[1]["n_done"]) == (900, 60, 0)
    assert rt[1]["wall_ns"] == 1010


def test_op_differences_include_ops_missing_on_a_rank():
    totals = pa.table({"run": ["r1"] * 3, "rank": [0, 1, 1], "attempt": [0] * 3, "trace_id": [0] * 3,
                       "op": ["aten.mm.default", "aten.mm.default", "aten.exp.default"],
                       "n": [2, 2, 1], "cpu_ns": [1, 1, 1]})
    d = A.op_differences(totals).to_pylist()
    assert [(r["op"], r["min_calls"], r["rank_min"], r["max_calls"], r["rank_max"]) for r in d] == \
        [("aten.exp.default", 0, 0, 1, 1)]
