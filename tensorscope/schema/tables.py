"""The tables a Trace carries (recorded and derived), the registry of them and their required columns."""
from __future__ import annotations

import pyarrow as pa

from ._base import _bin, _bool, _bools, _dstr, _dstrs, _f64, _i32s, _i64, _i64s, _schema, _shapes, _str, _strs, _u64

#: ``tensors.category`` values, in the order the timeline stacks them (bottom first)
MEMORY_CATEGORIES = ("parameter", "buffer", "gradient", "optimizer_state", "input", "activation", "temporary", "other")


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
    ("first_run", _bool),           # 1.5: the first execution in the process of (op, input shapes, dtypes, devices)
    ("probe_ns", _i64),             # 1.5: tensorscope's own time after the op until the next starts (python engine), or null
    # 1.5, fingerprints=True: the op's first real floating output (fresh or written), read where the
    # screen reads it; null when not recorded (older files, fingerprints off, views, non-float outputs)
    ("fp_hash", _u64),              # bitwise hash of the values in logical order (both engines agree)
    ("fp_nonfinite", _i64),         # NaN/Inf values
    ("fp_sum", _f64),               # sum of the finite values (float64)
    ("fp_abs_sum", _f64),           # sum of |x| over the finite values
    ("fp_max_abs", _f64),           # largest finite |x|
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
    ("expected", _bool),            # not a leak: model/optimizer state (model_state/optimizer_state) or a named one-element value (value)
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

#: 1.5, capture=: what t.repro() rebuilds an op's call from (one "call" row per captured op, its
#: tensor arguments' memory as "input" rows, the non-finite mask of its outputs as "mask" rows)
CAPTURES = _schema("captures", [
    ("seq", _i64),                  # ops.seq
    ("op", _str),
    ("kind", _str),                 # call / input / mask
    ("index", _i64),                # input: the tensor's number in the call; mask: the output's
    ("dtype", _str),
    ("device", _str),
    ("shape", _i64s),
    ("stride", _i64s),
    ("storage_offset", _i64),
    ("data", _bin),                 # call: the arguments as JSON; input: the bytes the tensor spans from its
                                    # storage offset; mask: the outputs' NaN/Inf positions, bit-packed
    ("note", _str),                 # why it was captured, or what could not be
])

#: Every table a Trace carries, in display order. ``memory`` is derived.
TABLES: dict[str, pa.Schema] = {
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
    "captures": CAPTURES,
}

#: Columns a file of each table must have whatever its minor version: the ones that identify a
#: row. A file without them is not that table (``load`` refuses it rather than fill them with nulls).
REQUIRED: dict[str, tuple[str, ...]] = {
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
    "captures": ("seq", "kind"),
}

#: Tables recorded directly; the rest are derived by analyses from these.
RECORDED = ("ops", "calls", "tensors", "errors", "kernels", "leaks", "graphs", "graph_nodes", "collectives",
            "allocator", "allocator_segments", "allocator_blocks", "allocator_events", "captures")
DERIVED = ("casts", "layout_changes", "memory", "api")
