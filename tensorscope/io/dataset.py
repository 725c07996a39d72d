"""Multi-rank datasets: every rank's tables in one partitioned parquet tree, and ``open_dataset``.

Layout, read unchanged by DuckDB, pyarrow.dataset, polars and Spark::

    <root>/<table>/run=<run_id>/rank=<rank>/part-a<attempt>-<n>.parquet

* ``run`` and ``rank`` are hive partition keys only, never columns in the files;
  ``attempt`` (``TORCHELASTIC_RESTART_COUNT``) and ``trace_id`` (the trace within
  one rank and attempt: a headless notebook run writes one per cell) are columns.
* ``ranks`` has one row per trace a rank wrote: identity, host, pid, device,
  clock anchor and offset to rank 0, versions and the trace's metadata as JSON.
* Every part carries the trace's ``TraceMetadata`` as JSON under the
  ``b"tensorscope"`` key of its key-value metadata (parts of ``ops`` written while
  the trace still records carry what is known then: versions, options, cell).
* Every part is written with the table's canonical schema (``schema.dataset_schema``:
  a cast before writing, so a rank with no collectives or an all-null column
  writes the same types as the others), zstd, under a dot-prefixed temporary
  name in ``<root>/.tensorscope-tmp`` and then linked into place without
  overwriting (a taken part number moves on to the next): a table's directory
  only ever holds complete ``part-*.parquet`` files, even when a rank is killed.
* Empty tables are written too (zero rows, full schema) so every engine finds
  every table of every rank.
"""
from __future__ import annotations

import json
import os
import re
import uuid
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import pyarrow as pa
import pyarrow.parquet as pq

from .. import schema as S
from ..errors import ExportError, TraceFormatError
from ..metadata import PARQUET_KEY, PARQUET_VERSION_KEY, TraceMetadata

if TYPE_CHECKING:
    from .._trace import Trace

PathLike = Union[str, "os.PathLike[str]"]
TMP_DIR = ".tensorscope-tmp"
DATASET_TABLES = tuple(S.TABLES) + ("ranks",)
PART_ROWS = 1_000_000   # rows per part file
_PART = re.compile(r"^part-a(\d+)-(\d+)\.parquet$")


def partition_dir(root: str, table: str, run_id: str, rank: int) -> str:
    return os.path.join(root, table, f"run={run_id}", f"rank={int(rank)}")


def _next_part(dirpath: str, attempt: int) -> int:
    n = -1
    try:
        for f in os.listdir(dirpath):
            m = _PART.match(f)
            if m and int(m.group(1)) == attempt:
                n = max(n, int(m.group(2)))
    except FileNotFoundError:
        pass
    return n + 1


def write_part(root: str, table: str, run_id: str, rank: int, attempt: int, data: pa.Table,
               n: Optional[int] = None, metadata: Union[TraceMetadata, bytes, None] = None) -> str:
    """Write one part atomically (temp file, then a link that never overwrites). Returns its path.
    ``metadata``: the trace's, stored under ``b"tensorscope"`` in the part's key-value metadata."""
    d = partition_dir(root, table, run_id, rank)
    tmpd = os.path.join(root, TMP_DIR)
    os.makedirs(d, exist_ok=True)
    os.makedirs(tmpd, exist_ok=True)
    tmp = os.path.join(tmpd, f".{table}-{uuid.uuid4().hex}.parquet")
    md = {**(data.schema.metadata or {}), PARQUET_VERSION_KEY: S.SCHEMA_VERSION.encode()}
    if metadata is not None:
        md[PARQUET_KEY] = _kv_json(metadata)
    # zstd level 1: half the write time of the default level for ~10% larger files (measured on ops)
    pq.write_table(data.replace_schema_metadata(md), tmp, compression="zstd", compression_level=1)
    try:
        n = _next_part(d, attempt) if n is None else n
        while True:
            final = os.path.join(d, f"part-a{attempt}-{n:05d}.parquet")
            try:
                os.link(tmp, final)
                break
            except FileExistsError:
                n += 1
            except OSError:   # a filesystem without hard links: replace, after checking the name is free
                if os.path.exists(final):
                    n += 1
                    continue
                os.replace(tmp, final)
                break
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


def _kv_json(md: Union[TraceMetadata, bytes]) -> bytes:
    """The ``b"tensorscope"`` value: a trace's metadata as JSON (encoded once by whoever writes many parts)."""
    return md if isinstance(md, bytes) else md.to_json().encode()


