"""The torch API versus ATen: what each torch-level call became at the dispatcher.

``api_table(ops, calls)`` is a pure function of the two recorded tables. One
row per (torch-level API, ATen op it dispatched): how many calls the API had,
how many of them dispatched no op at all (no-op conversions such as
``.float()`` on float32 or ``.contiguous()`` on a contiguous tensor), the op's
count and ops per call, its CPU time, whether the op is core ATen
(``torch.Tag.core``: what export and backends are written against), and how
many of its rows were hidden copies. An API none of whose calls dispatched an
op gets one row with ``op`` null. Ops are attributed to the innermost
torch-level call around them (``ops.call_id``); ops outside any call are not
in the table, and neither are calls made by torch.compile'd code (``calls.compiled``).
``surprising(api)`` ranks the APIs whose ATen ops do more work than
their own op: hidden copies, extra copies beside the API's own op, a
decomposition into many ops per call. An in-place or out= variant, a
non-core overload or any 1:1 mapping (``Tensor.add_ → aten.add_.Tensor``,
``Tensor.sum → aten.sum.default``) is not surprising.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .._common import NOISE_OPS
from .opview import add_exact, codes_of
from .totals import row_batches


def _core_rows(tags: Any) -> np.ndarray:
    """Per row of a list-of-strings ``tags`` column: whether ``core`` is among them (column-wise)."""
    tags = tags.combine_chunks() if isinstance(tags, pa.ChunkedArray) else tags
    out = np.zeros(len(tags), dtype=bool)
    if len(tags) == 0:
        return out
    flat = pc.list_flatten(tags)
    parents = np.asarray(pc.list_parent_indices(tags).to_numpy(), dtype=np.int64)
    if pa.types.is_dictionary(flat.type):   # compared once per distinct tag, broadcast through the codes
        codes, values = codes_of(flat)
        hit = np.array([v == "core" for v in values] + [False], dtype=bool)[codes]
    else:
        hit = np.asarray(pc.fill_null(pc.equal(flat, "core"), False).to_numpy(zero_copy_only=False), dtype=bool)
    out[parents[hit]] = True
    return out


def _api_codes(calls: pa.Table) -> tuple[np.ndarray, list[str]]:
    """(per call an index into the APIs, the APIs): a call's API is its qualname, else its name, else
    ``"?"`` (an empty string names nothing). Decided once per distinct (qualname, name) pair and
    broadcast through the dictionary codes: no string per call."""
    qc, qv = codes_of(calls.column("qualname"))
    nc, nv = codes_of(calls.column("name"))
    width = len(nv) + 1
    pair = (qc + 1) * width + (nc + 1)          # code -1 (null) -> 0
    if (len(qv) + 1) * width <= 1 << 22:       # few distinct pairs possible: a dense lookup, no sort
        space = np.zeros((len(qv) + 1) * width, np.int64)
        space[pair] = 1
        uniq = np.flatnonzero(space)
        inv = None
    else:
        uniq, inv = np.unique(pair, return_inverse=True)
    where: dict[str, int] = {}
    lut = np.empty(len(uniq), np.int64)
    for i, p in enumerate(uniq.tolist()):
        q = qv[p // width - 1] if p // width else None
        n = nv[p % width - 1] if p % width else None
        lut[i] = where.setdefault(q or n or "?", len(where))
    if inv is None:
        space[uniq] = lut
        codes = space[pair]
    else:
        codes = lut[inv]
    return codes, list(where)


def api_table(ops: pa.Table, calls: pa.Table) -> pa.Table:
    """One row per (torch-level API, ATen op it dispatched); built column-wise (a trace of small ops
    has one call per op: no per-call or per-op Python work), both tables a record batch at a time.

    What it keeps per call is one slot of ``_Slots`` (2 bytes for up to 8191 APIs): a call id's API and
    two flags, so a 10 M-call trace costs ~20 MB whatever its batches; the rest is per API or per
    (API, op). Calls made by torch.compile'd code are skipped row by row (no filtered copy)."""
    if calls.num_rows == 0:
        return S.empty("api")
    slots = _Slots(calls)
    where: dict[str, int] = {}                  # API -> its index
    api_calls = np.zeros(0, np.int64)
    api_name_of: list[Any] = []                 # the name of each API's first call
    for b, keep in _call_batches(calls):
        codes = _batch_apis(b, keep, where, api_name_of)
        if len(api_calls) < len(where):
            api_calls = np.concatenate([api_calls, np.zeros(len(where) - len(api_calls), np.int64)])
        api_calls += np.bincount(codes[keep], minlength=len(api_calls))
        slots.claim(b.column("call_id"), codes, keep, len(where))
    n_api = len(where)
    if n_api == 0 or not api_calls.any():
        return S.empty("api")
    api_names = list(where)
    # per (API, op): [ops with a CPU time, their CPU time, any core, hidden copies]; a record batch at a time
    groups: dict[tuple[int, Any], list[int]] = {}
    if ops.num_rows:
        for b in row_batches(ops, ["call_id", "op", "cpu_ns", "tags", "hidden_copy"]):
            _api_batch(b, slots, groups)
    # per API: its calls that dispatched nothing (no op of their own, no op counted by the recorder)
    api_no_op = np.zeros(n_api, np.int64)
    for b, keep in _call_batches(calls):
        codes = _batch_apis(b, keep, where, api_name_of)
        direct = slots.owned_with_ops(b.column("call_id"), keep)
        n_ops = (np.asarray(pc.fill_null(b.column("n_ops"), -1).to_numpy(zero_copy_only=False), np.int64)
                 if "n_ops" in b.schema.names else np.full(b.num_rows, -1, np.int64))
        # total = n_ops where recorded, else the ops attributed directly: nothing dispatched when both are 0
        no_op = keep & (n_ops <= 0) & ~direct
        api_no_op += np.bincount(codes[no_op], minlength=n_api)
    rows: list[dict[str, Any]] = []
    seen_api = np.zeros(n_api, dtype=bool)
    for (c, op), (n_ops_c, cpu, core, hidden) in groups.items():   # one row per (API, op): few
        seen_api[c] = True
        n = int(api_calls[c])
        rows.append(dict(qualname=api_names[c], name=api_name_of[c], n_calls=n, no_op_calls=int(api_no_op[c]),
                         op=op, n_ops=n_ops_c, ops_per_call=n_ops_c / max(n, 1), cpu_ns=cpu if n_ops_c else None,
                         core=bool(core), hidden_copies=hidden))
    for c in np.nonzero(~seen_api)[0].tolist():
        rows.append(dict(qualname=api_names[c], name=api_name_of[c], n_calls=int(api_calls[c]),
                         no_op_calls=int(api_no_op[c]), op=None, n_ops=0, ops_per_call=0.0, cpu_ns=0, core=None,
                         hidden_copies=0))
    rows.sort(key=lambda r: (-(r["cpu_ns"] or 0), r["qualname"], r["op"] or ""))
    return pa.Table.from_pylist(rows, schema=S.API) if rows else S.empty("api")


