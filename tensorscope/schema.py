"""The one place that defines every table tensorscope writes, and its version.

Each table is a fixed ``pyarrow.Schema``. Readers check ``SCHEMA_VERSION``: a
file whose *major* version is newer than ours is refused (we cannot know what
its columns mean); an older or equal major loads, missing nullable columns are
filled with nulls. Evolve a table only by adding nullable columns (minor bump).

Rules kept so every engine reads the files (DuckDB, pyarrow, polars, Spark):
signed int64 for counts/ids, times as int64 nanoseconds, plain
``list<list<int64>>`` for shapes and strides, no float16, snake_case names.
"""
from __future__ import annotations

from typing import Dict

import pyarrow as pa

#: "major.minor". Bump major when a column changes meaning or type.
SCHEMA_VERSION = "1.1"
SCHEMA_MAJOR = int(SCHEMA_VERSION.split(".")[0])

_i64 = pa.int64()
_i32 = pa.int32()
_str = pa.string()
_bool = pa.bool_()
_f64 = pa.float64()
_strs = pa.list_(pa.string())
_bools = pa.list_(pa.bool_())
_i64s = pa.list_(pa.int64())
_i32s = pa.list_(pa.int32())
_shapes = pa.list_(pa.list_(pa.int64()))


def _schema(name: str, fields) -> pa.Schema:
    return pa.schema([pa.field(n, t, nullable=True) for n, t in fields], metadata={b"tensorscope_table": name.encode()})


OPS = _schema("ops", [
    ("seq", _i64),                  # 0-based dispatch order within the trace
    ("cell", _i64),                 # IPython execution count, null outside a notebook
    ("op", _str),                   # str(OpOverload): aten.add.Tensor
    ("namespace", _str),
    ("overload", _str),
    ("tags", _strs),
    ("phase", _str),                # forward / backward
    ("autograd_node", _str),        # backward: node.name(); forward: null
    ("seq_nr", _i64),               # forward: autograd sequence nr of the node it created; backward: node's
    ("fwd_seq", _i64),              # backward: seq of the forward op that created the node
    ("call_id", _i64),              # innermost enclosing torch-level call (calls.call_id)
    ("module", _str),               # qualified module path (named_modules() of the root)
    ("source_file", _str),
    ("source_line", _i64),
    ("in_shapes", _shapes),
    ("in_strides", _shapes),
    ("in_dtypes", _strs),
    ("in_devices", _strs),
    ("in_formats", _strs),
    ("in_ambiguous", _bools),       # format label ambiguous because of size-1 dims
    ("in_storages", _i64s),         # tensors.storage_id per input tensor (-1 unknown)
    ("out_shapes", _shapes),
    ("out_strides", _shapes),
    ("out_dtypes", _strs),
    ("out_devices", _strs),
    ("out_formats", _strs),
    ("out_ambiguous", _bools),
    ("out_storages", _i64s),
    ("out_alias", _i32s),           # index of the tensor input each output aliases, -1 fresh
    ("is_view", _bool),
    ("inplace", _bool),
    ("hidden_copy", _bool),         # a copy under a torch-level call expected to be a view
    ("is_noise", _bool),            # detach / lift_fresh / alias bookkeeping summaries hide
    ("flops", _i64),
    ("bytes_read", _i64),
    ("bytes_written", _i64),
    ("start_ns", _i64),             # perf_counter_ns relative to the trace start
    ("cpu_ns", _i64),
    ("cuda_ns", _i64),
    ("error_id", _i64),
    ("nonfinite", _i64),            # non-finite values in the outputs (null: not screened)
    ("nonfinite_produced", _bool),  # true when inputs were finite (produced, not propagated)
    ("num_rel_err", _f64),          # numerics shadow mode: relative error vs the wide reference
    ("num_max_abs_err", _f64),
])

CALLS = _schema("calls", [
    ("call_id", _i64),
    ("parent_id", _i64),
    ("depth", _i64),
    ("cell", _i64),
    ("name", _str),                 # linear, reshape, backward ...
    ("qualname", _str),             # torch.nn.functional.linear, Tensor.reshape
    ("module", _str),
    ("source_file", _str),
    ("source_line", _i64),
    ("start_ns", _i64),
    ("dur_ns", _i64),
    ("first_seq", _i64),            # first ops.seq inside the call (null if none dispatched)
    ("n_ops", _i64),
    ("autocast", _str),             # autocast dtype active for the call's device, or null
    ("compiled", _bool),            # reserved: null until compiled regions are attributed per call
    ("error_id", _i64),
])

