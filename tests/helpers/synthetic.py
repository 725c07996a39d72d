"""Schema-conformant tables and real Trace objects built from a few hand-written rows.

For renderer/exporter tests that need exact timings or GPU kernels a CPU run cannot produce.
"""
from __future__ import annotations

import pyarrow as pa

from tensorscope import schema as S
from tensorscope._trace import Trace


def table(name, rows):
    if not rows:
        return S.empty(name)
    cols = {k: [r.get(k) for r in rows] for k in rows[0]}
    return S.conform(name, pa.table({k: pa.array(v, S.TABLES[name].field(k).type) for k, v in cols.items()}))


def make_trace(metadata=None, **tables) -> Trace:
    """A real Trace over the given tables (absent ones empty, derived ones empty unless given)."""
    full = {n: tables.get(n, S.empty(n)) for n in S.TABLES}
    return Trace(full, dict(metadata or {}))


def no_cpu_wait(t) -> Trace:
    """The recorded trace ``t`` (a Trace or a trace() handle) as if no thread had waited for a CPU
    (``run_delay_ns``, ``worker_run_delay_ns`` 0): for tests of what the roofline reads from op times, which a busy machine's wait
    could otherwise explain away (tests/analyses/test_busy_machine.py tests that rule)."""
    t = getattr(t, "result", t)
    return Trace(t.tables, t.metadata.replace(run_delay_ns=0, worker_run_delay_ns=0))