def to_dataset_table(name: str, table: pa.Table, attempt: int, trace_id: int) -> pa.Table:
    """``table`` in the canonical dataset schema of ``name`` (cast, keys appended)."""
    t = S.conform(name, table)
    n = t.num_rows
    cols = list(t.columns) + [pa.array([attempt] * n, pa.int64()), pa.array([trace_id] * n, pa.int64())]
    return pa.Table.from_arrays(cols, schema=S.dataset_schema(name))


def _check_root(root: "PathLike") -> str:
    root = os.path.abspath(os.fspath(root))
    if os.path.exists(root) and not os.path.isdir(root):
        raise ExportError(f"cannot write the dataset to {root!r}: a file with that name exists "
                          "(the trace is still in memory: tensorscope.last())")
    return root


def ranks_row(trace: "Trace", ident: Dict[str, Any], dist: Any, trace_id: int) -> pa.Table:
    md = trace.metadata
    clock = getattr(dist, "clock", None)
    clock_end = getattr(dist, "clock_end", None)
    offset = clock[0] if clock else 0
    anchor = getattr(dist, "anchor_unix_ns", 0) or md.get("created_unix_ns", 0)
    wall = md.get("wall_ns") or 0
    row = {
        "attempt": ident["attempt"], "trace_id": trace_id, "local_rank": ident.get("local_rank"),
        "world_size": ident.get("world_size"), "rank_source": ident.get("rank_source"),
        "run_source": ident.get("run_source"), "host": ident.get("host"), "pid": ident.get("pid"),
        "device": ident.get("device"), "backend": ident.get("backend"), "clock_synced": clock is not None,
        "clock_offset_ns": offset, "clock_error_ns": clock[1] if clock else None,
        "clock_offset_end_ns": clock_end[0] if clock_end else None,
        "anchor_unix_ns": anchor, "anchor_perf_ns": getattr(dist, "anchor_perf_ns", None),
        "start_unix_ns": anchor + offset, "end_unix_ns": anchor + offset + wall, "wall_ns": wall,
        "n_ops": md.get("n_ops"), "n_collectives": trace.table("collectives").num_rows,
        "cell": md.get("cell"), "cell_source": md.get("cell_source"),
        "tensorscope_version": md.get("tensorscope_version"), "torch_version": md.get("torch_version"),
        "python_version": md.get("python_version"), "schema_version": S.SCHEMA_VERSION,
        "metadata_json": md.to_json() if isinstance(md, TraceMetadata) else json.dumps(md),
    }
    return pa.Table.from_pylist([row], schema=S.RANKS)


def reserve_trace_id(root: "PathLike", ident: Dict[str, Any]) -> int:
    """The trace_id of this rank's next trace (its ranks part number), fixed before any part is written."""
    root = _check_root(root)
    return _next_part(partition_dir(root, "ranks", ident["run_id"], int(ident["rank"])), int(ident["attempt"]))


def write_table_parts(root: "PathLike", name: str, ident: Dict[str, Any], trace_id: int, table: pa.Table,
                      metadata: Union[TraceMetadata, bytes, None] = None) -> List[str]:
    """``table`` (a Trace table ``name``) as parts of at most PART_ROWS rows; an empty table writes
    one empty part with the full schema. ``metadata``: the trace's (see ``write_part``)."""
    root = _check_root(root)
    run_id, rank, attempt = ident["run_id"], int(ident["rank"]), int(ident["attempt"])
    kv = _kv_json(metadata) if metadata is not None else None
    out = []
    try:
        for off in range(0, max(table.num_rows, 1), PART_ROWS):
            out.append(write_part(root, name, run_id, rank, attempt,
                                  to_dataset_table(name, table.slice(off, PART_ROWS), attempt, trace_id),
                                  metadata=kv))
    except OSError as e:
        raise ExportError(f"cannot write the dataset to {root!r}: {e.strerror or e} "
                          "(the trace is still in memory: tensorscope.last())") from e
    return out


