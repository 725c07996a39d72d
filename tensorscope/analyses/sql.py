"""DuckDB over a trace's tables, registered zero-copy as Arrow tables.

Only the tables a query names are registered, so derived tables are not built
for queries that do not use them.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from .. import schema as S


def run_sql(table: Callable[[str], Any], query: str, *, arrow: bool = False) -> Any:
    """``query`` over the tables ``table(name)`` returns (a trace's ``table`` method; only the
    tables the query names are asked for): a pandas DataFrame, or a pyarrow.Table with ``arrow=True``."""
    try:
        import duckdb
    except ImportError as e:
        raise ImportError("t.sql() needs duckdb: pip install 'tensorscope[sql]'") from e
    con = duckdb.connect(database=":memory:")
    try:
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", query))
        for name in S.TABLES:
            if name in words:
                con.register(name, table(name))
        if arrow:
            rel = con.sql(query)
            fetch = getattr(rel, "to_arrow_table", None) or rel.arrow   # duckdb >= 1.4 / older
            return fetch()
        return con.execute(query).df()
    finally:
        con.close()
