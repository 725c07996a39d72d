"""Host-device synchronisations: the ops that make the host wait for the device, found in the ops table.

Three kinds, each decided by the op and its recorded inputs (so a CPU trace finds what a
CUDA run of the same code would wait on; the op is the same):

``scalar_read``
    a value read into Python: ``_local_scalar_dense`` (``.item()``, ``bool(t)``, ``if t:``,
    ``int(t)``), ``equal``, ``is_nonzero``.
``data_dependent_shape``
    an output whose size depends on the values: ``nonzero``, ``masked_select``, ``unique``,
    ``bincount``, ``repeat_interleave(Tensor)``, indexing with a boolean mask.
``host_copy``
    a copy from a device tensor into CPU memory (``.cpu()``, ``.tolist()``, ``.numpy()`` of a GPU
    tensor dispatch one).

``_local_scalar_dense`` is a bookkeeping (``is_noise``) row: the row is kept here as evidence,
and the advisor names the torch-level call that read the value as its subject.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .opview import BATCH_ROWS, OpView, first_of, short_name, string_mask, views

SCALAR_READ = frozenset({"_local_scalar_dense", "equal", "is_nonzero", "item"})
DATA_DEPENDENT = frozenset({"nonzero", "nonzero_numpy", "argwhere", "masked_select", "_unique", "_unique2",
                            "unique_dim", "unique_consecutive", "unique_dim_consecutive", "bincount"})
#: ops whose output size depends on the values when an index is a boolean mask
MASK_INDEX = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
COPY_OPS = frozenset({"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "to"})
_MASK_DTYPES = ("bool", "uint8")
_COLS = ["seq", "call_id", "is_noise", "in_dtypes", "in_devices", "out_devices", "cpu_ns", "cuda_ns",
         "module", "source_file", "source_line"]


def _candidate(op: str) -> bool:
    n = short_name(op)
    if n in SCALAR_READ or n in DATA_DEPENDENT or n in MASK_INDEX or n in COPY_OPS:
        return True
    return n == "repeat_interleave" and op.endswith(".Tensor")


def _kind(r: dict[str, Any], op: str) -> Optional[str]:
    n = short_name(op)
    if n in SCALAR_READ:
        return "scalar_read"
    if n in DATA_DEPENDENT or n == "repeat_interleave":
        return "data_dependent_shape"
    if n in MASK_INDEX:
        return "data_dependent_shape" if any(d in _MASK_DTYPES for d in (r["in_dtypes"] or [])[1:]) else None
    if n in COPY_OPS:
        ins, outs = r["in_devices"] or [], r["out_devices"] or []
        if n == "copy_" and len(ins) >= 2:   # copy_(dst, src): src on a device, dst in CPU memory
            return "host_copy" if ins[1] not in (None, "cpu", "meta") and ins[0] == "cpu" else None
        return "host_copy" if any(d not in (None, "cpu", "meta") for d in ins) and "cpu" in outs else None
    return None


def sync_table(ops: pa.Table, calls: pa.Table, window: int = 0, rows: Optional[int] = None) -> pa.Table:
    """The SYNCS rows of one trace (``window``: its index among the traces advised together), read a
    record batch of ``rows`` (``opview.BATCH_ROWS``) at a time; only the sync rows are kept."""
    if ops.num_rows == 0:
        return S.SYNCS.empty_table()
    parts = [t for t in (_sync_rows(view) for view in views(ops, rows)) if t is not None]
    if not parts:
        return S.SYNCS.empty_table()
    hit = pa.concat_tables(parts).combine_chunks()
    return pa.table({
        "window": pa.array(np.full(hit.num_rows, window, dtype=np.int64)),
        "seq": hit.column("seq"), "op": hit.column("op"), "call_id": hit.column("call_id"),
        "call": pa.array(call_names(calls, hit.column("call_id")), pa.string()), "kind": hit.column("kind"),
        "device": hit.column("device"), "cpu_ns": hit.column("cpu_ns"), "cuda_ns": hit.column("cuda_ns"),
        "module": hit.column("module").cast(pa.string()), "source_file": hit.column("source_file").cast(pa.string()),
        "source_line": hit.column("source_line"),
    }, schema=S.SYNCS)


def _sync_rows(view: OpView) -> Optional[pa.Table]:
    """The sync rows of one slice (its columns, with ``op``, ``kind`` and ``device`` as plain strings), or None."""
    by_name = view.mask(lambda o: short_name(o) in SCALAR_READ or short_name(o) in DATA_DEPENDENT
                        or (short_name(o) == "repeat_interleave" and o.endswith(".Tensor")), work_only=False)
    by_args = view.mask(lambda o: short_name(o) in MASK_INDEX or short_name(o) in COPY_OPS, work_only=False)
    keep = by_name.copy()
    kinds: dict[int, str] = {}
    for i, r in zip(np.flatnonzero(by_args).tolist(), view.rows(by_args, _COLS)):
        k = _kind(r, view.names[view.codes[i]])
        if k:
            keep[i] = True
            kinds[i] = k
    if not keep.any():
        return None
    idx = np.flatnonzero(keep)
    hit = view.ops.select(_COLS).take(pa.array(idx))
    names = [view.names[c] for c in view.codes[idx].tolist()]
    kind = [kinds.get(i) or ("scalar_read" if short_name(n) in SCALAR_READ else "data_dependent_shape")
            for i, n in zip(idx.tolist(), names)]
    devs = first_of(hit.column("in_devices"))
    second = [j for j, n in enumerate(names) if short_name(n) == "copy_"]
    if second:   # copy_(dst, src): the tensor read is the source
        d = devs.to_pylist()
        for j, v in zip(second, hit.column("in_devices").take(pa.array(second)).to_pylist()):
            d[j] = ((v or []) + [None, None])[1]
        devs = pa.array(d, pa.string())
    return pa.table({
        "seq": hit.column("seq"), "op": pa.array(names, pa.string()), "call_id": hit.column("call_id"),
        "kind": pa.array(kind, pa.string()), "device": devs, "cpu_ns": hit.column("cpu_ns"),
        "cuda_ns": hit.column("cuda_ns"), "module": hit.column("module").cast(pa.string()),
        "source_file": hit.column("source_file").cast(pa.string()), "source_line": hit.column("source_line"),
    })


def call_names(calls: pa.Table, call_ids: Any, rows: Optional[int] = None) -> list[Optional[str]]:
    """The qualname (``Tensor.item``) of each call id (None where unknown; the first call of an id that repeats),
    the calls read a record batch at a time against the few ids wanted (no hash of every call)."""
    ids = pa.array(call_ids) if not isinstance(call_ids, (pa.Array, pa.ChunkedArray)) else call_ids
    if calls.num_rows == 0 or not len(ids):
        return [None] * len(ids)
    want = pc.unique(pc.drop_null(ids))
    found: dict[int, Optional[str]] = {}
    step = max(int(rows or BATCH_ROWS), 1)
    for off in range(0, calls.num_rows, step):
        b = calls.select(["call_id", "qualname"]).slice(off, step)
        m = pc.is_in(b.column("call_id"), value_set=want)
        if pc.any(m).as_py():
            hit = S.plain_strings(b.filter(m))
            for k, v in zip(hit.column("call_id").to_pylist(), hit.column("qualname").to_pylist()):
                found.setdefault(k, v)
    return [found.get(c) if c is not None else None for c in ids.to_pylist()]


def infer_steps(calls: pa.Table, rows: Optional[int] = None) -> Optional[int]:
    """Training steps in a trace: its outermost ``backward`` calls (None when it ran none), a record batch
    at a time."""
    n = 0
    step = max(int(rows or BATCH_ROWS), 1)
    for off in range(0, calls.num_rows, step):
        b = calls.slice(off, step)
        back = string_mask(b.column("name"), lambda v: v == "backward")
        if back.any():
            n += int((back & (pc.fill_null(b.column("depth"), -1).to_numpy(zero_copy_only=False) == 0)).sum())
    return n or None


def tiny_mask(ops: pa.Table, tiny_bytes: int, tiny_flops: int, noise: np.ndarray) -> np.ndarray:
    """Non-noise ops moving fewer than ``tiny_bytes`` and doing fewer than ``tiny_flops``."""
    nb = (pc.fill_null(ops.column("bytes_read"), 0).to_numpy(zero_copy_only=False)
          + pc.fill_null(ops.column("bytes_written"), 0).to_numpy(zero_copy_only=False))
    fl = pc.fill_null(ops.column("flops"), 0).to_numpy(zero_copy_only=False)
    out: np.ndarray = (nb < tiny_bytes) & (fl < tiny_flops) & ~noise
    return out
