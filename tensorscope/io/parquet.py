"""A trace's tables and metadata to a directory of parquet files and back — no pickle anywhere.

Layout: ``<dir>/<table>.parquet`` (zstd) for every table and ``<dir>/metadata.json``
(the trace's ``TraceMetadata`` as JSON: schema version, versions, device, engine,
options, cell source...). The same JSON sits under the ``b"tensorscope"`` key of
every parquet file's key-value metadata, so a reader given one file (DuckDB's
``parquet_kv_metadata``, pyarrow's ``schema.metadata``, Spark) knows the options
the trace was recorded with. Loading an untrusted directory never runs code: JSON
and parquet only, extension types refused, every table conformed to the current
schema and the metadata re-validated. A newer *major* schema version is refused
with a clear message; an older one loads (missing nullable columns become nulls).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Optional, Union

import pyarrow as pa
import pyarrow.parquet as pq

from .. import schema as S
from ..errors import ExportError, TraceFormatError
from ..metadata import FORMAT, PARQUET_KEY, PARQUET_VERSION_KEY, TraceMetadata, check_version
from ..metadata import jsonable as _jsonable  # noqa: F401  (the name earlier versions exported)
from . import TraceTables
from .pages import MMAP_ROWS
from .pages import release as release_pages

METADATA_FILE = "metadata.json"
#: rows per parquet row group ``save`` writes (what a writer or a lazy reader holds at once)
ROW_GROUP_ROWS = 65536
#: zstd level of the saved files: level 1 writes in about half the time of the default (3) for files
#: a few percent larger (measured on a small-op trace's ops, calls and tensors)
ZSTD_LEVEL = 1
PathLike = Union[str, "os.PathLike[str]"]
__all__ = ["FORMAT", "METADATA_FILE", "check_version", "check_columns", "read", "read_metadata", "save",
           "kv_metadata", "writer_options"]


def kv_metadata(schema_metadata: Optional[dict[bytes, bytes]], md: TraceMetadata,
                md_json: Optional[bytes] = None) -> dict[bytes, bytes]:
    """A table's key-value metadata with the trace metadata added (``b"tensorscope"``, as JSON;
    ``md_json``: that JSON already encoded, when one trace writes many files)."""
    return {**(schema_metadata or {}), PARQUET_VERSION_KEY: md.schema_version.encode(),
            PARQUET_KEY: md_json if md_json is not None else md.to_json().encode()}


def save(trace: TraceTables, path: PathLike, *, row_group_rows: int = ROW_GROUP_ROWS) -> str:
    """Write ``trace``'s tables and metadata to the directory ``path`` (replaced atomically when it is
    a trace). Returns its absolute path; ``saved_to`` is never written (the directory may move).

    Each table is written ``row_group_rows`` rows at a time from its record batches (memory-mapped
    ones for a big trace): never gathered whole in memory."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path) or "."
    if os.path.exists(path) and not os.path.isdir(path):
        raise ExportError(f"cannot save trace to {path!r}: a file with that name exists (the trace is still in memory)")
    if os.path.isdir(path) and os.listdir(path) and not os.path.exists(os.path.join(path, METADATA_FILE)):
        raise ExportError(f"cannot save trace to {path!r}: the directory exists and is not a tensorscope trace "
                          "(refusing to overwrite it; the trace is still in memory)")
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tensorscope-save-", dir=parent)
    except OSError as e:
        raise ExportError(f"cannot save trace to {path!r}: {e.strerror or e} (the trace is still in memory)") from e
    try:
        tables = {name: trace.table(name) for name in S.TABLES}
        # saved_to is where a Trace in memory was saved or loaded from: not written (the directory may move)
        md = trace.metadata.replace(format=FORMAT, schema_version=S.SCHEMA_VERSION, saved_to=None,
                                    tables={name: t.num_rows for name, t in tables.items()})
        md_json = md.to_json().encode()
        _write_all([(table, os.path.join(tmp, f"{name}.parquet"), kv_metadata(table.schema.metadata, md, md_json))
                    for name, table in tables.items()], row_group_rows)
        release_pages(*tables.values())   # what the writers read of mapped tables (io/pages.py)
        with open(os.path.join(tmp, METADATA_FILE), "w", encoding="utf-8") as f:
            f.write(md.to_json(indent=1))
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"cannot save trace to {path!r}: {e.strerror or e} (the trace is still in memory)") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _write_all(jobs: list[tuple[pa.Table, str, dict[bytes, bytes]]], row_group_rows: int) -> None:
    """Write each (table, file, key-value metadata), the big tables on threads of their own (the parquet
    writer encodes and compresses without the GIL, one column after another: a small-op trace's
    ops, calls and tensors files are written side by side); the first error is raised once all ended."""
    big = sorted((j for j in jobs if j[0].num_rows > row_group_rows), key=lambda j: -j[0].num_rows)
    workers = min(len(big), os.cpu_count() or 1, 4)
    if workers < 2:
        for table, file, kv in jobs:
            _write(table, file, kv, row_group_rows)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tensorscope-save") as pool:
        futures = [pool.submit(_write, table, file, kv, row_group_rows) for table, file, kv in big]
        for table, file, kv in jobs:
            if table.num_rows <= row_group_rows:
                _write(table, file, kv, row_group_rows)
        for f in futures:
            f.result()