TENSORS = _schema("tensors", [
    ("storage_id", _i64),
    ("nbytes", _i64),
    ("device", _str),
    ("dtype", _str),
    ("shape", _i64s),
    ("alloc_seq", _i64),            # seq of the op whose output first showed it (null: found at a boundary)
    ("alloc_op", _str),
    ("free_seq", _i64),             # last op started before it was freed (freed by or after it); null if alive at the end
    ("cell", _i64),
    ("module", _str),
    ("source_file", _str),
    ("source_line", _i64),
])

LEAKS = _schema("leaks", [
    ("storage_id", _i64),
    ("nbytes", _i64),
    ("device", _str),
    ("dtype", _str),
    ("shape", _i64s),
    ("alloc_seq", _i64),
    ("alloc_op", _str),
    ("cell", _i64),
    ("source_file", _str),
    ("source_line", _i64),
    ("holder", _str),
    ("holder_kind", _str),
    ("fix", _str),
])

ERRORS = _schema("errors", [
    ("error_id", _i64),
    ("kind", _str),                 # exception / warning / tracer
    ("py_type", _str),
    ("cpp_type", _str),
    ("message", _str),
    ("cpp_file", _str),
    ("cpp_line", _i64),
    ("cpp_function", _str),
    ("seq", _i64),
    ("call_id", _i64),
    ("op", _str),
    ("source_file", _str),
    ("source_line", _i64),
    ("native", _bool),
    ("count", _i64),                # identical warnings at one op are folded
])

KERNELS = _schema("kernels", [
    ("seq", _i64),                  # launching op (ops.seq), null when unlinked
    ("name", _str),
    ("device", _i64),
    ("stream", _i64),
    ("start_ns", _i64),
    ("dur_ns", _i64),
    ("grid", _i64s),
    ("block", _i64s),
    ("correlation_id", _i64),
])

CASTS = _schema("casts", [
    ("seq", _i64),
    ("op", _str),
    ("call", _str),
    ("from_dtype", _str),
    ("to_dtype", _str),
    ("kind", _str),                 # explicit / promotion / implicit_downcast / autocast / copy
    ("direction", _str),            # down / up / int_narrowing / float_to_int / int_to_float / same_width
    ("numel", _i64),
    ("bytes", _i64),
    ("nonfinite_produced", _bool),
    ("round_trip", _bool),          # part of an a->b->a pair on the same data
    ("module", _str),
    ("source_file", _str),
    ("source_line", _i64),
])

LAYOUT_CHANGES = _schema("layout_changes", [
    ("seq", _i64),
    ("op", _str),
    ("call", _str),
    ("from_format", _str),
    ("to_format", _str),
    ("kind", _str),                 # format_change / hidden_copy / non_dense_input
    ("reason", _str),
    ("bytes", _i64),
    ("module", _str),
    ("source_file", _str),
    ("source_line", _i64),
])

MEMORY = _schema("memory", [
    ("seq", _i64),
    ("device", _str),
    ("live_bytes", _i64),
    ("delta_bytes", _i64),
])

COLLECTIVES = _schema("collectives", [
    ("seq", _i64),                  # the c10d / _c10d_functional op's row in ops
    ("op", _str),                   # c10d.allreduce_.default, _c10d_functional.all_reduce.default ...
    ("pg_name", _str),              # process group name ("0" is the default group)
    ("pg_size", _i64),              # ranks in the group
    ("reduce_op", _str),            # SUM, MAX, AVG ... (null: not a reduction)
    ("nbytes", _i64),               # bytes of the input tensors this rank contributes
    ("start_ns", _i64),             # op call start, perf_counter_ns relative to the trace start
    ("enqueue_ns", _i64),           # how long the op call took (enqueue, not completion)
    ("done_ns", _i64),              # completion (Work future) relative to the trace start; null: unknown
    ("coll_index", _i64),           # k-th collective on this process group in the trace (matches across ranks)
])

