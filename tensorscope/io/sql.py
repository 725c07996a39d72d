"""DuckDB over a Trace's tables, registered zero-copy as Arrow tables.

Only the tables a query names are registered, so derived tables are not built
for queries that do not use them.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from .. import schema as S

if TYPE_CHECKING:
    from .._trace import Trace


def run_sql(trace: "Trace", query: str, *, arrow: bool = False) -> Any:
    """``query`` over ``trace``'s tables: a pandas DataFrame, or a pyarrow.Table with ``arrow=True``."""
    try:
        import duckdb
    except ImportError as e:
        raise ImportError("t.sql() needs duckdb: pip install 'tensorscope[sql]'") from e
    con = duckdb.connect(database=":memory:")
    try:
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", query))
        for name in S.TABLES:
            if name in words:
                con.register(name, trace.table(name))
        if arrow:
            rel = con.sql(query)
            fetch = getattr(rel, "to_arrow_table", None) or rel.arrow   # duckdb >= 1.4 / older
            return fetch()
        return con.execute(query).df()
    finally:
        con.close()
