"""Cross-rank analyses: pure functions of dataset tables (pyarrow in, pyarrow out).

Inputs carry the dataset's ``run`` and ``rank`` columns (``Dataset.sql(..., arrow=True)``):

* ``op_totals(ops)`` — per (run, rank, attempt, trace_id, op): ``n``, ``cpu_ns``.
  ``Dataset`` computes it in DuckDB over the parquet views (the same query;
  the full ops table never has to be in memory);
* ``rank_times(ranks, op_totals, collectives)`` — per (run, rank): traces,
  mean trace wall time (a "step" when you trace one step per trace), compute
  (CPU time of non-collective ops) and communication (collective call start to
  completion, or to the end of the call where completion is unknown) per trace;
* ``collective_skew(collectives, ranks)`` — per collective (matched across ranks
  by run, attempt, trace_id, pg_name, coll_index): arrival time of each rank on
  rank 0's clock, ``skew_ns`` (last minus first arrival), ``straggler_rank``
  (the last to arrive: the others wait for it);
* ``op_differences(op_totals)`` — ops whose call count is not the same on every
  rank of a run (a rank that runs different work).
"""
from __future__ import annotations

import pyarrow as pa

COMM_NAMESPACES = ("c10d", "_c10d_functional")


def _query(sql: str, **tables: pa.Table) -> pa.Table:
    import duckdb

    con = duckdb.connect(database=":memory:")
    try:
        for name, t in tables.items():
            con.register(name, t)
        rel = con.sql(sql)
        fetch = getattr(rel, "to_arrow_table", None) or rel.arrow
        return fetch()
    finally:
        con.close()


OP_TOTALS_SQL = """
SELECT run, rank, attempt, trace_id, op, count(*)::BIGINT AS n, coalesce(sum(cpu_ns), 0)::BIGINT AS cpu_ns
FROM ops GROUP BY run, rank, attempt, trace_id, op
"""


def op_totals(ops: pa.Table) -> pa.Table:
    return _query(OP_TOTALS_SQL, ops=ops)


def rank_times(ranks: pa.Table, totals: pa.Table, collectives: pa.Table) -> pa.Table:
    return _query("""
    WITH t AS (SELECT run, rank, attempt, trace_id, wall_ns FROM ranks),
    comp AS (SELECT run, rank, attempt, trace_id,
                    sum(CASE WHEN split_part(op, '.', 1) IN ('c10d', '_c10d_functional') THEN 0 ELSE cpu_ns END) AS compute_ns,
                    sum(CASE WHEN split_part(op, '.', 1) IN ('c10d', '_c10d_functional') THEN cpu_ns ELSE 0 END) AS comm_call_ns
             FROM totals GROUP BY ALL),
    comm AS (SELECT run, rank, attempt, trace_id,
                    sum(coalesce(done_ns, start_ns + enqueue_ns) - start_ns) AS comm_ns,
                    count(*) AS n_collectives, count(done_ns) AS n_done
             FROM collectives GROUP BY ALL)
    SELECT t.run, t.rank, count(*)::BIGINT AS traces,
           avg(t.wall_ns)::BIGINT AS wall_ns,
           avg(coalesce(comp.compute_ns, 0))::BIGINT AS compute_ns,
           avg(coalesce(comm.comm_ns, 0))::BIGINT AS comm_ns,
           sum(coalesce(comm.n_collectives, 0))::BIGINT AS n_collectives,
           sum(coalesce(comm.n_done, 0))::BIGINT AS n_done
    FROM t LEFT JOIN comp USING (run, rank, attempt, trace_id) LEFT JOIN comm USING (run, rank, attempt, trace_id)
    GROUP BY t.run, t.rank ORDER BY t.run, t.rank
    """, ranks=ranks, totals=totals, collectives=collectives)


def collective_skew(collectives: pa.Table, ranks: pa.Table) -> pa.Table:
    return _query("""
    WITH a AS (
        SELECT c.run, c.rank, c.attempt, c.trace_id, c.pg_name, c.coll_index, c.op, c.nbytes,
               r.start_unix_ns + c.start_ns AS arrival_ns, r.clock_synced
        FROM collectives c JOIN ranks r USING (run, rank, attempt, trace_id))
    SELECT run, attempt, trace_id, pg_name, coll_index, any_value(op) AS op,
           count(DISTINCT op)::BIGINT AS n_ops_seen, count(*)::BIGINT AS n_ranks, max(nbytes)::BIGINT AS nbytes,
           (max(arrival_ns) - min(arrival_ns))::BIGINT AS skew_ns,
           arg_max(rank, arrival_ns)::BIGINT AS straggler_rank, arg_min(rank, arrival_ns)::BIGINT AS first_rank,
           bool_and(coalesce(clock_synced, false)) AS clock_synced
    FROM a GROUP BY run, attempt, trace_id, pg_name, coll_index
    ORDER BY run, attempt, trace_id, pg_name, coll_index
    """, collectives=collectives, ranks=ranks)


def op_differences(totals: pa.Table) -> pa.Table:
    return _query("""
    WITH per AS (SELECT run, rank, op, sum(n)::BIGINT AS n FROM totals GROUP BY ALL),
    rk AS (SELECT DISTINCT run, rank FROM totals),
    grid AS (SELECT rk.run, rk.rank, o.op FROM rk JOIN (SELECT DISTINCT run, op FROM per) o USING (run)),
    full_ AS (SELECT g.run, g.rank, g.op, coalesce(per.n, 0) AS n FROM grid g LEFT JOIN per USING (run, rank, op))
    SELECT run, op, min(n)::BIGINT AS min_calls, max(n)::BIGINT AS max_calls,
           arg_min(rank, n)::BIGINT AS rank_min, arg_max(rank, n)::BIGINT AS rank_max, count(*)::BIGINT AS n_ranks
    FROM full_ GROUP BY run, op HAVING min(n) <> max(n)
    ORDER BY run, max(n) - min(n) DESC, op
    """, totals=totals)