def _write(table: pa.Table, file: str, kv: dict[bytes, bytes], row_group_rows: int) -> None:
    """One table to one parquet file, a row group at a time (``row_group_rows`` rows each): the writer
    reads the table's record batches (memory-mapped for a big trace) slice by slice, so what it holds
    is one row group's pages, not the table."""
    schema = table.schema.with_metadata(kv)
    with pq.ParquetWriter(file, schema, **writer_options(schema)) as writer:
        step = max(1, int(row_group_rows))
        if table.num_rows <= step:
            writer.write_table(table.replace_schema_metadata(kv), row_group_size=step)
            return
        for start in range(0, table.num_rows, step):
            # a row group at a time, the pages it read of a mapped table given back (io/pages.py)
            part = table.slice(start, step)
            writer.write_table(part.replace_schema_metadata(kv), row_group_size=step)
            release_pages(part)


def writer_options(schema: pa.Schema) -> dict[str, Any]:
    """How tensorscope writes a table's parquet file (``save`` and the dataset parts): zstd at
    ``ZSTD_LEVEL``; integer columns delta-encoded (``DELTA_BINARY_PACKED``: ids, sequence numbers and
    timestamps that grow row by row, where a dictionary grows to its page limit and is thrown away;
    measured 3-10x smaller and several times faster to write and read than the default); every
    other column dictionary-encoded (a dictionary column keeps its Arrow dictionary, one per file:
    every row group reads back with the same dictionary)."""
    ints = [f.name for f in schema if pa.types.is_integer(f.type)]
    return {"compression": "zstd", "compression_level": ZSTD_LEVEL,
            "use_dictionary": [p for f in schema if not pa.types.is_integer(f.type) for p in _leaf_paths(f.name, f.type)],
            "column_encoding": {name: "DELTA_BINARY_PACKED" for name in ints}}


def _leaf_paths(path: str, typ: pa.DataType) -> list[str]:
    """The parquet column paths under a field (what writer properties are keyed by): ``a`` for a flat
    column, ``a.list.element`` for a list (compliant nested names), ``a.b`` for a struct's child."""
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        return _leaf_paths(f"{path}.list.element", typ.value_type)
    if pa.types.is_struct(typ):
        return [p for i in range(typ.num_fields) for p in _leaf_paths(f"{path}.{typ.field(i).name}", typ.field(i).type)]
    return [path]


def read_metadata(path: PathLike) -> TraceMetadata:
    """The validated ``TraceMetadata`` of a saved trace directory (``TraceFormatError`` naming the
    file when it is missing, not JSON or not tensorscope's; ``SchemaVersionError`` when newer)."""
    path = os.fspath(path)
    mfile = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(mfile):
        raise TraceFormatError(f"{path!r} is not a tensorscope trace directory (no {METADATA_FILE})")
    try:
        with open(mfile, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"{mfile!r} cannot be read: {e}") from e
    return TraceMetadata.from_json(text, where=repr(mfile))