#: Every table a Trace carries, in display order. ``memory`` is derived.
TABLES: Dict[str, pa.Schema] = {
    "ops": OPS,
    "calls": CALLS,
    "tensors": TENSORS,
    "errors": ERRORS,
    "kernels": KERNELS,
    "leaks": LEAKS,
    "casts": CASTS,
    "layout_changes": LAYOUT_CHANGES,
    "memory": MEMORY,
    "collectives": COLLECTIVES,
}

#: Tables recorded directly; the rest are derived by analyses from these.
RECORDED = ("ops", "calls", "tensors", "errors", "kernels", "leaks", "collectives")
DERIVED = ("casts", "layout_changes", "memory")


# -- multi-rank datasets (tensorscope.io.dataset) --------------------------------------
# A dataset directory holds ``<table>/run=<run_id>/rank=<rank>/part-a<attempt>-<n>.parquet``.
# ``run`` and ``rank`` are hive partition keys, never columns inside the files. Every table
# of a Trace is written with its schema above plus these columns, which tell apart the
# traces one rank wrote (a notebook run writes one per cell) and elastic restarts:
DATASET_KEYS = [
    ("attempt", _i64),              # TORCHELASTIC_RESTART_COUNT (0 without torchelastic)
    ("trace_id", _i64),             # the trace within (run, rank, attempt): 0, 1, ... (= the ranks part number)
]

#: One row per trace a rank wrote (in ``<dataset>/ranks/run=…/rank=…/``).
RANKS = _schema("ranks", [
    ("attempt", _i64),
    ("trace_id", _i64),
    ("local_rank", _i64),
    ("world_size", _i64),
    ("rank_source", _str),          # where rank/world size came from: dist, torchrun, slurm, ompi, default
    ("run_source", _str),           # where the run id came from: env, torchelastic, store, slurm, local
    ("host", _str),
    ("pid", _i64),
    ("device", _str),               # cpu, cuda:0 ... (the rank's current device)
    ("backend", _str),              # torch.distributed backend when initialised (gloo, nccl), else null
    ("clock_synced", _bool),        # true when clock_offset_ns was measured by ping-pong with rank 0
    ("clock_offset_ns", _i64),      # add to this rank's unix times to get rank 0's clock (0 unsynced)
    ("clock_error_ns", _i64),       # bound on clock_offset_ns's error (half the best round trip); null unsynced
    ("clock_offset_end_ns", _i64),  # the offset measured again at the end of the trace (drift); null if not
    ("anchor_unix_ns", _i64),       # time.time_ns() at the trace start (start_ns == 0)
    ("anchor_perf_ns", _i64),       # time.perf_counter_ns() at the same instant
    ("start_unix_ns", _i64),        # trace start on rank 0's clock: anchor_unix_ns + clock_offset_ns
    ("end_unix_ns", _i64),          # trace end on rank 0's clock
    ("wall_ns", _i64),
    ("n_ops", _i64),
    ("n_collectives", _i64),
    ("cell", _i64),                 # notebook cell number (headless notebook runs), else null
    ("cell_source", _str),
    ("tensorscope_version", _str),
    ("torch_version", _str),
    ("python_version", _str),
    ("schema_version", _str),
    ("metadata_json", _str),        # the trace's full metadata (options, device report, notes) as JSON
])


def dataset_schema(name: str) -> pa.Schema:
    """The schema of table ``name`` inside a dataset: its Trace schema plus ``DATASET_KEYS``."""
    if name == "ranks":
        return RANKS
    base = TABLES[name]
    return pa.schema(list(base) + [pa.field(n, t, nullable=True) for n, t in DATASET_KEYS], metadata=base.metadata)


def empty(name: str) -> pa.Table:
    """An empty table with the right schema: honest, never a placeholder row."""
    return TABLES[name].empty_table()


def conform(name: str, table: pa.Table) -> pa.Table:
    """Cast/complete ``table`` to the current schema of ``name``.

    Columns missing from an older minor version are filled with nulls; extra
    columns (from a newer minor) are dropped; order follows the schema.
    """
    schema = TABLES[name]
    cols = []
    n = table.num_rows
    for field in schema:
        if field.name in table.column_names:
            col = table.column(field.name)
            if col.type != field.type:
                col = col.cast(field.type)
            cols.append(col)
        else:
            cols.append(pa.nulls(n, field.type))
    return pa.Table.from_arrays(cols, schema=schema)


def parse_version(v: str):
    major, _, minor = str(v).partition(".")
    return int(major), int(minor or 0)
