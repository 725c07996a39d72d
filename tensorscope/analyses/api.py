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

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S
from .._common import NOISE_OPS
from .opview import add_exact, codes_of


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
    has one call per op: no per-call or per-op Python work)."""
    if calls.num_rows and "compiled" in calls.column_names:
        # calls made by torch.compile'd code (Inductor's extern kernels) are the compiler's, not the user's API use
        compiled = pc.fill_null(calls.column("compiled"), False)
        if pc.any(compiled).as_py():   # (a filter copies every column: only when there is something to drop)
            calls = calls.filter(pc.invert(compiled))
    if calls.num_rows == 0:
        return S.empty("api")
    n_calls_total = calls.num_rows
    api_codes, api_names = _api_codes(calls)
    n_api = len(api_names)
    first_call = np.full(n_api, n_calls_total, dtype=np.int64)
    np.minimum.at(first_call, api_codes, np.arange(n_calls_total, dtype=np.int64))
    # the name of each API's first call
    api_name_of = S.plain_strings(calls.select(["name"]).take(pa.array(first_call))).column("name").to_pylist()
    n_ops_col = (np.asarray(pc.fill_null(calls.column("n_ops"), -1).to_numpy(), dtype=np.int64)
                 if "n_ops" in calls.column_names else None)
    call_ids = np.asarray(pc.fill_null(calls.column("call_id"), -1).to_numpy(), dtype=np.int64)
    order = np.argsort(call_ids, kind="stable")
    sorted_ids = call_ids[order]
    # per call: the ops attributed to it directly (ops.call_id)
    direct = np.zeros(n_calls_total, np.int64)
    # per (API, op): [ops with a CPU time, their CPU time, any core, hidden copies]; a record batch at a time
    groups: dict[tuple[int, Any], list[int]] = {}
    if ops.num_rows:
        for b in ops.select(["call_id", "op", "cpu_ns", "tags", "hidden_copy"]).to_batches():
            _api_batch(b, sorted_ids, order, api_codes, direct, groups)
    total = np.where(n_ops_col >= 0, n_ops_col, direct) if n_ops_col is not None else direct
    no_op_call = (total == 0) & (direct == 0)
    api_calls = np.bincount(api_codes, minlength=n_api)
    api_no_op = np.bincount(api_codes, weights=no_op_call.astype(np.float64), minlength=n_api).astype(np.int64)
    rows: list[dict[str, Any]] = []
    seen_api = np.zeros(n_api, dtype=bool)
    for (c, op), (n_ops, cpu, core, hidden) in groups.items():   # one row per (API, op): few
        seen_api[c] = True
        n = int(api_calls[c])
        rows.append(dict(qualname=api_names[c], name=api_name_of[c], n_calls=n, no_op_calls=int(api_no_op[c]),
                         op=op, n_ops=n_ops, ops_per_call=n_ops / max(n, 1), cpu_ns=cpu if n_ops else None,
                         core=bool(core), hidden_copies=hidden))
    for c in np.nonzero(~seen_api)[0].tolist():
        rows.append(dict(qualname=api_names[c], name=api_name_of[c], n_calls=int(api_calls[c]),
                         no_op_calls=int(api_no_op[c]), op=None, n_ops=0, ops_per_call=0.0, cpu_ns=0, core=None,
                         hidden_copies=0))
    rows.sort(key=lambda r: (-(r["cpu_ns"] or 0), r["qualname"], r["op"] or ""))
    return pa.Table.from_pylist(rows, schema=S.API) if rows else S.empty("api")


def _api_batch(b: pa.RecordBatch, sorted_ids: np.ndarray, order: np.ndarray, api_codes: np.ndarray,
               direct: np.ndarray, groups: dict[tuple[int, Any], list[int]]) -> None:
    """One record batch of ops into ``direct`` (ops per call) and ``groups`` (per (API, op name))."""
    oc = np.asarray(pc.fill_null(b.column("call_id"), -1).to_numpy(zero_copy_only=False), dtype=np.int64)
    k = np.minimum(np.searchsorted(sorted_ids, oc), max(len(sorted_ids) - 1, 0))
    ok = (oc >= 0) & (sorted_ids[k] == oc)
    if not ok.any():
        return
    idx = order[k[ok]]
    direct += np.bincount(idx, minlength=len(direct))
    codes, names = codes_of(b.column("op"))
    width = len(names) + 1
    key = api_codes[idx] * width + (codes[ok] + 1)          # (API, op code); null op -> 0
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
