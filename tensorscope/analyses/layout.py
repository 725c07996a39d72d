"""The ``layout_changes`` table: memory-format changes, hidden copies and non-dense inputs.

``layout_changes(ops, calls)`` is a pure function of the ``ops`` and ``calls`` tables (no
tensor, no torch import): one row per finding, of kind ``format_change``, ``hidden_copy`` or
``non_dense_input``, with the formats, the reason and the bytes involved. One event is one
row: a hidden copy that also changed the memory format (``flatten`` or ``contiguous()`` of a
channels_last tensor) is the ``hidden_copy`` row, its from/to formats naming the change.

Rules and details: docs/development/analyses.md#layout-changes-analyseslayoutpy
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .._common import NoGC, itemsize
from .._tensormeta import non_dense_kind
from .opview import take_table_rows

CL_FORMATS = frozenset({"channels_last", "channels_last_3d"})
#: dense labels (the recorder writes "strided"; older recorders wrote "dense_permuted"); traces before
#: schema 1.2 wrote "non_dense" for every non-dense tensor, now labelled expanded/gapped/overlapping
DENSE_FORMATS = frozenset({"contiguous", "channels_last", "channels_last_3d", "strided", "dense_permuted"})
NON_DENSE_FORMATS = frozenset({"non_dense", "expanded", "gapped", "overlapping"})

#: undecomposed (inference_mode) composites that are a view or a contiguous copy
RESHAPE_FAMILY = frozenset({"reshape", "flatten", "reshape_as", "ravel", "unflatten", "contiguous", "view_as"})
#: ops that read no data of the tensor they are given (templates)
_TEMPLATE_OPS = frozenset({
    "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "empty_like", "zeros_like",
    "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "resize_", "resize_as_", "set_",
})
#: not compute ops for the non-dense check: materialising is what they are for, or they only move data
_NOT_COMPUTE = _TEMPLATE_OPS | RESHAPE_FAMILY | frozenset({
    "clone", "_to_copy", "to", "copy_", "copy", "_copy_from", "_copy_from_and_resize", "detach", "alias",
    "lift_fresh", "lift_fresh_copy", "_unsafe_view", "_reshape_alias", "expand", "expand_as", "as_strided",
    "fill_", "zero_", "fill", "_local_scalar_dense", "item", "_assert_async", "record_stream",
    "_foreach_copy_", "masked_fill_", "index_put_", "index_copy_", "select_scatter", "slice_scatter",
    "as_strided_scatter", "diagonal_scatter", "unbind", "split", "split_with_sizes", "chunk",
    "cat", "stack",
})

_COLS = ("seq", "op", "tags", "call_id", "module", "source_file", "source_line", "in_shapes", "in_strides",
         "in_dtypes", "in_formats", "in_ambiguous", "in_storages", "out_shapes", "out_strides", "out_dtypes",
         "out_formats", "out_ambiguous", "out_storages", "out_alias", "is_view", "inplace", "hidden_copy")

def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def short_name(op: str) -> str:
    """``aten.add_.Tensor`` -> ``add_``."""
    parts = op.split(".")
    return parts[1] if len(parts) > 1 else op


def rows_with_any(col: Any, values: Iterable[str]) -> np.ndarray:
    """Row indices whose list column contains any of ``values`` (vectorised)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if len(col) == 0:
        return np.zeros(0, dtype=np.int64)
    flat = pc.list_flatten(col)
    if len(flat) == 0:
        return np.zeros(0, dtype=np.int64)
    parents = pc.list_parent_indices(col).to_numpy()
    hit = pc.is_in(flat, value_set=pa.array(sorted(values), pa.string())).to_numpy(zero_copy_only=False)
    hit = np.asarray(hit, dtype=bool)
    return np.unique(parents[hit]).astype(np.int64)


def true_rows(col: Any) -> np.ndarray:
    arr = pc.fill_null(col, False)
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    return np.nonzero(np.asarray(arr.to_numpy(zero_copy_only=False), dtype=bool))[0].astype(np.int64)


