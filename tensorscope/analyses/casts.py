"""The ``casts`` table: every dtype conversion of a trace, written or not.

``casts(ops, calls)`` is a pure function of the ``ops`` and ``calls`` tables (no tensor; torch
is not imported): one row per conversion, with its kind (``explicit``, ``autocast``, ``copy``,
``implicit_downcast``, ``promotion``), direction, elements, bytes and round trips;
``round_trip_pairs`` counts the a -> b -> a pairs.

Rules and details: docs/development/analyses.md#casts-analysescastspy
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .._common import COMPLEX_BITS, COPY_INTO_OPS, FLOAT_BITS, INT_BITS, NoGC, itemsize
from .layout import drop_noise, numel, short_name, take_rows
from .opview import codes_of
from .totals import row_batches

#: ops that materialise a conversion of their (first) input
CAST_OPS = frozenset({"_to_copy", "to", "type_as", "_autocast_to_reduced_precision", "_autocast_to_full_precision",
                      "_to_dense"})
#: non-pointwise ops that promote their inputs like TensorIterator does
PROMOTING_OPS = frozenset({"cat", "stack", "concat", "concatenate", "hstack", "vstack", "dstack", "column_stack",
                           "lerp", "addcmul", "addcdiv"})
#: torch-level calls that *are* a conversion the user wrote (not autocast's)
USER_CAST_CALLS = frozenset({
    "to", "type", "type_as", "half", "float", "double", "bfloat16", "int", "long", "short", "char", "byte", "bool",
    "cfloat", "cdouble", "copy_", "__setitem__", "clone", "new_tensor", "tensor", "as_tensor", "_to_copy",
})

_COLS = ("seq", "op", "tags", "phase", "fwd_seq", "call_id", "module", "source_file", "source_line", "in_shapes",
         "in_dtypes", "in_storages", "out_shapes", "out_dtypes", "out_storages", "out_alias", "is_view", "inplace",
         "overload", "nonfinite", "nonfinite_produced")


def _category(dt: str) -> int:
    if dt == "bool":
        return 0
    if dt in INT_BITS:
        return 1
    if dt in FLOAT_BITS:
        return 2
    if dt in COMPLEX_BITS:
        return 3
    return -1


def direction(src: str, dst: str) -> str:
    """How a value changes going from dtype ``src`` to ``dst``."""
    if src == dst:
        return "same"
    cs, cd = _category(src), _category(dst)
    if cd == 0:
        return "to_bool"
    if cs == 3 and cd < 3:
        return "complex_to_real"
    if cs == 2 and cd == 1:
        return "float_to_int"
    if cs in (0, 1) and cd >= 2:
        return "int_to_float"
    if cs == 0:
        return "up"
    if cs == 1 and cd == 1:
        (ws, ss), (wd, sd) = INT_BITS[src], INT_BITS[dst]
        if wd < ws or (wd == ws and ss != sd):
            return "int_narrowing" if wd < ws else "same_width"
        if not sd and ss:   # signed -> wider unsigned: negatives wrap
            return "int_narrowing"
        return "up"
    if cs == 2 and cd == 3:
        return "up" if 2 * FLOAT_BITS[src] <= COMPLEX_BITS[dst] else "down"
    ws = FLOAT_BITS.get(src) or COMPLEX_BITS.get(src) or 0
    wd = FLOAT_BITS.get(dst) or COMPLEX_BITS.get(dst) or 0
    if wd > ws:
        return "up"
    if wd < ws:
        return "down"
    return "same_width"


_NARROWING = frozenset({"down", "int_narrowing", "float_to_int", "to_bool", "complex_to_real", "same_width"})

# promote_types for the dtypes that meet in practice (the lattice torch uses)
_FLOAT_ORDER = ["float16", "bfloat16", "float32", "float64"]


def _to_complex(dt: str) -> str:
    return "complex128" if dt == "float64" else "complex64"


def promote(a: Optional[str], b: Optional[str]) -> Optional[str]:
    """torch.promote_types on dtype names, without importing torch."""
    if a is None:
        return b
    if b is None or a == b:
        return a
    ca, cb = _category(a), _category(b)
    if ca < 0 or cb < 0:
        return a
    if ca != cb:
        hi, lo = (a, b) if ca > cb else (b, a)
        if _category(hi) == 3 and lo == "float64":
            return "complex128"
        return hi
    if ca == 2:
        if {a, b} == {"float16", "bfloat16"}:
            return "float32"
        return a if FLOAT_BITS.get(a, 0) >= FLOAT_BITS.get(b, 0) else b
    if ca == 3:
        return a if COMPLEX_BITS[a] >= COMPLEX_BITS[b] else b
    if ca == 1:
        (wa, sa), (wb, sb) = INT_BITS[a], INT_BITS[b]
        if sa == sb:
            return a if wa >= wb else b
        s_, u = (a, b) if sa else (b, a)
        if INT_BITS[s_][0] > INT_BITS[u][0]:
            return s_
        return {8: "int16", 16: "int32", 32: "int64"}.get(INT_BITS[u][0], "int64")
    return a


def computation_dtype(dtypes: list[str], shapes: list[list[int]]) -> Optional[str]:
    """TensorIterator's common dtype (c10 ResultTypeState): a 0-dim tensor only lifts the category."""
    dim_res = zero_res = None
    for dt, sh in zip(dtypes, shapes):
        if _category(dt) < 0:
            continue
        if len(sh) > 0:
            dim_res = promote(dim_res, dt)
        else:
            zero_res = promote(zero_res, dt)
    if dim_res is None:
        return zero_res
    if zero_res is None:
        return dim_res
    # combine_categories(higher=dim_res, lower=zero_res)
    ch, cl = _category(dim_res), _category(zero_res)
    if ch == 3:
        return dim_res
    if cl == 3:
        return _to_complex(dim_res) if ch == 2 else zero_res
    if ch == 2:
        return dim_res
    if ch == 0 or cl == 2:
        return promote(dim_res, zero_res)
    return dim_res