def _read_table(path: str, name: str, mmap_rows: Optional[int] = MMAP_ROWS) -> Optional[pa.Table]:
    file = os.path.join(path, f"{name}.parquet")
    if not os.path.isfile(file):
        if name in S.DERIVED:
            return None
        if name == "ops":
            raise TraceFormatError(f"{path!r}: the ops table ({name}.parquet) is missing")
        return S.empty(name)
    try:
        schema = pq.read_schema(file)
    except Exception as e:
        raise TraceFormatError(f"{file!r} is not a readable parquet file: {e}") from e
    for field in schema:
        if isinstance(field.type, (pa.ExtensionType, pa.BaseExtensionType)):
            raise TraceFormatError(f"{file!r}: column {field.name!r} has an extension type; refusing to load it")
    md = schema.metadata or {}
    v = md.get(PARQUET_VERSION_KEY)
    if v is not None:
        check_version(v.decode("utf-8", "replace"), repr(file))
    kv = md.get(PARQUET_KEY)
    if kv is not None:   # the trace metadata every file carries (files of older versions have none)
        try:
            text = kv.decode("utf-8")
        except UnicodeDecodeError:
            raise TraceFormatError(f"{file!r}: its {PARQUET_KEY!r} key-value metadata is not UTF-8") from None
        TraceMetadata.from_json(text, where=f"{file!r} ({PARQUET_KEY!r} key-value metadata)")
    check_columns(name, schema, file)
    try:
        if mmap_rows is not None and pq.ParquetFile(file).metadata.num_rows > mmap_rows:
            mapped = _read_mapped(file, name)
            if mapped is not None:
                return mapped
        table = pq.read_table(file)
    except (OSError, pa.ArrowException) as e:   # footer intact, a data page damaged
        raise TraceFormatError(f"{file!r}: damaged parquet data, cannot be read ({type(e).__name__}: {e})") from e
    try:
        return S.conform(name, table)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise TraceFormatError(f"{file!r}: does not match the {name} schema: {e}") from e


def _read_mapped(file: str, name: str) -> Optional[pa.Table]:
    """The table of ``file`` conformed row group by row group into an Arrow IPC file and memory-mapped:
    what it holds in memory is one row group, whatever the table's size. The IPC file is unlinked once
    mapped (the mapping keeps its pages; the disk space goes with the table), so nothing is left behind.
    A column null on every row (``_null_columns``: the file's statistics say so, or the file lacks it)
    is neither read nor written: it becomes null chunks sharing one array (a small-op trace's ops have
    ~15 such columns, a quarter of the mapped file). None when the row groups' dictionaries differ (the
    IPC file format keeps one per column: a file another writer made), or where a mapped file cannot
    be unlinked (Windows): read into memory then."""
    schema = S.TABLES[name]
    tmp = tempfile.mkdtemp(prefix="tensorscope-load-")
    ipc = os.path.join(tmp, f"{name}.arrow")
    try:
        pf = pq.ParquetFile(file)
        nulls = _null_columns(pf, schema)
        keep = [f for f in schema if f.name not in nulls]
        if not keep:
            return None
        kept = pa.schema(keep, metadata=schema.metadata)
        found = [f.name for f in keep if f.name in pf.schema_arrow.names]
        with pa.OSFile(ipc, "wb") as sink, pa.ipc.new_file(sink, kept) as writer:
            for i in range(pf.num_row_groups):
                part = pf.read_row_group(i, columns=found)
                try:
                    part = S.conform(name, part).select(kept.names)
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
                    raise TraceFormatError(f"{file!r}: does not match the {name} schema: {e}") from e
                writer.write_table(part)
        with pa.memory_map(ipc) as src:
            table = pa.ipc.open_file(src).read_all()
        os.unlink(ipc)
    except pa.ArrowInvalid as e:
        if "ictionary" not in str(e):
            raise
        return None
    except OSError:
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not nulls:
        return table
    lengths = [len(c) for c in table.column(0).chunks]
    shared: dict[tuple[str, int], pa.Array] = {}   # one all-null array per (type, chunk length)

    def null(typ: pa.DataType, m: int) -> pa.Array:
        key = (str(typ), m)
        if key not in shared:   # (not setdefault: its argument, a new array, would be made for every chunk)
            shared[key] = pa.nulls(m, typ)
        return shared[key]

    cols = [table.column(f.name) if f.name not in nulls else pa.chunked_array([null(f.type, m) for m in lengths], f.type)
            for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)