def drop_noise(ops: pa.Table, idx: np.ndarray) -> np.ndarray:
    """``idx`` without the rows flagged ``is_noise`` (eager's bookkeeping is never a finding's subject)."""
    if len(idx) == 0 or "is_noise" not in ops.column_names:
        return idx
    noise = true_rows(ops.column("is_noise"))
    return idx[~np.isin(idx, noise)] if len(noise) else idx


class CallNames:
    """call_id -> torch-level call name, looked up on demand: a trace of small ops has one call per
    op, and a dict of every call costs far more than the few lookups an analysis makes. The sorted
    index of the call ids is built on the first lookup (most traces look none up)."""

    __slots__ = ("_calls", "_ids", "_order", "_names")

    def __init__(self, calls: Optional[pa.Table]) -> None:
        self._calls = calls if calls is not None and calls.num_rows else None
        self._ids: Optional[np.ndarray] = None
        self._order = np.zeros(0, np.int64)
        self._names: Optional[pa.ChunkedArray] = None

    def _index(self) -> np.ndarray:
        if self._ids is None:
            calls, self._ids = self._calls, np.zeros(0, np.int64)
            if calls is not None:
                ids = np.asarray(pc.fill_null(calls.column("call_id"), -1).to_numpy(), dtype=np.int64)
                self._order = np.argsort(ids, kind="stable")
                self._ids = ids[self._order]
                self._names = calls.column("name")
        return self._ids

    def get(self, call_id: Optional[int], default: Optional[str] = None) -> Optional[str]:
        if call_id is None or self._calls is None or call_id < 0:
            return default
        ids = self._index()
        k = int(np.searchsorted(ids, call_id))
        if k < len(ids) and ids[k] == call_id and self._names is not None:
            v = self._names[int(self._order[k])].as_py()
            return v if v is not None else default
        return default


def call_names(calls: Optional[pa.Table]) -> CallNames:
    """call_id -> torch-level call name (``.get(call_id)``)."""
    return CallNames(calls)


def take_rows(ops: pa.Table, idx: np.ndarray, cols: Sequence[str] = _COLS) -> list[dict[str, Any]]:
    """Rows ``idx`` of ``ops`` as dicts of the columns ``cols`` (column-wise: several times faster)."""
    if len(idx) == 0:
        return []
    have = [c for c in cols if c in ops.column_names]
    sub = take_table_rows(ops.select(have), np.asarray(idx, np.int64))
    with NoGC():
        values = [sub.column(c).to_pylist() for c in have]
        return [dict(zip(have, v)) for v in zip(*values)]


