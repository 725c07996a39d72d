"""Schemas of tables that are not trace tables: what analyses and comparisons return."""
from __future__ import annotations

from ._base import _bool, _f64, _i64, _i64s, _schema, _str
from .tables import MEMORY_CATEGORIES

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


#: Not a trace table: ``t.memory_timeline``, live bytes by category after each op, one row per (seq, device).
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

#: Not a trace table: ``t.allocator_timeline``, the allocator's reserved and allocated bytes after
#: each of its events (``memory_history=True``), one row per (device, event).
ALLOCATOR_TIMELINE = _schema("allocator_timeline", [
    ("device", _str),
    ("time_us", _i64),
    ("start_ns", _i64),
    ("seq", _i64),
    ("reserved_bytes", _i64),       # segments held by the cache
    ("allocated_bytes", _i64),      # live blocks, at the sizes asked for
])

#: Not a trace table: ``t.memory_at(seq)`` (default: each device's peak), what was live while op ``seq`` ran.
MEMORY_AT = _schema("memory_at", [
    ("seq", _i64),
    ("device", _str),
    ("category", _str),
    ("module", _str),               # module that allocated it (parameters: the module that owns them)
    ("bytes", _i64),
    ("storages", _i64),
])

#: Not a trace table: ``t.module_memory``, one row per (module, device); children rolled into parents.
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
    ("row_starts", _i64s),          # the rows it names, in order, as runs of consecutive ops.seq: run k is
    ("row_counts", _i64s),          # seq row_starts[k] .. row_starts[k] + row_counts[k] - 1 (exact, and a few
                                    # numbers for a finding naming nearly every row; finding_rows() expands them)
    ("n_rows", _i64),
    ("per_step", _f64),             # rows per step (null: steps unknown)
    ("cost_ns", _i64),              # time the rows cost (measured); null when not measurable
    ("fix", _str),                  # the change that would remove it
    ("module", _str),
    ("source_file", _str),
    ("source_line", _i64),
])

#: Not a trace table: ``tensorscope.diverge(a, b).pairs``, one row per aligned pair of ops.
DIVERGE_PAIRS = _schema("diverge_pairs", [
    ("seq_a", _i64),                # ops.seq in run a
    ("seq_b", _i64),                # ops.seq in run b
    ("op", _str),                   # run a's op (the pair's key: both runs ran it at the same place)
    ("module", _str),
    ("source_file", _str),
    ("source_line", _i64),
    ("phase", _str),
    ("dtype_a", _str),              # the fingerprinted output's dtype in each run
    ("dtype_b", _str),
    ("status", _str),               # identical / close / diverged / unknown (no fingerprint on a side)
    ("cause", _str),                # diverged: numeric / structural / propagated; else null
    ("rel_err", _f64),              # relative difference of the fingerprints' statistics (a lower bound)
    ("threshold", _f64),            # beyond it the pair diverged (rtol=, else the finer dtype's tolerance)
    ("expected", _f64),             # what precision explains (the coarser dtype's tolerance)
    ("explained", _bool),           # diverged within what the precision explains
    ("input_err", _f64),            # the largest rel_err among the pairs that produced its inputs
    ("growth", _f64),               # propagated: rel_err / input_err
    ("after_cast", _bool),          # an input came through a cast that only one run made
])

#: Not a trace table: ``tensorscope.diverge(a, b).structure``, the ops only one run made.
DIVERGE_STRUCTURE = _schema("diverge_structure", [
    ("side", _str),                 # a / b
    ("seq", _i64),
    ("op", _str),
    ("module", _str),
    ("source_file", _str),
    ("source_line", _i64),
    ("phase", _str),
    ("in_dtype", _str),
    ("out_dtype", _str),
    ("kind", _str),                 # cast (a cast one run inserted) / replaced (the other run ran different ops
                                    # there: a kernel, decomposition or fused region) / extra (nothing there)
])