def casts(ops: pa.Table, calls: pa.Table) -> pa.Table:
    """Derive the CASTS table from ``ops`` and ``calls``, in seq order."""
    return _analyse(ops, calls)[0]


def round_trip_pairs(ops: pa.Table, calls: pa.Table) -> int:
    """Number of a -> b -> a pairs (casts that undo an earlier cast of the same data)."""
    return int(_analyse(ops, calls)[1])


# the last analysis, keyed by the identity of its input tables (held weakly): the summary
# and the guards ask for the pair count right after the table was derived
_last: Optional[tuple[Callable[[], Any], Callable[[], Any], pa.Table, int]] = None


def _analyse(ops: pa.Table, calls: pa.Table) -> tuple[pa.Table, int]:
    global _last
    if _last is not None and _last[0]() is ops and _last[1]() is calls:
        return _last[2], _last[3]
    res = _analyse_uncached(ops, calls)
    try:
        _last = (weakref.ref(ops), weakref.ref(calls), res[0], res[1])
    except TypeError:
        _last = None
    return res


def _analyse_uncached(ops: pa.Table, calls: pa.Table) -> tuple[pa.Table, int]:
    if ops is None or ops.num_rows == 0:
        return S.empty("casts"), 0
    # candidates: rows with more than one distinct dtype among inputs and outputs
    idx = drop_noise(ops, _mixed_dtype_rows(ops))
    with NoGC():
        rows = take_rows(ops, idx, _COLS)
        wanted = {r["call_id"] for r in rows if r.get("call_id") is not None and r["call_id"] >= 0}
        names, autocast = _calls_of(calls, wanted)
        return _cast_rows(rows, names, autocast)


