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
from typing import Any, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import schema as S
from ..errors import ExportError
from ..metadata import PARQUET_KEY, PARQUET_VERSION_KEY, TraceMetadata
from . import TraceTables
from .parquet import writer_options

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
    pq.write_table(data.replace_schema_metadata(md), tmp, **writer_options(data.schema))
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
    cols = list(t.columns) + [pa.array(np.full(n, attempt, np.int64)), pa.array(np.full(n, trace_id, np.int64))]
    return pa.Table.from_arrays(cols, schema=S.dataset_schema(name))


def _check_root(root: PathLike) -> str:
    root = os.path.abspath(os.fspath(root))
    if os.path.exists(root) and not os.path.isdir(root):
        raise ExportError(f"cannot write the dataset to {root!r}: a file with that name exists "
                          "(the trace is still in memory: tensorscope.last())")
    return root


def ranks_row(trace: TraceTables, ident: dict[str, Any], dist: Any, trace_id: int) -> pa.Table:
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


def reserve_trace_id(root: PathLike, ident: dict[str, Any]) -> int:
    """The trace_id of this rank's next trace (its ranks part number), fixed before any part is written."""
    root = _check_root(root)
    return _next_part(partition_dir(root, "ranks", ident["run_id"], int(ident["rank"])), int(ident["attempt"]))


def write_table_parts(root: PathLike, name: str, ident: dict[str, Any], trace_id: int, table: pa.Table,
                      metadata: Union[TraceMetadata, bytes, None] = None) -> list[str]:
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


def write_trace(trace: TraceTables, root: PathLike, *, ident: dict[str, Any], dist: Any = None, trace_id: Optional[int] = None,
                ops_written: int = 0) -> dict[str, Any]:
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

def sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def parts_glob(root: str, table: str) -> str:
    return os.path.join(root, table, "*", "*", "part-*.parquet")


def has_parts(root: str, table: str) -> bool:
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