def _call_batches(calls: pa.Table) -> Iterator[tuple[pa.RecordBatch, np.ndarray]]:
    """(batch, per row: not made by torch.compile'd code) of the columns ``api_table`` reads of ``calls``."""
    names = [c for c in ("call_id", "qualname", "name", "n_ops", "compiled") if c in calls.column_names]
    for b in row_batches(calls, names):
        if "compiled" in names:
            keep = ~np.asarray(pc.fill_null(b.column("compiled"), False).to_numpy(zero_copy_only=False), bool)
        else:
            keep = np.ones(b.num_rows, bool)
        yield b, keep


def _batch_apis(b: pa.RecordBatch, keep: np.ndarray, where: dict[str, int], first_name: list[Any]) -> np.ndarray:
    """Per call of batch ``b``, the index of its API in ``where`` (-1 for an API only compiled calls of
    the batch have); an API first seen here is added, with the name of its first kept call in
    ``first_name``."""
    local, names = _api_codes(b)
    used = np.zeros(len(names) + 1, bool)
    used[local[keep]] = True
    glob = np.full(len(names) + 1, -1, np.int64)      # the last: a row of no API (never: every call has one)
    for j in np.flatnonzero(used[:-1]).tolist():
        g = where.get(names[j])
        if g is None:                                  # first seen here: the name of its first kept call
            g = where[names[j]] = len(where)
            first_name.append(b.column("name")[int(np.flatnonzero((local == j) & keep)[0])].as_py())
        glob[j] = g
    out: np.ndarray = glob[local]
    return out