def count_in(col: Any, values: Iterable[str], flags: Any = None) -> np.ndarray:
    """Per row: how many elements of a list column are in ``values`` (and, with ``flags``, a
    parallel list<bool> column, whose flag is false)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    n = len(col)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    flat = pc.list_flatten(col)
    if len(flat) == 0:
        return np.zeros(n, dtype=np.int64)
    parents = pc.list_parent_indices(col).to_numpy()
    hit = np.asarray(pc.is_in(flat, value_set=pa.array(sorted(values), pa.string())).to_numpy(zero_copy_only=False),
                     dtype=bool)
    if flags is not None:
        if isinstance(flags, pa.ChunkedArray):
            flags = flags.combine_chunks() if flags.num_chunks != 1 else flags.chunk(0)
        f = pc.fill_null(pc.list_flatten(flags), False).to_numpy(zero_copy_only=False)
        if len(f) == len(hit):
            hit &= ~np.asarray(f, dtype=bool)
    return np.bincount(parents[hit], minlength=n).astype(np.int64)


def _fmt_tuple(v: Optional[Iterable[Any]]) -> str:
    v = list(v or [])
    return "(" + ", ".join(str(x) for x in v) + ("," if len(v) == 1 else "") + ")"


def _comparable(fmt: Optional[str], amb: Any) -> bool:
    return fmt in DENSE_FORMATS and not amb


def _format_change(r: dict[str, Any]) -> Optional[tuple[str, str, int]]:
    """(from_format, to_format, bytes) when the op changed a memory format, else None."""
    name = short_name(r["op"])
    reshape_copy = name in RESHAPE_FAMILY
    # reshape/flatten are schema views that may copy: their fresh outputs are checked below
    if (r.get("is_view") and not reshape_copy) or r.get("inplace") or name in _TEMPLATE_OPS:
        return None
    in_f = r.get("in_formats") or []
    in_a = r.get("in_ambiguous") or [False] * len(in_f)
    in_sh = r.get("in_shapes") or []
    out_f = r.get("out_formats") or []
    out_a = r.get("out_ambiguous") or [False] * len(out_f)
    out_sh = r.get("out_shapes") or []
    alias = r.get("out_alias") or [-1] * len(out_f)
    for j, of in enumerate(out_f):
        if j < len(alias) and alias[j] is not None and alias[j] >= 0:
            continue   # shares the input's storage: no data moved
        rank = len(out_sh[j]) if j < len(out_sh) else -1
        if reshape_copy:
            # a reshape that copies writes a contiguous tensor of another rank
            of, oa = "contiguous", False
            cand = [(f, a) for f, a, sh in zip(in_f[:1], in_a[:1], in_sh[:1])]
        else:
            oa = out_a[j] if j < len(out_a) else False
            cand = [(f, a) for f, a, sh in zip(in_f, in_a, in_sh) if len(sh) == rank]
        if not _comparable(of, oa):
            continue
        ins = [f for f, a in cand if _comparable(f, a)]
        if not ins:
            continue
        nb = _out_bytes(r, j)
        for f in ins:
            if f in CL_FORMATS and f != of:
                return f, of, nb
        if of in CL_FORMATS and of not in ins:
            return ins[0], of, nb
        return None   # the first comparable output decides (the others are stats/indices)
    return None


def _out_bytes(r: dict[str, Any], j: int) -> int:
    sh = (r.get("out_shapes") or [])
    dt = (r.get("out_dtypes") or [])
    if j >= len(sh):
        return 0
    return numel(sh[j]) * itemsize(dt[j] if j < len(dt) else None)


def _in_bytes(r: dict[str, Any], i: int) -> int:
    sh = (r.get("in_shapes") or [])
    dt = (r.get("in_dtypes") or [])
    if i >= len(sh):
        return 0
    return numel(sh[i]) * itemsize(dt[i] if i < len(dt) else None)


def _copy_target(r: dict[str, Any], nxt: Optional[dict[str, Any]]) -> Optional[list[int]]:
    """The shape the user asked for: the ``_unsafe_view`` right after a clone, else the copy's output."""
    if nxt is not None and short_name(nxt["op"]) == "_unsafe_view" and nxt.get("call_id") == r.get("call_id"):
        st_out = (r.get("out_storages") or [None])[0]
        st_in = (nxt.get("in_storages") or [None])[0]
        if st_out is not None and st_out == st_in and st_out >= 0:
            shape: Optional[list[int]] = (nxt.get("out_shapes") or [None])[0]
            return shape
    shape = (r.get("out_shapes") or [None])[0]
    return shape


def _hidden_reason(r: dict[str, Any], call: Optional[str], target: Optional[list[int]]) -> str:
    sh = (r.get("in_shapes") or [[]])[0]
    st = (r.get("in_strides") or [[]])[0]
    fmt = (r.get("in_formats") or ["?"])[0]
    name = short_name(r["op"])
    src = f"source shape {_fmt_tuple(sh)} strides {_fmt_tuple(st)} [{fmt}]"
    c = call or "?"
    if c == "contiguous" or name == "contiguous":
        return f"contiguous() copied: {src} is not contiguous"
    if name == "_to_copy":
        return f"{c}() copied without changing dtype or device: {src}"
    if target is not None and list(target) != list(sh):
        return f"{c}() copied: {src} cannot be viewed as {_fmt_tuple(target)}"
    return f"{c}() copied: {src} cannot be viewed with the requested strides"


