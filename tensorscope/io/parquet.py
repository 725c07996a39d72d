"""Save a Trace to a directory of parquet files and load it back — no pickle anywhere.

Layout: ``<dir>/<table>.parquet`` (zstd) for every table and ``<dir>/metadata.json``
(schema version, versions, device, options, cell source). Loading an untrusted
directory never runs code: JSON and parquet only, extension types refused, every
table conformed to the current schema. A newer *major* schema version is refused
with a clear message; an older one loads (missing nullable columns become nulls).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Dict

import pyarrow as pa
import pyarrow.parquet as pq

from .. import schema as S
from ..errors import ExportError, SchemaVersionError, TraceFormatError

METADATA_FILE = "metadata.json"
FORMAT = "tensorscope-trace"


def _jsonable(o):
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, (str, int, float, bool)) or o is None:
        return o
    return str(o)


def save(trace, path) -> str:
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
        for name in S.TABLES:
            table = trace.table(name)
            table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                                   b"tensorscope_schema_version": S.SCHEMA_VERSION.encode()})
            pq.write_table(table, os.path.join(tmp, f"{name}.parquet"), compression="zstd")
        md = dict(trace.metadata)
        md["format"] = FORMAT
        md["schema_version"] = S.SCHEMA_VERSION
        md["tables"] = {name: trace.table(name).num_rows for name in S.TABLES}
        with open(os.path.join(tmp, METADATA_FILE), "w", encoding="utf-8") as f:
            json.dump(_jsonable(md), f, indent=1)
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


def read_metadata(path) -> Dict[str, Any]:
    path = os.fspath(path)
    mfile = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(mfile):
        raise TraceFormatError(f"{path!r} is not a tensorscope trace directory (no {METADATA_FILE})")
    try:
        with open(mfile, encoding="utf-8") as f:
            md = json.load(f)
    except (OSError, ValueError) as e:
        raise TraceFormatError(f"{mfile!r} is not valid JSON: {e}") from e
    if not isinstance(md, dict) or md.get("format") != FORMAT:
        raise TraceFormatError(f"{mfile!r} is not tensorscope trace metadata")
    return md


def check_version(version: str, where: str):
    try:
        major, minor = S.parse_version(version)
    except (TypeError, ValueError) as e:
        raise TraceFormatError(f"{where}: unreadable schema version {version!r}") from e
    if major > S.SCHEMA_MAJOR:
        raise SchemaVersionError(
            f"{where} was written with tensorscope schema version {version}, newer than this tensorscope "
            f"understands (schema {S.SCHEMA_VERSION}); upgrade tensorscope to read it")


def _read_table(path: str, name: str) -> pa.Table:
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
        if isinstance(field.type, pa.ExtensionType) or isinstance(field.type, pa.BaseExtensionType):
            raise TraceFormatError(f"{file!r}: column {field.name!r} has an extension type; refusing to load it")
    md = schema.metadata or {}
    v = md.get(b"tensorscope_schema_version")
    if v is not None:
        check_version(v.decode(), file)
    check_columns(name, schema, file)
    try:
        table = pq.read_table(file)
    except (OSError, pa.ArrowException) as e:   # footer intact, a data page damaged
        raise TraceFormatError(f"{file!r}: damaged parquet data, cannot be read ({type(e).__name__}: {e})") from e
    try:
        return S.conform(name, table)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise TraceFormatError(f"{file!r}: does not match the {name} schema: {e}") from e


def _string_like(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _compatible(found: pa.DataType, want: pa.DataType) -> bool:
    """Can a column of type ``found`` be read as ``want`` without changing what its values mean?
    Equal types, an all-null column, signed-integer widening, string/dictionary-of-string, and
    lists of compatible values; never a reinterpretation (a string column parsed as numbers)."""
    if found.equals(want) or pa.types.is_null(found):
        return True
    if _string_like(want):
        return _string_like(found)
    if pa.types.is_signed_integer(want):
        return pa.types.is_signed_integer(found) and found.bit_width <= want.bit_width
    if pa.types.is_floating(want):
        return pa.types.is_floating(found) and found.bit_width <= want.bit_width
    if pa.types.is_list(want) or pa.types.is_large_list(want):
        return (pa.types.is_list(found) or pa.types.is_large_list(found)) and _compatible(found.value_type,
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


def load(path):
    """Load a trace directory written by ``Trace.save``."""
    from .._trace import Trace

    path = os.fspath(path)
    md = read_metadata(path)
    check_version(md.get("schema_version", "0.0"), path)
    tables = {name: _read_table(path, name) for name in S.TABLES}
    return Trace({k: v for k, v in tables.items() if v is not None}, md)