class _Slots:
    """Per call id (``call_id - lo``, dense: a trace's ids run 0..n), the API of its first kept call and
    two flags, in one int16 (int32 past 8191 APIs): ``DIRECT``, an op was attributed to it; ``SEEN``,
    its first call was met again by the second pass. Ids past ``64 x calls + 1M`` of the range (a
    table whose ids are not a trace's) are looked up through their sorted distinct values instead."""

    def __init__(self, calls: pa.Table) -> None:
        ids = calls.column("call_id")
        lo, hi = pc.min(ids).as_py(), pc.max(ids).as_py()
        self.lo = 0 if lo is None else max(0, int(lo))
        span = 0 if hi is None or hi < 0 else int(hi) - self.lo + 1
        self.sparse: Optional[np.ndarray] = None
        if span > 64 * calls.num_rows + (1 << 20):
            self.sparse = np.unique(np.asarray(pc.drop_null(ids).to_numpy(), np.int64))
            self.sparse = self.sparse[self.sparse >= 0]
            self.lo, span = 0, len(self.sparse)
        self._bits(np.int16)
        self.v = np.zeros(span, self.dtype)

    def _bits(self, dtype: Any) -> None:
        self.dtype = dtype
        width = np.iinfo(dtype).bits
        self.DIRECT, self.SEEN = 1 << (width - 3), 1 << (width - 2)
        self.MASK = self.DIRECT - 1

    def slot(self, col: Any) -> tuple[np.ndarray, np.ndarray]:
        """(per row: the id's slot, whether it has one) of a batch's ``call_id`` column."""
        ids = np.asarray(pc.fill_null(col, -1).to_numpy(zero_copy_only=False), np.int64)
        if self.sparse is not None:
            k = np.minimum(np.searchsorted(self.sparse, ids), max(len(self.sparse) - 1, 0))
            ok = (ids >= 0) & (self.sparse[k] == ids) if len(self.sparse) else np.zeros(len(ids), bool)
            return k, ok
        s = ids - self.lo
        ok = (ids >= 0) & (s >= 0) & (s < len(self.v))
        return np.where(ok, s, 0), ok

    def claim(self, col: Any, apis: np.ndarray, keep: np.ndarray, n_api: int) -> None:
        """Give each kept call's id its API, unless an earlier call has it."""
        if n_api > self.MASK - 1 and self.dtype is np.int16:   # more APIs than an int16 slot holds
            self.v = self.v.astype(np.int32)
            self._bits(np.int32)
        s, ok = self.slot(col)
        ok &= keep
        s, a = s[ok], apis[ok]
        first = _first_of_each(s)
        s, a = s[first], a[first]
        free = self.v[s] == 0
        self.v[s[free]] = (a[free] + 1).astype(self.dtype)

    def api_of(self, col: Any) -> tuple[np.ndarray, np.ndarray]:
        """(per row: the API of the call its id names, whether there is one); marks those calls ``DIRECT``."""
        s, ok = self.slot(col)
        v = self.v[s[ok]] & self.MASK
        has = np.zeros(len(ok), bool)
        has[np.flatnonzero(ok)[v > 0]] = True
        s = s[has]
        self.v[s] |= self.DIRECT
        return (self.v[s] & self.MASK).astype(np.int64) - 1, has

    def owned_with_ops(self, col: Any, keep: np.ndarray) -> np.ndarray:
        """Per kept row: whether it is the first kept call of its id (the one its ops were attributed
        to) and an op was; each id's first call met is marked ``SEEN``."""
        s, ok = self.slot(col)
        ok &= keep
        rows = np.flatnonzero(ok)
        first = _first_of_each(s[rows])
        rows = rows[first]
        v = self.v[s[rows]]
        owner = (v & self.SEEN) == 0
        rows = rows[owner]
        self.v[s[rows]] |= self.SEEN
        out = np.zeros(len(ok), bool)
        out[rows] = (self.v[s[rows]] & self.DIRECT) != 0
        return out


def _first_of_each(ids: np.ndarray) -> np.ndarray:
    """Indices of the first occurrence of each value of ``ids`` (all of them when the ids increase, as
    a trace's calls do: no sort then)."""
    if len(ids) < 2 or bool(np.all(ids[1:] > ids[:-1])):
        return np.arange(len(ids))
    return np.sort(np.unique(ids, return_index=True)[1])


def _api_batch(b: pa.RecordBatch, slots: _Slots, groups: dict[tuple[int, Any], list[int]]) -> None:
    """One record batch of ops into ``groups`` (per (API, op name)); their calls marked ``DIRECT``."""
    api, ok = slots.api_of(b.column("call_id"))
    if not ok.any():
        return
    codes, names = codes_of(b.column("op"))
    width = len(names) + 1
    key = api * width + (codes[ok] + 1)          # (API, op code); null op -> 0
    uniq, inv = np.unique(key, return_inverse=True)
    cpu_col = b.column("cpu_ns")
    has_cpu = np.asarray(pc.is_valid(cpu_col).to_numpy(zero_copy_only=False), dtype=bool)[ok]
    cpu = np.asarray(pc.fill_null(cpu_col, 0).to_numpy(zero_copy_only=False), dtype=np.int64)[ok]
    n_ops = np.bincount(inv, weights=has_cpu.astype(np.float64), minlength=len(uniq)).astype(np.int64)
    cpu_sum = np.zeros(len(uniq), np.int64)
    add_exact(cpu_sum, inv, cpu)
    core = np.bincount(inv, weights=_core_rows(b.column("tags"))[ok].astype(np.float64), minlength=len(uniq)) > 0
    hidden = np.asarray(pc.fill_null(b.column("hidden_copy"), False).to_numpy(zero_copy_only=False), dtype=bool)[ok]
    n_hidden = np.bincount(inv, weights=hidden.astype(np.float64), minlength=len(uniq)).astype(np.int64)
    for j, key_j in enumerate(uniq.tolist()):
        c, o = divmod(key_j, width)
        g = groups.setdefault((c, names[o - 1] if o else None), [0, 0, 0, 0])
        g[0] += int(n_ops[j])
        g[1] += int(cpu_sum[j])
        g[2] |= int(core[j])
        g[3] += int(n_hidden[j])


