"""The one place that defines every table tensorscope writes, and its version.

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
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Tuple

import numpy as np
import pyarrow as pa

#: "major.minor". Bump major when a column changes meaning or type.
SCHEMA_VERSION = "1.4"
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
#: dictionary-encoded strings (1.2): ids into one small dictionary per column and batch
_dstr = pa.dictionary(pa.int32(), pa.string())
_dstrs = pa.list_(_dstr)


def _schema(name: str, fields: Iterable[Tuple[str, Any]]) -> pa.Schema:
    return pa.schema([pa.field(n, t, nullable=True) for n, t in fields], metadata={b"tensorscope_table": name.encode()})


OPS = _schema("ops", [
    ("seq", _i64),                  # 0-based dispatch order within the trace
    ("cell", _i64),                 # IPython execution count, null outside a notebook
    ("op", _dstr),                  # str(OpOverload): aten.add.Tensor
    ("namespace", _dstr),
    ("overload", _dstr),
    ("tags", _dstrs),
    ("phase", _dstr),               # forward / backward
    ("autograd_node", _dstr),       # backward: node.name(); forward: null
    ("seq_nr", _i64),               # forward: autograd sequence nr of the node it created; backward: node's
    ("fwd_seq", _i64),              # backward: seq of the forward op that created the node
    ("call_id", _i64),              # innermost enclosing torch-level call (calls.call_id)
    ("module", _dstr),              # qualified module path (named_modules() of the root)
    ("source_file", _dstr),
    ("source_line", _i64),
    ("in_shapes", _shapes),
    ("in_strides", _shapes),
    ("in_dtypes", _dstrs),
    ("in_devices", _dstrs),
    ("in_formats", _dstrs),
    ("in_ambiguous", _bools),       # format label ambiguous because of size-1 dims
    ("in_storages", _i64s),         # tensors.storage_id per input tensor (-1 unknown)
    ("out_shapes", _shapes),
    ("out_strides", _shapes),
    ("out_dtypes", _dstrs),
    ("out_devices", _dstrs),
    ("out_formats", _dstrs),
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
    ("graph_id", _i64),             # compiled region (graphs.graph_id, kind inductor) that ran this op, or null
])

CALLS = _schema("calls", [
    ("call_id", _i64),
    ("parent_id", _i64),
    ("depth", _i64),
    ("cell", _i64),
    ("name", _dstr),                # linear, reshape, backward ...
    ("qualname", _dstr),            # torch.nn.functional.linear, Tensor.reshape
    ("module", _dstr),
    ("source_file", _dstr),
    ("source_line", _i64),
    ("start_ns", _i64),
    ("dur_ns", _i64),
    ("first_seq", _i64),            # first ops.seq inside the call (null if none dispatched)
    ("n_ops", _i64),
    ("autocast", _dstr),            # autocast dtype active for the call's device, or null
    ("compiled", _bool),            # true when the call ran inside a torch.compile'd region (see graph_id)
    ("error_id", _i64),
    ("graph_id", _i64),             # compiled region (graphs.graph_id) the call ran in, or null
])

TENSORS = _schema("tensors", [
    ("storage_id", _i64),
    ("nbytes", _i64),
    ("device", _dstr),
    ("dtype", _dstr),
    ("shape", _i64s),
    ("alloc_seq", _i64),            # seq of the op whose output first showed it (null: found at a boundary)
    ("alloc_op", _dstr),
    ("free_seq", _i64),             # last op started before it was freed (freed by or after it); null if alive at the end
    ("cell", _i64),
    ("module", _dstr),
    ("source_file", _dstr),
    ("source_line", _i64),
    ("category", _dstr),            # 1.3: what the memory is (MEMORY_CATEGORIES); null in older files
    ("address", _i64),              # 1.4: the storage's data pointer (joins allocator_blocks/events); null in older files
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
    ("expected", _bool),            # model/optimizer state (holder_kind model_state/optimizer_state), not a leak
    ("growing", _bool),             # the holder kept more bytes cell after cell (or step after step)
    ("growth_bytes_per_cell", _i64),  # bytes the holder gained per cell (per step within one cell); null if not growing
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

API = _schema("api", [            # derived: per torch-level API, the ATen ops it became
    ("qualname", _str),             # torch.nn.functional.linear, Tensor.reshape
    ("name", _str),
    ("n_calls", _i64),              # calls of the API in the trace
    ("no_op_calls", _i64),          # of them, calls that dispatched no ATen op at all
    ("op", _str),                   # an ATen op it dispatched (null: none of its calls dispatched any)
    ("n_ops", _i64),                # how many times
    ("ops_per_call", _f64),
    ("cpu_ns", _i64),
    ("core", _bool),                # op is core ATen (torch.Tag.core)
    ("hidden_copies", _i64),        # rows of this op flagged hidden_copy
])

GRAPHS = _schema("graphs", [      # what torch.compile built while tracing (structured-trace artifacts)
    ("graph_id", _i64),
    ("kind", _str),                 # dynamo / aot_forward / aot_backward / inductor
    ("compile_id", _str),           # Dynamo's "frame/attempt" id: "0/1" is frame 0's 2nd compile (a recompile)
    ("phase", _str),                # aot/inductor: forward / backward / inference; dynamo: null
    ("frame", _str),                # compiled function's name
    ("source_file", _str),
    ("source_line", _i64),          # first line of the compiled function
    ("compile_ns", _i64),           # dynamo: whole frame; aot_forward: backend; inductor: inductor (per phase)
    ("n_nodes", _i64),              # FX nodes incl. inputs and output (dynamo/aot)
    ("n_ops", _i64),                # call nodes (ATen ops for aot graphs)
    ("n_kernels", _i64),            # inductor: kernels the generated call() launches
    ("kernels", _strs),             # inductor: fused kernel names, extern_kernels.*, ATen fallbacks
    ("guards", _strs),              # dynamo: leaf guards of the guard tree
    ("recompile_reason", _str),     # dynamo: the guard that failed and forced this compile
    ("cache", _str),                # fx_graph_cache_hit / aotautograd_cache_miss ...
    ("code_file", _str),            # inductor: the generated module that runs
    ("compiled_in_trace", _bool),   # false: compiled in an earlier trace of this process, only run here
])

GRAPH_NODES = _schema("graph_nodes", [
    ("graph_id", _i64),
    ("idx", _i64),
    ("name", _str),
    ("op", _str),                   # aten.addmm.default / torch._C._nn.linear / Tensor.sum / input / output
    ("shapes", _shapes),            # per tensor output; -1 for a symbolic (dynamic) size
    ("strides", _shapes),
    ("dtypes", _strs),
    ("source_file", _str),          # user line the node came from
    ("source_line", _i64),
])

MEMORY = _schema("memory", [
    ("seq", _i64),
    ("device", _str),
    ("live_bytes", _i64),
    ("delta_bytes", _i64),
])

#: Not a trace table: the rows of ``check_substitution(...).table`` (one per divergence).
SUBSTITUTION = _schema("substitution", [
    ("kind", _str),                 # op_appeared / op_disappeared / shape / dtype / layout / input_layout /
                                    # input_dtype / aliasing / inplace / lost_subclass / value / grad / exception /
                                    # output_type / output_structure
    ("phase", _str),                # forward / backward (op divergences)
    ("op", _str),                   # the ATen op, or output[i] for output divergences
    ("call", _str),                 # the torch-level call around the op
    ("plain", _str),                # what plain tensors did
    ("wrapped", _str),              # what the subclass did
    ("source_file", _str),          # the user line
    ("source_line", _i64),
    ("plain_seq", _i64),            # ops.seq in report.plain
    ("wrapped_seq", _i64),          # ops.seq in report.wrapped
    ("detail", _str),
])

#: Not a trace table: ``tensorscope.diff(a, b).table``, one row per (section, key) of either run.
DIFF = _schema("diff", [
    ("section", _str),              # ops / hidden_copies / casts / layout
    ("status", _str),               # appeared / disappeared / changed (count or bytes) / slower / faster / same
    ("module", _str),
    ("phase", _str),
    ("op", _str),
    ("detail", _str),               # casts: "<kind> from → to"; layout: "<kind> from → to"
    ("count_a", _i64),
    ("count_b", _i64),
    ("delta_count", _i64),
    ("cpu_ns_a", _i64),
    ("cpu_ns_b", _i64),
    ("delta_cpu_ns", _i64),
    ("bytes_a", _i64),              # ops: bytes written; casts/layout: bytes converted
    ("bytes_b", _i64),
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

# -- the CUDA caching allocator's view (1.4; recording/allocator.py, analyses/allocator.py) -----
#: One row per CUDA device the trace touched: ``torch.cuda.memory_stats`` read at the trace's start
#: and end (nothing reset: the allocator's peaks are since the program's last reset_peak_memory_stats).
ALLOCATOR = _schema("allocator", [
    ("device", _str),               # cuda:0 ...
    ("source", _str),               # stats (counters only) / history (memory_history=True: the snapshot too)
    ("allocated_start", _i64),      # allocated_bytes.all.current at the start (blocks handed out, rounded sizes)
    ("allocated_end", _i64),
    ("allocated_peak", _i64),       # allocated_bytes.all.peak at the end: since the program's last reset
    ("reserved_start", _i64),       # reserved_bytes.all.current: segments cudaMalloc'd by the cache
    ("reserved_end", _i64),
    ("reserved_peak", _i64),
    ("peak_in_trace", _bool),       # the allocated peak rose during the trace: allocated_peak is the trace's own
    ("inactive_split_bytes", _i64),  # at the end: cached, unusable pieces of split blocks
    ("fragmentation_bytes", _i64),  # reserved - allocated at our peak (history) or at the end (stats)
    ("fragmentation_seq", _i64),    # the op (ops.seq) after which it was measured: our peak; null: the end
    ("num_alloc_retries", _i64),    # cudaMalloc failures that flushed the cache and retried, during the trace
    ("num_ooms", _i64),             # out-of-memory errors the allocator raised during the trace
])

#: One row per segment of the snapshot taken at the trace's end (``memory_history=True``).
ALLOCATOR_SEGMENTS = _schema("allocator_segments", [
    ("device", _str),
    ("address", _i64),
    ("total_size", _i64),           # what cudaMalloc returned
    ("allocated_size", _i64),       # in blocks in use
    ("active_size", _i64),          # in use or awaiting free on another stream
    ("requested_size", _i64),
    ("stream", _i64),
    ("segment_type", _str),         # large / small
    ("is_expandable", _bool),
    ("n_blocks", _i64),
])

#: One row per block of those segments, with the storage of ours at its address.
ALLOCATOR_BLOCKS = _schema("allocator_blocks", [
    ("device", _str),
    ("segment_address", _i64),
    ("address", _i64),
    ("size", _i64),
    ("requested_size", _i64),
    ("state", _str),                # active_allocated / active_pending_free / inactive
    ("storage_id", _i64),           # tensors.storage_id alive at the end at this address, or null
    ("category", _str),             # its tensors.category
])

#: One row per allocator event of the trace (``memory_history=True``), with the storage it was for.
ALLOCATOR_EVENTS = _schema("allocator_events", [
    ("device", _str),
    ("action", _str),               # alloc / free_requested / free_completed / segment_alloc / segment_free /
                                    # segment_map / segment_unmap / oom / snapshot
    ("address", _i64),              # null for oom
    ("size", _i64),                 # bytes requested (oom: what failed)
    ("stream", _i64),
    ("time_us", _i64),              # the allocator's clock: unix time in microseconds
    ("start_ns", _i64),             # the same, relative to the trace start (ops.start_ns's clock)
    ("seq", _i64),                  # the last op started before it (ops.seq), null before the first
    ("device_free", _i64),          # oom: bytes CUDA still reported free
    ("storage_id", _i64),           # our tensors row at this address then (alloc/free events), or null
    ("category", _str),
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
    "graphs": GRAPHS,
    "graph_nodes": GRAPH_NODES,
    "api": API,
    "collectives": COLLECTIVES,
    "allocator": ALLOCATOR,
    "allocator_segments": ALLOCATOR_SEGMENTS,
    "allocator_blocks": ALLOCATOR_BLOCKS,
    "allocator_events": ALLOCATOR_EVENTS,
}

#: Columns a file of each table must have whatever its minor version: the ones that identify a
#: row. A file without them is not that table (``load`` refuses it rather than fill them with nulls).
REQUIRED: Dict[str, Tuple[str, ...]] = {
    "ops": ("seq", "op"),
    "calls": ("call_id", "name"),
    "tensors": ("storage_id", "nbytes"),
    "errors": ("error_id", "kind"),
    "kernels": ("seq", "name"),
    "leaks": ("nbytes", "holder", "holder_kind"),
    "casts": ("seq", "op", "from_dtype", "to_dtype"),
    "layout_changes": ("seq", "op"),
    "memory": ("seq", "device", "live_bytes"),
    "collectives": ("seq", "op"),
    "allocator": ("device",),
    "allocator_segments": ("device", "address"),
    "allocator_blocks": ("device", "address"),
    "allocator_events": ("device", "action"),
}

#: Tables recorded directly; the rest are derived by analyses from these.
RECORDED = ("ops", "calls", "tensors", "errors", "kernels", "leaks", "graphs", "graph_nodes", "collectives",
            "allocator", "allocator_segments", "allocator_blocks", "allocator_events")
DERIVED = ("casts", "layout_changes", "memory", "api")


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


_EMPTY: Dict[str, pa.Table] = {}


_NP_OF = {pa.int64(): np.int64, pa.int32(): np.int32, pa.float64(): np.float64, pa.bool_(): np.bool_}


def nullable_array(values: np.ndarray, null_mask: np.ndarray, typ: Any = pa.int64()) -> pa.Array:
    """``values`` (numpy) as an Arrow array of ``typ``, null where ``null_mask``: the validity bitmap is
    packed by numpy and the values buffer shared (``pa.array(mask=)`` converts row by row and
    imports pandas on first use)."""
    values = np.ascontiguousarray(values, dtype=_NP_OF[typ])
    nulls = int(np.count_nonzero(null_mask))
    if nulls == 0:
        return pa.array(values, typ)
    if nulls == len(values):
        return pa.nulls(nulls, typ)
    valid = np.packbits(~null_mask, bitorder="little")
    data = np.packbits(values, bitorder="little") if typ == pa.bool_() else values
    return pa.Array.from_buffers(typ, len(values), [pa.py_buffer(valid), pa.py_buffer(data)], null_count=nulls)


def empty(name: str) -> pa.Table:
    """An empty table with the right schema: honest, never a placeholder row (one per table name:
    Arrow tables are immutable, and making one costs ~80 µs)."""
    t = _EMPTY.get(name)
    if t is None:
        t = _EMPTY[name] = TABLES[name].empty_table()
    return t


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
    return unify_dictionaries(pa.Table.from_arrays(cols, schema=schema))


def _dictionaries(chunk: Any) -> Any:
    if pa.types.is_dictionary(chunk.type):
        return chunk.dictionary
    if pa.types.is_list(chunk.type) and pa.types.is_dictionary(chunk.type.value_type):
        return chunk.values.dictionary
    return None


def unify_dictionaries(table: pa.Table) -> pa.Table:
    """One dictionary per column across the table's chunks (a table read from several files or
    row groups, or concatenated from several traces, may carry one per chunk): Arrow's
    ``group_by`` and hash kernels refuse differing dictionaries. A no-op, without copying,
    when the chunks already share theirs (every table one trace builds)."""
    for col in table.columns:
        if col.num_chunks < 2:
            continue
        first = _dictionaries(col.chunk(0))
        if first is None:
            continue
        for chunk in col.chunks[1:]:
            d = _dictionaries(chunk)
            if d is not first and not d.equals(first):
                return table.unify_dictionaries()
    return table


def plain_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_dictionary(t):
        return t.value_type
    if pa.types.is_list(t):
        inner = plain_type(t.value_type)
        return t if inner is t.value_type else pa.list_(inner)
    return t


def plain_strings(table: pa.Table) -> pa.Table:
    """``table`` with dictionary-encoded columns decoded to their plain values (``string``,
    ``list<string>``): for pandas, where a ``category`` column would sort and group by
    dictionary code, not by value."""
    schema = pa.schema([f.with_type(plain_type(f.type)) for f in table.schema], metadata=table.schema.metadata)
    return table if schema.equals(table.schema) else table.cast(schema)


def parse_version(v: str) -> Tuple[int, int]:
    major, _, minor = str(v).partition(".")
    return int(major), int(minor or 0)


# -- what memory is made of (1.3): categories, the timeline, per-module memory ----------
#: ``tensors.category`` values, in the order the timeline stacks them (bottom first)
MEMORY_CATEGORIES = ("parameter", "buffer", "gradient", "optimizer_state", "input", "activation", "temporary", "other")

#: Not a trace table: ``t.memory_timeline()``, live bytes by category after each op, one row per (seq, device).
MEMORY_TIMELINE = _schema("memory_timeline", [
    ("seq", _i64),
    ("device", _str),
    ("op", _str),
    ("phase", _str),
    ("module", _str),
    ("source_file", _str),
    ("source_line", _i64),
    ("live_bytes", _i64),           # every category: the ``memory`` table's live_bytes
] + [(f"{c}_bytes", _i64) for c in MEMORY_CATEGORIES] + [
    ("is_peak", _bool),             # the first op after which live_bytes was largest on this device
])

#: Not a trace table: ``t.allocator_timeline()``, the allocator's reserved and allocated bytes after
#: each of its events (``memory_history=True``), one row per (device, event).
ALLOCATOR_TIMELINE = _schema("allocator_timeline", [
    ("device", _str),
    ("time_us", _i64),
    ("start_ns", _i64),
    ("seq", _i64),
    ("reserved_bytes", _i64),       # segments held by the cache
    ("allocated_bytes", _i64),      # live blocks, at the sizes asked for
])

#: Not a trace table: ``t.memory_at(seq)`` (default: each device's peak), what was alive after op ``seq``.
MEMORY_AT = _schema("memory_at", [
    ("seq", _i64),
    ("device", _str),
    ("category", _str),
    ("module", _str),               # module that allocated it (parameters: the module that owns them)
    ("bytes", _i64),
    ("storages", _i64),
])

#: Not a trace table: ``t.module_memory()``, one row per (module, device); children rolled into parents.
MODULE_MEMORY = _schema("module_memory", [
    ("module", _str),
    ("device", _str),
    ("depth", _i64),                # dots in the path (roots: 0)
    ("activation_bytes", _i64),     # storages its forward ops (children included) saved for backward
    ("own_activation_bytes", _i64),  # the same, its own ops only
    ("fwd_peak_bytes", _i64),       # largest live bytes after one of its forward ops
    ("fwd_peak_seq", _i64),
    ("bwd_peak_bytes", _i64),       # largest live bytes after one of its backward ops
    ("bwd_peak_seq", _i64),
    ("fwd_ops", _i64),
    ("bwd_ops", _i64),
])


# -- the advisor (tensorscope.advise; analyses/syncs.py, roofline.py, advisor.py) -------------
#: Not a trace table: ``advise(t).syncs``, one row per op (or torch-level call) that forces a
#: device->host synchronisation when its tensor is on a GPU.
SYNCS = _schema("syncs", [
    ("window", _i64),               # which trace of the advised ones (0 for a single trace)
    ("seq", _i64),                  # the op (ops.seq): the scalar read, data-dependent shape or host copy
    ("op", _str),
    ("call_id", _i64),              # the torch-level call that read the value (calls.call_id), or null
    ("call", _str),                 # Tensor.item, Tensor.__bool__, torch.nonzero ... (null: none)
    ("kind", _str),                 # scalar_read / data_dependent_shape / host_copy
    ("device", _str),               # the device of the tensor read (the sync is real only off the CPU)
    ("cpu_ns", _i64),               # host time of the op (on CUDA it includes the wait for the GPU)
    ("cuda_ns", _i64),
    ("module", _str),
    ("source_file", _str),
    ("source_line", _i64),
])

#: Not a trace table: ``advise(t).roofline``, one row per (op, dtype) and per module.
ROOFLINE = _schema("roofline", [
    ("level", _str),                # op / module
    ("name", _str),                 # the op (aten.addmm.default) or the module path
    ("dtype", _str),                # op level: the output dtype whose peak applies; module: the dominant one
    ("device", _str),               # cpu / cuda
    ("n_ops", _i64),
    ("time_ns", _i64),              # CUDA time where measured, else CPU time in the ops
    ("flops", _i64),
    ("bytes", _i64),                # bytes read + written
    ("intensity", _f64),            # flops / byte (null: no bytes)
    ("flops_per_s", _f64),          # achieved
    ("bytes_per_s", _f64),
    ("peak_flops_per_s", _f64),     # the measured peak of the dtype (null: no peaks)
    ("peak_bytes_per_s", _f64),
    ("roof_flops_per_s", _f64),     # attainable at this intensity: min(peak, intensity * bandwidth)
    ("roof_fraction", _f64),        # achieved / attainable (FLOP/s, or bytes/s for ops without FLOPs)
    ("ideal_ns", _i64),             # max(flops / peak, bytes / bandwidth): the time at the roof
    ("bound", _str),                # compute / memory / overhead (null: no peaks, or no work counted)
])

#: Not a trace table: ``advise(t).findings``, one row per finding, proved by the rows it names.
ADVICE = _schema("advice", [
    ("kind", _str),                 # sync / layout / overhead / outside_ops / compute_bound / memory_bound /
                                    # amp / zero_grad / host_copy
    ("subject", _str),              # what the finding is about (an op, a call, a module)
    ("seen", _str),                 # what the rows show, in words
    ("evidence", _str),             # which rows: "ops seq 3, 9, 15 … (30 rows)"
    ("rows", _i64s),                # their ops.seq (or calls.call_id for kind sync on a call)
    ("n_rows", _i64),
    ("per_step", _f64),             # rows per step (null: steps unknown)
    ("cost_ns", _i64),              # time the rows cost (measured); null when not measurable
    ("fix", _str),                  # the change that would remove it
    ("module", _str),
    ("source_file", _str),
    ("source_line", _i64),
])