def _calls_of(calls: Optional[pa.Table], wanted: set[int]) -> tuple[dict[int, Optional[str]], dict[int, Any]]:
    """(call id -> name, call id -> autocast state) of the calls ``wanted`` (the candidate rows' calls:
    few), read a record batch at a time; an id's first call in table order names it. Autocast states of
    every call that ran under autocast (usually none)."""
    names: dict[int, Optional[str]] = {}
    autocast: dict[int, Any] = {}
    if calls is None or calls.num_rows == 0:
        return names, autocast
    want = np.array(sorted(wanted), np.int64)
    cols = ["call_id", "name"] + (["autocast"] if "autocast" in calls.column_names else [])
    for b in row_batches(calls, cols):
        if len(cols) == 3:
            ac = b.column(2)
            on = pc.invert(pc.or_kleene(pc.is_null(ac), pc.equal(ac, "")))
            if pc.any(on).as_py():   # only the calls that ran under autocast: no per-call Python work
                sel = b.filter(on)
                for cid, state in zip(sel.column(0).to_pylist(), sel.column(2).to_pylist()):
                    autocast[cid] = state
        if len(want):
            ids = np.asarray(pc.fill_null(b.column(0), -1).to_numpy(zero_copy_only=False), np.int64)
            for i in np.flatnonzero(np.isin(ids, want)).tolist():
                names.setdefault(int(ids[i]), b.column(1)[i].as_py())
    return names, autocast


def _cast_rows(rows: list[dict[str, Any]], names: dict[int, Optional[str]],
               autocast: Any) -> tuple[pa.Table, int]:
    out: dict[str, list[Any]] = {f.name: [] for f in S.CASTS}
    #: kind of each forward materialised cast by seq (backward casts inherit it)
    fwd_kind: dict[int, str] = {}
    #: output storage of a materialised cast -> (row index in out, from_dtype, to_dtype)
    produced_by: dict[int, tuple[int, str, str]] = {}
    round_trip: list[bool] = []
    pairs = [0]

    def emit(r: dict[str, Any], frm: str, to: str, kind: str, n: int, produced: Optional[bool] = None,
             src_storage: Optional[int] = None, dst_storage: Optional[int] = None) -> None:
        cid = r.get("call_id")
        k = len(out["seq"])
        out["seq"].append(r["seq"])
        out["op"].append(r["op"])
        out["call"].append(names.get(cid) if cid is not None else None)
        out["from_dtype"].append(frm)
        out["to_dtype"].append(to)
        out["kind"].append(kind)
        out["direction"].append(direction(frm, to))
        out["numel"].append(int(n))
        out["bytes"].append(int(n) * itemsize(to))
        out["nonfinite_produced"].append(produced)
        out["module"].append(r.get("module"))
        out["source_file"].append(r.get("source_file"))
        out["source_line"].append(r.get("source_line"))
        round_trip.append(False)
        # a -> b -> a on the same data: this cast reads the storage an earlier b-cast wrote
        if src_storage is not None and src_storage >= 0:
            prev = produced_by.get(src_storage)
            if prev is not None and prev[2] == frm and prev[1] == to:
                round_trip[prev[0]] = True
                round_trip[k] = True
                pairs[0] += 1
        if dst_storage is not None and dst_storage >= 0:
            produced_by[dst_storage] = (k, frm, to)

    for r in rows:
        name = short_name(r["op"])
        in_dt = r.get("in_dtypes") or []
        out_dt = r.get("out_dtypes") or []
        in_sh = r.get("in_shapes") or []
        out_sh = r.get("out_shapes") or []
        in_st = r.get("in_storages") or []
        out_st = r.get("out_storages") or []
        alias = r.get("out_alias") or []
        cid = r.get("call_id")
        call = names.get(cid) if cid is not None else None
        # screened ops: False when finite, the op's verdict otherwise; null when not screened
        nf = r.get("nonfinite")
        produced = None if nf is None else (bool(r.get("nonfinite_produced")) if nf > 0 else False)
        if name in CAST_OPS:
            if not in_dt or not out_dt or in_dt[0] == out_dt[0]:
                continue
            if alias and alias[0] is not None and alias[0] >= 0:
                continue   # an aliasing aten.to: no conversion happened
            if r.get("phase") == "backward":
                fwd = r.get("fwd_seq")
                kind = fwd_kind.get(fwd, "explicit") if fwd is not None else "explicit"
            elif cid in autocast and call not in USER_CAST_CALLS:
                kind = "autocast"
            else:
                kind = "explicit"
            fwd_kind[r["seq"]] = kind
            emit(r, in_dt[0], out_dt[0], kind, numel(out_sh[0]) if out_sh else 0, produced,
                 in_st[0] if in_st else None, out_st[0] if out_st else None)
            continue
        if name in COPY_INTO_OPS:
            if len(in_dt) < 2 or in_dt[0] == in_dt[1]:
                continue
            dst, src = in_dt[0], in_dt[1]
            d = direction(src, dst)
            kind = "implicit_downcast" if (d in _NARROWING and call != "copy_") else "copy"
            emit(r, src, dst, kind, numel(in_sh[0]) if in_sh else 0, produced,
                 in_st[1] if len(in_st) > 1 else None, in_st[0] if in_st else None)
            continue
        if r.get("is_view"):
            continue
        tags = r.get("tags") or []
        if not ("pointwise" in tags or name in PROMOTING_OPS or name.rstrip("_") in PROMOTING_OPS):
            continue
        # which inputs are written (in-place self, out= tensors): from out_alias
        written = sorted({a for a in alias if a is not None and a >= 0})
        is_out = "out" in tags or (r.get("overload") or "").startswith("out")
        reads = [i for i in range(len(in_dt)) if not (is_out and i in written)]
        if written and r.get("inplace"):
            comp = computation_dtype([in_dt[i] for i in reads], [in_sh[i] for i in reads])
        else:
            comp = out_dt[0] if out_dt else None
        if comp is None or _category(comp) <= 0:
            continue   # comparisons and masks: bool results
        for i in reads:
            dt = in_dt[i]
            if dt == comp or _category(dt) <= 0 or len(in_sh[i]) == 0 or i in written:
                continue
            emit(r, dt, comp, "promotion", numel(in_sh[i]))
        if written and r.get("inplace"):
            for w in written:
                if w < len(in_dt) and in_dt[w] != comp:
                    d = direction(comp, in_dt[w])
                    emit(r, comp, in_dt[w], "implicit_downcast" if d in _NARROWING else "promotion",
                         numel(in_sh[w]), produced)
    out["round_trip"] = round_trip
    return pa.Table.from_pydict(out, schema=S.CASTS), pairs[0]