def surprising(api: pa.Table, *, min_ops_per_call: float = 4.0, k: int = 8) -> list[dict[str, Any]]:
    """APIs whose ATen ops do more work than their own op, most surprising first.

    Reasons: hidden copies under it; extra copies (a copy op beside another op of the
    same API: the copy is not what the API is for); more than ``min_ops_per_call`` ATen
    ops per call (a decomposition). Non-core overloads, in-place/out variants and 1:1
    mappings are not reasons (``non_core`` lists them for reference). ``backward`` (the whole
    autograd graph) and bookkeeping ops (``detach``, ``alias``…) are left out.
    """
    by: dict[str, dict[str, Any]] = {}
    for r in api.to_pylist():
        a = by.setdefault(r["qualname"], dict(api=r["qualname"], n_calls=r["n_calls"], no_op=r["no_op_calls"],
                                               ops=[], per_call=0.0, hidden=0, non_core=[], cpu_ns=0,
                                               copies=[]))
        if r["op"] is None or r["op"].split(".")[1:2] and r["op"].split(".")[1] in _BOOKKEEPING:
            continue
        a["ops"].append((r["op"], r["n_ops"]))
        if r["op"].split(".")[1] not in _VIEWS:   # a view moves no data: not part of a decomposition's work
            a["per_call"] += r["ops_per_call"]
        a["hidden"] += r["hidden_copies"] or 0
        a["cpu_ns"] += r["cpu_ns"] or 0
        short = r["op"].split(".")
        if len(short) > 1 and short[1] in _COPIES:
            # copies not already counted as hidden ones
            a["copies"].append((r["op"], max(0, (r["n_ops"] or 0) - (r["hidden_copies"] or 0))))
        if not r["core"] and short[0] == "aten" and (len(short) < 2 or short[1] not in _BOOKKEEPING):
            a["non_core"].append(r["op"])
    out = []
    for a in by.values():
        if a["api"].endswith(".backward"):
            continue   # backward runs the whole autograd graph: its expansion is the model's, not an API's
        reasons = []
        if a["hidden"] and len(a["ops"]) == len(a["copies"]):
            a["hidden"] = 0   # contiguous()/clone() copying: the copy is the API's own op
        if a["hidden"]:
            reasons.append(f"{a['hidden']} hidden copies")
        # a copy beside another op of the API is extra work; a copy that is the API's only op is its own op
        extra = sum(n for _op, n in a["copies"]) if len(a["ops"]) > len(a["copies"]) else 0
        if extra:
            names = ", ".join(sorted({op.split(".")[1] for op, n in a["copies"] if n}))
            reasons.append(f"{extra} extra cop{'y' if extra == 1 else 'ies'} ({names})")
        if a["per_call"] > min_ops_per_call:
            reasons.append(f"{a['per_call']:.1f} ATen ops per call")
        if not reasons:
            continue
        a["reasons"] = reasons
        a["score"] = (a["hidden"] > 0, extra > 0, a["per_call"])
        out.append(a)
    out.sort(key=lambda a: a["score"], reverse=True)
    return out[:k]


#: ops every eager program shows that say nothing about an API's expansion: the noise ops (rows flagged
#: ``is_noise``, never a finding's subject) and ``t``
_BOOKKEEPING = NOISE_OPS | {"t"}
#: views: no data moved (an API that dispatches a compute op and a few views is one op of work)
_VIEWS = frozenset({"view", "expand", "t", "permute", "unsqueeze", "squeeze", "_unsafe_view", "as_strided", "slice",
                    "select", "transpose", "alias", "_reshape_alias", "narrow", "unflatten", "expand_as", "view_as",
                    "split", "split_with_sizes", "unbind", "chunk", "diagonal", "movedim", "unfold", "detach",
                    "view_as_real", "view_as_complex", "_conj", "_neg_view", "lift_fresh"})
#: ops that copy data: extra work when an API dispatches them beside its own op
_COPIES = frozenset({"clone", "_to_copy", "copy_", "contiguous", "_copy_from", "_copy_from_and_resize"})
