"""The schemas of a multi-rank dataset (``tensorscope.io.dataset``): the key columns and ``ranks``."""
from __future__ import annotations

import pyarrow as pa

from ._base import _bool, _i64, _schema, _str
from .tables import TABLES

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