def layout_changes(ops: pa.Table, calls: pa.Table, rows: int = 65_536) -> pa.Table:
    """Derive the LAYOUT_CHANGES table from ``ops`` and ``calls`` (sorted by seq, then kind).

    The candidate rows are found ``rows`` at a time (zero-copy slices: per-row arrays of one slice, never of
    the whole trace), and the call names looked up only for the candidates' calls."""
    if ops is None or ops.num_rows == 0:
        return S.empty("layout_changes")
    fmt, hid, nd = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for off in range(0, ops.num_rows, max(int(rows), 1)):
        b = ops.slice(off, max(int(rows), 1))
        # format-change candidates, vectorised: a channels_last input and an unambiguous dense
        # non-channels_last output, or a channels_last output without a channels_last input
        cl_in = count_in(b.column("in_formats"), CL_FORMATS)
        cl_out = count_in(b.column("out_formats"), CL_FORMATS)
        other_out = count_in(b.column("out_formats"), DENSE_FORMATS - CL_FORMATS, b.column("out_ambiguous"))
        fmt.append(off + drop_noise(b, np.nonzero(((cl_in > 0) & (other_out > 0)) | ((cl_out > 0) & (cl_in == 0)))[0]
                                    .astype(np.int64)))
        hid.append(off + drop_noise(b, true_rows(b.column("hidden_copy"))))
        nd.append(off + drop_noise(b, rows_with_any(b.column("in_formats"), NON_DENSE_FORMATS)))
    fmt_idx, hid_idx, nd_idx = np.concatenate(fmt), np.concatenate(hid), np.concatenate(nd)
    # the row after each hidden copy, to name the shape the user asked for
    nxt_idx = hid_idx + 1
    nxt_idx = nxt_idx[nxt_idx < ops.num_rows]
    want = np.unique(np.concatenate([fmt_idx, hid_idx, nd_idx, nxt_idx]))
    if len(want) and "call_id" in ops.column_names:
        names: CallNames = _SomeCallNames(calls, ops.column("call_id").take(pa.array(want, pa.int64())), rows)
    else:
        names = call_names(None)
    with NoGC():
        return _layout_rows(ops, names, want, fmt_idx, hid_idx, nd_idx)


class _SomeCallNames(CallNames):
    """``CallNames`` of the few call ids ``ids`` only (the calls read ``rows`` at a time): what an analysis
    with a few candidate rows needs, without an index of every call."""

    __slots__ = ("_some",)

    def __init__(self, calls: Optional[pa.Table], ids: Any, rows: int) -> None:
        super().__init__(None)
        self._some: dict[int, Optional[str]] = {}
        want = pc.unique(pc.drop_null(ids))
        if calls is None or calls.num_rows == 0 or not len(want):
            return
        for off in range(0, calls.num_rows, max(int(rows), 1)):
            b = calls.select(["call_id", "name"]).slice(off, max(int(rows), 1))
            m = pc.is_in(b.column("call_id"), value_set=want)
            if pc.any(m).as_py():
                hit = b.filter(m)
                for k, v in zip(hit.column("call_id").to_pylist(), hit.column("name").to_pylist()):
                    self._some.setdefault(k, v)     # the first call of an id, as CallNames' stable search

    def get(self, call_id: Optional[int], default: Optional[str] = None) -> Optional[str]:
        if call_id is None or call_id < 0:
            return default
        v = self._some.get(call_id)
        return v if v is not None else default


