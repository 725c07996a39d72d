"""The one place that defines every table tensorscope writes, and its version.

One package, imported as ``tensorscope.schema`` (``from .. import schema as S``): ``tables`` holds the
tables a Trace carries, ``views`` the tables analyses return, ``dataset`` a multi-rank dataset's
columns, ``arrays`` the Arrow helpers builders and readers share; every name is re-exported here.

Each table is a fixed ``pyarrow.Schema``. Readers check ``SCHEMA_VERSION``: a
file whose *major* version is newer than ours is refused (we cannot know what
its columns mean); an older or equal major loads, missing nullable columns are
filled with nulls. Evolve a table only by adding nullable columns (minor bump).

Rules kept so every engine reads the files (DuckDB, pyarrow, polars, Spark):
signed int64 for counts/ids, times as int64 nanoseconds, plain
``list<list<int64>>`` for shapes and strides, no float16, snake_case names.

Since 1.2 the repetitive string columns of the large tables (ops, calls,
tensors) are dictionary-encoded, ``dictionary<int32, string>`` (``_dstr``,
and ``list<dictionary<...>>`` for per-tensor lists): the builder makes them
from interned ids without a per-row string. In parquet they are ordinary
dictionary-encoded UTF-8 columns, so every engine reads them as strings
(pyarrow restores the dictionary type, pandas shows it as ``category``).
Files of 1.1 and earlier hold plain strings; ``conform`` casts them.
Since 1.3 ``tensors.category`` says what each storage is (``MEMORY_CATEGORIES``).
Since 1.4 ``tensors.address`` is each storage's data pointer, and the CUDA caching allocator's
view is recorded beside ours: ``allocator`` (its counters at the trace's start and end, always
on CUDA) and, with ``memory_history=True``, its snapshot: ``allocator_segments``,
``allocator_blocks`` and ``allocator_events``, joined to ``tensors`` by address and time.

Since 1.5 ``ops.first_run`` marks the first execution in the process of each (op, input shapes,
dtypes, devices) that a trace saw (one-time initialisation lands there), and ``ops.probe_ns``
the time tensorscope's own work took after an op until the next op started (the python engine's
bookkeeping, non-finite screen, numerics shadow and op hooks; files written before this release hold
the probes' part only), which time outside ops leaves out; both null in older files.
"""
from __future__ import annotations

from ._base import SCHEMA_MAJOR, SCHEMA_VERSION, parse_version
from .arrays import conform, dense_array, empty, nullable_array, plain_strings, plain_type, unify_dictionaries
from .dataset import DATASET_KEYS, RANKS, dataset_schema
from .tables import (
    ALLOCATOR,
    ALLOCATOR_BLOCKS,
    ALLOCATOR_EVENTS,
    ALLOCATOR_SEGMENTS,
    API,
    CALLS,
    CAPTURES,
    CASTS,
    COLLECTIVES,
    DERIVED,
    ERRORS,
    GRAPH_NODES,
    GRAPHS,
    KERNELS,
    LAYOUT_CHANGES,
    LEAKS,
    MEMORY,
    MEMORY_CATEGORIES,
    OPS,
    RECORDED,
    REQUIRED,
    TABLES,
    TENSORS,
)
from .views import (
    ADVICE,
    ALLOCATOR_TIMELINE,
    DIFF,
    DIVERGE_PAIRS,
    DIVERGE_STRUCTURE,
    MEMORY_AT,
    MEMORY_TIMELINE,
    MODULE_MEMORY,
    ROOFLINE,
    SUBSTITUTION,
    SYNCS,
)

__all__ = [
    "SCHEMA_VERSION", "SCHEMA_MAJOR", "parse_version",
    "OPS", "CALLS", "TENSORS", "ERRORS", "KERNELS", "LEAKS", "CASTS", "LAYOUT_CHANGES", "MEMORY", "GRAPHS",
    "GRAPH_NODES", "API", "COLLECTIVES", "ALLOCATOR", "ALLOCATOR_SEGMENTS", "ALLOCATOR_BLOCKS", "ALLOCATOR_EVENTS", "CAPTURES",
    "TABLES", "REQUIRED", "RECORDED", "DERIVED", "MEMORY_CATEGORIES",
    "SUBSTITUTION", "DIFF", "MEMORY_TIMELINE", "ALLOCATOR_TIMELINE", "MEMORY_AT", "MODULE_MEMORY", "SYNCS",
    "ROOFLINE", "ADVICE", "DIVERGE_PAIRS", "DIVERGE_STRUCTURE",
    "DATASET_KEYS", "RANKS", "dataset_schema",
    "nullable_array", "dense_array", "empty", "conform", "unify_dictionaries", "plain_type", "plain_strings",
]
