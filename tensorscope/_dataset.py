"""A multi-rank dataset opened for queries (``tensorscope.open_dataset``): one DuckDB view per
table over every run and rank, and any rank's trace as a ``Trace``. The layout it reads is written
by ``io/dataset.py`` (its docstring describes it)."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import pyarrow as pa

from . import schema as S
from ._trace import Trace
from .errors import TraceFormatError
from .io.dataset import DATASET_TABLES, PathLike, has_parts, parts_glob, sql_str
from .metadata import TraceMetadata, check_version


def open_dataset(root: PathLike) -> Dataset:
    """Open a dataset written with ``trace(dataset=root)`` / ``python -m tensorscope run --out root``.

    Parameters
    ----------
    root : str or os.PathLike
        The dataset directory: ``root/<table>/run=<id>/rank=<r>/part-*.parquet``.

    Returns
    -------
    Dataset
        Every run and rank of it: ``.runs``, ``.ranks``, ``.sql(...)``, ``.df(...)``,
        ``.trace(rank=..., run=...)``, ``.summary()``, ``.to_perfetto(path)``.

    Examples
    --------
    >>> import tempfile, torch, tensorscope
    >>> root = tempfile.mkdtemp()
    >>> with tensorscope.trace(dataset=root, leaks=False):
    ...     y = torch.ones(4).relu()
    >>> ds = tensorscope.open_dataset(root)
    >>> len(ds.runs), int(ds.sql("select count(*) as n from ranks")["n"][0])
    (1, 1)
    """
    return Dataset(root)


class Dataset:
    """All runs and ranks of a dataset directory. ``.sql()`` sees one DuckDB view per table
    (``ops``, ``collectives``, ``ranks``…) over every run and rank, with ``run`` and ``rank`` columns."""

    def __init__(self, root: PathLike) -> None:
        import duckdb

        self.root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise TraceFormatError(f"{self.root!r} is not a directory (no tensorscope dataset there)")
        if not has_parts(self.root, "ranks") and not has_parts(self.root, "ops"):
            raise TraceFormatError(f"{self.root!r} is not a tensorscope dataset (no ranks/ or ops/ parts); "
                                   "a single saved trace opens with tensorscope.load()")
        self._con = duckdb.connect(database=":memory:")
        for name in DATASET_TABLES:
            if has_parts(self.root, name):
                self._con.execute(
                    f"CREATE VIEW {name} AS SELECT * FROM read_parquet({sql_str(parts_glob(self.root, name))}, "
                    "hive_partitioning=true, union_by_name=true, hive_types={'run': VARCHAR, 'rank': BIGINT})")
            else:   # no rank wrote it (a partial dataset): an empty view with the right columns
                empty = S.dataset_schema(name).empty_table()
                empty = empty.append_column("run", pa.array([], pa.string())).append_column("rank", pa.array([], pa.int64()))
                self._con.register(f"_empty_{name}", empty)
                self._con.execute(f"CREATE VIEW {name} AS SELECT * FROM _empty_{name}")
        for (v,) in self._con.execute("SELECT DISTINCT schema_version FROM ranks").fetchall():
            if v is not None:
                check_version(v, self.root)

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        r = self.ranks
        return (f"<tensorscope.Dataset {self.root!r}: {len(self.runs)} run(s), "
                f"{r['rank'].nunique() if len(r) else 0} rank(s), {len(r)} trace(s)>")

    # -- queries ---------------------------------------------------------------
    def sql(self, query: str, *, arrow: bool = False) -> Any:
        """DuckDB SQL over the views; a pandas DataFrame, or a pyarrow.Table with ``arrow=True``."""
        if arrow:
            return self._arrow(query)
        return self._con.sql(query).df()

    def _arrow(self, query: str, params: Optional[list[Any]] = None) -> pa.Table:
        rel = self._con.sql(query, params=params)
        fetch = getattr(rel, "to_arrow_table", None) or rel.arrow
        return fetch()

    def df(self, table: str = "ops") -> Any:
        if table not in DATASET_TABLES:
            raise KeyError(f"no table {table!r}; tables: {', '.join(DATASET_TABLES)}")
        return self.sql(f"SELECT * FROM {table}")

    @property
    def ranks(self) -> Any:
        """The ranks table (one row per trace a rank wrote) as a DataFrame, ordered by run, rank, trace."""
        return self.sql("SELECT run, rank, * EXCLUDE (run, rank) FROM ranks "
                        "ORDER BY start_unix_ns, run, rank, attempt, trace_id")

    @property
    def runs(self) -> list[str]:
        """Run ids, oldest first."""
        rows = self._con.execute("SELECT run, min(start_unix_ns) s FROM ranks GROUP BY run ORDER BY s, run").fetchall()
        if not rows:
            rows = self._con.execute("SELECT DISTINCT run, 0 FROM ops ORDER BY run").fetchall()
        return [r[0] for r in rows]

    def _pick_run(self, run: Optional[str]) -> str:
        runs = self.runs
        if run is None:
            if len(runs) == 1:
                return runs[0]
            if not runs:
                raise TraceFormatError(f"{self.root!r}: the dataset holds no run")
            raise ValueError(f"the dataset holds {len(runs)} runs; pass run= one of {runs}")
        if run not in runs:
            raise ValueError(f"no run {run!r} in the dataset; runs: {runs}")
        return run

    def trace(self, rank: int = 0, run: Optional[str] = None, *, trace_id: Optional[int] = None,
              attempt: Optional[int] = None) -> Trace:
        """One rank's ``Trace`` (the latest attempt; pass ``trace_id=`` when the rank wrote several)."""
        run = self._pick_run(run)
        where = "run = ? AND rank = ?"
        params: list[Any] = [run, int(rank)]
        keys = self._con.execute(f"SELECT DISTINCT attempt, trace_id FROM ranks WHERE {where} ORDER BY 1, 2",
                                 params).fetchall()
        if not keys:
            keys = self._con.execute(f"SELECT DISTINCT attempt, trace_id FROM ops WHERE {where} ORDER BY 1, 2",
                                     params).fetchall()
        if not keys:
            raise ValueError(f"run {run!r} has no rank {rank}")
        if attempt is None:
            attempt = max(k[0] for k in keys)
        keys = [k for k in keys if k[0] == attempt]
        if trace_id is None:
            if len(keys) > 1:
                raise ValueError(f"rank {rank} of run {run!r} wrote {len(keys)} traces in attempt {attempt}; "
                                 f"pass trace_id= one of {[k[1] for k in keys]}")
            if not keys:
                raise ValueError(f"rank {rank} of run {run!r} has no attempt {attempt}")
            trace_id = keys[0][1]
        params += [int(attempt), int(trace_id)]
        cond = where + " AND attempt = ? AND trace_id = ?"
        tables = {}
        for name in S.TABLES:
            t = self._arrow(f"SELECT * EXCLUDE (run, rank, attempt, trace_id) FROM {name} WHERE {cond}", params)
            if name == "ops" and t.num_rows:
                t = t.sort_by("seq")
            tables[name] = S.conform(name, t)
        md_rows = self._con.execute(f"SELECT metadata_json FROM ranks WHERE {cond}", params).fetchall()
        where = f"{self.root!r} (ranks.metadata_json of run {run!r}, rank {int(rank)})"
        md: dict[str, Any] = {}
        if md_rows and md_rows[0][0]:
            try:
                md = json.loads(md_rows[0][0])
            except ValueError:
                md = {"notes": ["metadata_json of this trace is not valid JSON"]}
        if not isinstance(md, dict):
            raise TraceFormatError(f"{where}: trace metadata must be a JSON object")
        md["dataset"] = {"root": self.root, "run": run, "rank": int(rank), "attempt": int(attempt),
                         "trace_id": int(trace_id)}
        return Trace(tables, TraceMetadata.from_dict(md, where=where))

    # -- views -------------------------------------------------------------------
    def to_perfetto(self, path: PathLike, run: Optional[str] = None) -> str:
        """All ranks of one run on one timeline (rank 0's clock), a process per rank."""
        from .render.perfetto_ranks import write_dataset_perfetto

        return write_dataset_perfetto(self, path, self._pick_run(run) if run is not None or len(self.runs) <= 1
                                      else self.runs[-1])

    def summary(self, run: Optional[str] = None) -> Any:
        """Per-rank step time, compute vs communication, collective skew and stragglers, differing ops."""
        from .render.ranks import dataset_summary

        return dataset_summary(self, run)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        s = self.summary()
        return {"text/plain": s.to_text(), "text/html": s.to_html()}