def _layout_rows(ops: pa.Table, names: CallNames, want: np.ndarray, fmt_idx: np.ndarray,
                 hid_idx: np.ndarray, nd_idx: np.ndarray) -> pa.Table:
    rows = dict(zip(want.tolist(), take_rows(ops, want)))
    fmt_set, hid_set, nd_set = set(fmt_idx.tolist()), set(hid_idx.tolist()), set(nd_idx.tolist())

    out: dict[str, list[Any]] = {f.name: [] for f in S.LAYOUT_CHANGES}

    def emit(r: dict[str, Any], kind: str, frm: Optional[str], to: Optional[str], reason: str,
             nbytes: int) -> None:
        cid = r.get("call_id")
        out["seq"].append(r["seq"])
        out["op"].append(r["op"])
        out["call"].append(names.get(cid) if cid is not None else None)
        out["from_format"].append(frm)
        out["to_format"].append(to)
        out["kind"].append(kind)
        out["reason"].append(reason)
        out["bytes"].append(int(nbytes))
        out["module"].append(r.get("module"))
        out["source_file"].append(r.get("source_file"))
        out["source_line"].append(r.get("source_line"))

    for i in want.tolist():
        r = rows[i]
        if i in fmt_set and i not in hid_set:   # one event, one row: a hidden copy that changed the format
            ch = _format_change(r)              # is the hidden copy (its from/to formats say the change)
            if ch is not None:
                frm, to, nb = ch
                cid = r.get("call_id")
                call = names.get(cid) if cid is not None else None
                why = f"{short_name(r['op'])} returned {to} for a {frm} input"
                if call and call != short_name(r["op"]):
                    why += f" (inside {call}())"
                emit(r, "format_change", frm, to, why, nb)
        if i in hid_set:
            cid = r.get("call_id")
            call = names.get(cid) if cid is not None else None
            target = _copy_target(r, rows.get(i + 1))
            frm = (r.get("in_formats") or [None])[0]
            to = "contiguous" if short_name(r["op"]) in RESHAPE_FAMILY else (r.get("out_formats") or [None])[0]
            why = _hidden_reason(r, call, target)
            ch = _format_change(r) if i in fmt_set else None
            if ch is not None:
                frm, to = ch[0], ch[1]
                why += f"; the copy is {to}, the source {frm}"
            emit(r, "hidden_copy", frm, to, why, _out_bytes(r, 0))
        if i in nd_set:
            nd = _non_dense_input(r)
            if nd is not None:
                k, fmt_kind, reason, nb = nd
                emit(r, "non_dense_input", fmt_kind, (r.get("out_formats") or [None])[0], reason, nb)
    return pa.Table.from_pydict(out, schema=S.LAYOUT_CHANGES)


def _non_dense_input(r: dict[str, Any]) -> Optional[tuple[int, str, str, int]]:
    name = short_name(r["op"])
    if r.get("is_view") or name in _NOT_COMPUTE or name.startswith("_foreach_"):
        return None
    tags = r.get("tags") or []
    if "pointwise" in tags or "reduction" in tags or "view_copy" in tags:
        return None
    fmts = r.get("in_formats") or []
    shapes = r.get("in_shapes") or []
    strides = r.get("in_strides") or []
    alias = set(a for a in (r.get("out_alias") or []) if a is not None and a >= 0)
    for i, f in enumerate(fmts):
        if f not in NON_DENSE_FORMATS or i in alias:
            continue   # a written (in-place/out=) tensor is not an input read through a slow path
        sh = shapes[i] if i < len(shapes) else []
        st = strides[i] if i < len(strides) else []
        kind = non_dense_kind(sh, st) if f == "non_dense" else f
        if kind == "dense":
            continue
        reason = (f"input {i} of {name} is {kind}: shape {_fmt_tuple(sh)} strides {_fmt_tuple(st)}"
                  + ("; the kernel may copy it or take a slow path" if kind != "expanded" else
                     "; a zero-stride input is usually materialised by this kernel"))
        return i, kind, reason, _in_bytes(r, i)
    return None