def _null_columns(pf: pq.ParquetFile, schema: pa.Schema) -> set[str]:
    """The top-level columns of ``schema`` null on every row of ``pf``: missing from the file (an older
    minor version), or a flat column whose statistics count as many nulls as rows in every row group
    (a list or struct column is read: its leaf statistics do not say whether the rows are null)."""
    names = set(pf.schema_arrow.names)
    out = {f.name for f in schema if f.name not in names}
    md = pf.metadata
    if md.num_rows == 0:
        return out
    leaf = {md.schema.column(j).path: j for j in range(md.num_columns)}
    for f in schema:
        j = leaf.get(f.name)   # a flat column's leaf path is its name
        if f.name in out or j is None:
            continue
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            st = rg.column(j).statistics
            if st is None or not st.has_null_count or st.null_count != rg.num_rows:
                break
        else:
            out.add(f.name)
    return out


def _string_like(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def _compatible(found: pa.DataType, want: pa.DataType) -> bool:
    """Can a column of type ``found`` be read as ``want`` without changing what its values mean?
    Equal types, an all-null column, signed-integer widening, string/dictionary-of-string, and
    lists of compatible values; never a reinterpretation (a string column parsed as numbers)."""
    if found.equals(want) or pa.types.is_null(found):
        return True
    if _string_like(want):
        return _string_like(found)
    if pa.types.is_signed_integer(want):
        return bool(pa.types.is_signed_integer(found) and found.bit_width <= want.bit_width)
    if pa.types.is_floating(want):
        return bool(pa.types.is_floating(found) and found.bit_width <= want.bit_width)
    if pa.types.is_list(want) or pa.types.is_large_list(want):
        return bool(pa.types.is_list(found) or pa.types.is_large_list(found)) and _compatible(found.value_type,
                                                                                              want.value_type)
    return False


def check_columns(name: str, schema: pa.Schema, file: str) -> None:
    """Refuse, naming the columns, a file that is not the ``name`` table: a required column missing
    or a column whose type is not the table's (it would load as a half-null or misread trace)."""
    want = S.TABLES[name]
    missing = [c for c in S.REQUIRED.get(name, ()) if c not in schema.names]
    wrong = []
    for field in schema:
        i = want.get_field_index(field.name)
        if i >= 0 and not _compatible(field.type, want.field(i).type):
            wrong.append(f"{field.name} ({field.type}, expected {S.plain_type(want.field(i).type)})")
    problems = []
    if missing:
        problems.append("missing required column(s) " + ", ".join(missing))
    if wrong:
        problems.append("wrong column type(s): " + "; ".join(wrong))
    if problems:
        raise TraceFormatError(f"{file!r} is not a tensorscope {name} table: " + "; ".join(problems))


def read(path: PathLike, *, mmap_rows: Optional[int] = MMAP_ROWS) -> tuple[dict[str, pa.Table], TraceMetadata]:
    """The tables and metadata of a trace directory written by ``save`` (every table validated and
    conformed; ``saved_to`` set to ``path``). ``tensorscope.load`` builds the Trace from them.

    A table of more than ``mmap_rows`` rows (None: never) is conformed a row group at a time into a
    memory-mapped Arrow file instead of memory (``_read_mapped``): the same table, equal to the one
    read into memory, at the memory cost of one row group."""
    path = os.path.abspath(os.fspath(path))
    md = read_metadata(path)
    tables = {name: _read_table(path, name, mmap_rows) for name in S.TABLES}
    return {k: v for k, v in tables.items() if v is not None}, md.replace(saved_to=path)