def _mixed_dtype_rows(ops: pa.Table) -> np.ndarray:
    """Rows whose inputs and outputs do not all share one dtype (vectorised prefilter), a record batch
    at a time: each dtype name gets one id (a lookup per distinct name), each row the least and
    greatest id of its inputs and outputs (``reduceat`` over the flattened lists)."""
    if ops.num_rows == 0:
        return np.zeros(0, np.int64)
    ids: dict[Any, int] = {}
    found = []
    base = 0
    for batch in ops.select(["in_dtypes", "out_dtypes"]).to_batches():
        n = batch.num_rows
        if _one_dtype(batch):   # every input and output of the batch has one dtype: no row is mixed
            base += n
            continue
        lo = np.full(n, np.iinfo(np.int64).max)
        hi = np.full(n, -1)
        for col in batch.columns:
            flat = pc.list_flatten(col)
            if len(flat) == 0:
                continue
            codes, values = codes_of(flat)
            lut = np.array([ids.setdefault(v, len(ids)) for v in values] + [ids.setdefault(None, len(ids))],
                           dtype=np.int64)
            g = lut[codes]
            parents = np.asarray(pc.list_parent_indices(col).to_numpy(), dtype=np.int64)
            starts = np.flatnonzero(np.concatenate(([True], parents[1:] != parents[:-1])))
            rows = parents[starts]
            lo[rows] = np.minimum(lo[rows], np.minimum.reduceat(g, starts))
            hi[rows] = np.maximum(hi[rows], np.maximum.reduceat(g, starts))
        found.append(np.flatnonzero((hi >= 0) & (lo != hi)) + base)
        base += n
    return np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)


def _one_dtype(batch: pa.RecordBatch) -> bool:
    """Whether a batch's dictionary-encoded dtype lists name one dtype only, none null (a homogeneous
    stretch of a trace: decided from the dictionaries, without reading the rows)."""
    seen: set[Any] = set()
    for col in batch.columns:
        if not (pa.types.is_list(col.type) and pa.types.is_dictionary(col.type.value_type)):
            return False
        values = col.values   # the lists' elements (a sliced batch's too: a superset of its rows')
        if values.null_count:
            return False
        seen.update(values.dictionary.to_pylist())
        if len(seen) > 1:
            return False
    return True