def write_trace(trace: "Trace", root: "PathLike", *, ident: Dict[str, Any], dist: Any = None, trace_id: Optional[int] = None,
                ops_written: int = 0) -> Dict[str, Any]:
    """Write every table of ``trace`` (this rank) into dataset ``root``. Returns where it went.

    ``trace_id``/``ops_written``: parts of this trace's first ``ops_written`` ops rows were already
    written while it recorded (the spill path); only the rest is written now."""
    root = _check_root(root)
    run_id, rank, attempt = ident["run_id"], int(ident["rank"]), int(ident["attempt"])
    kv = _kv_json(trace.metadata)
    try:
        if trace_id is None:
            trace_id = _next_part(partition_dir(root, "ranks", run_id, rank), attempt)
        parts = []
        for name in S.TABLES:
            table = trace.table(name)
            if name == "ops" and ops_written:
                table = table.slice(ops_written)
                if table.num_rows == 0:
                    continue
            # big tables roll into parts of PART_ROWS rows (a spilled ops table is memory-mapped:
            # slicing it streams it)
            parts += write_table_parts(root, name, ident, trace_id, table, metadata=kv)
        # the ranks row last: a trace with a ranks row is complete
        parts.append(write_part(root, "ranks", run_id, rank, attempt, ranks_row(trace, ident, dist, trace_id),
                                n=trace_id, metadata=kv))
    except OSError as e:
        raise ExportError(f"cannot write the dataset to {root!r}: {e.strerror or e} "
                          "(the trace is still in memory: tensorscope.last())") from e
    return {"root": root, "run": run_id, "rank": rank, "attempt": attempt, "trace_id": trace_id, "parts": len(parts)}


# -- reading -----------------------------------------------------------------------------

def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _glob(root: str, table: str) -> str:
    return os.path.join(root, table, "*", "*", "part-*.parquet")


def _has_parts(root: str, table: str) -> bool:
    base = os.path.join(root, table)
    if not os.path.isdir(base):
        return False
    for run in os.listdir(base):
        rd = os.path.join(base, run)
        if run.startswith("run=") and os.path.isdir(rd):
            for rank in os.listdir(rd):
                kd = os.path.join(rd, rank)
                if rank.startswith("rank=") and os.path.isdir(kd) and any(_PART.match(f) for f in os.listdir(kd)):
                    return True
    return False


def open_dataset(root: "PathLike") -> "Dataset":
    """Open a dataset written with ``trace(dataset=root)`` / ``python -m tensorscope run --out root``."""
    return Dataset(root)


class Dataset:
    """All runs and ranks of a dataset directory. ``.sql()`` sees one DuckDB view per table
    (``ops``, ``collectives``, ``ranks``…) over every run and rank, with ``run`` and ``rank`` columns."""

    def __init__(self, root: "PathLike") -> None:
        import duckdb

        self.root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise TraceFormatError(f"{self.root!r} is not a directory (no tensorscope dataset there)")
        if not _has_parts(self.root, "ranks") and not _has_parts(self.root, "ops"):
            raise TraceFormatError(f"{self.root!r} is not a tensorscope dataset (no ranks/ or ops/ parts); "
                                   "a single saved trace opens with tensorscope.load()")
        self._con = duckdb.connect(database=":memory:")
        for name in DATASET_TABLES:
            if _has_parts(self.root, name):
                self._con.execute(
                    f"CREATE VIEW {name} AS SELECT * FROM read_parquet({_sql_str(_glob(self.root, name))}, "
                    "hive_partitioning=true, union_by_name=true, hive_types={'run': VARCHAR, 'rank': BIGINT})")
            else:   # no rank wrote it (a partial dataset): an empty view with the right columns
                empty = S.dataset_schema(name).empty_table()
                empty = empty.append_column("run", pa.array([], pa.string())).append_column("rank", pa.array([], pa.int64()))
                self._con.register(f"_empty_{name}", empty)
                self._con.execute(f"CREATE VIEW {name} AS SELECT * FROM _empty_{name}")
        from .parquet import check_version

        for (v,) in self._con.execute("SELECT DISTINCT schema_version FROM ranks").fetchall():
            if v is not None:
                check_version(v, self.root)

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> "Dataset":
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

    def _arrow(self, query: str, params: Optional[List[Any]] = None) -> pa.Table:
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
    def runs(self) -> List[str]:
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
              attempt: Optional[int] = None) -> "Trace":
        """One rank's ``Trace`` (the latest attempt; pass ``trace_id=`` when the rank wrote several)."""
        from .._trace import Trace

        run = self._pick_run(run)
        where = "run = ? AND rank = ?"
        params: List[Any] = [run, int(rank)]
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
        md: Dict[str, Any] = {}
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
    def to_perfetto(self, path: "PathLike", run: Optional[str] = None) -> str:
        """All ranks of one run on one timeline (rank 0's clock), a process per rank."""
        from ..render.perfetto_ranks import write_dataset_perfetto

        return write_dataset_perfetto(self, path, self._pick_run(run) if run is not None or len(self.runs) <= 1
                                      else self.runs[-1])

    def summary(self, run: Optional[str] = None) -> Any:
        """Per-rank step time, compute vs communication, collective skew and stragglers, differing ops."""
        from ..render.ranks import dataset_summary

        return dataset_summary(self, run)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Dict[str, str]:
        s = self.summary()
        return {"text/plain": s.to_text(), "text/html": s.to_html()}
