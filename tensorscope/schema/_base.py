"""The building blocks of the schemas: the version, the Arrow types the tables use, ``_schema``."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa

#: "major.minor". Bump major when a column changes meaning or type.
SCHEMA_VERSION = "1.5"
SCHEMA_MAJOR = int(SCHEMA_VERSION.split(".")[0])

_i64 = pa.int64()
_i32 = pa.int32()
_str = pa.string()
_bool = pa.bool_()
_f64 = pa.float64()
_u64 = pa.uint64()
_bin = pa.binary()
_strs = pa.list_(pa.string())
_bools = pa.list_(pa.bool_())
_i64s = pa.list_(pa.int64())
_i32s = pa.list_(pa.int32())
_shapes = pa.list_(pa.list_(pa.int64()))
#: dictionary-encoded strings (1.2): ids into one small dictionary per column and batch
_dstr = pa.dictionary(pa.int32(), pa.string())
_dstrs = pa.list_(_dstr)


def _schema(name: str, fields: Iterable[tuple[str, Any]]) -> pa.Schema:
    return pa.schema([pa.field(n, t, nullable=True) for n, t in fields], metadata={b"tensorscope_table": name.encode()})


def parse_version(v: str) -> tuple[int, int]:
    major, _, minor = str(v).partition(".")
    return int(major), int(minor or 0)
