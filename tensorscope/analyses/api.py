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
``surprising(api)`` ranks the APIs whose expansion deserves a
look: hidden copies, many ops per call, non-core ops.
"""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S


def api_table(ops: pa.Table, calls: pa.Table) -> pa.Table:
    if calls.num_rows and "compiled" in calls.column_names:
        # calls made by torch.compile'd code (Inductor's extern kernels) are the compiler's, not the user's API use
        calls = calls.filter(pc.invert(pc.fill_null(calls.column("compiled"), False)))
    if calls.num_rows == 0:
        return S.empty("api")
    qual = calls.column("qualname").to_pylist()
    names = calls.column("name").to_pylist()
    n_ops_col = calls.column("n_ops").fill_null(-1).to_numpy() if "n_ops" in calls.column_names else None
    call_ids = calls.column("call_id").to_numpy()
    pos = {int(c): i for i, c in enumerate(call_ids)}
    # per API: calls, calls that dispatched nothing
    per_api: Dict[str, Dict[str, Any]] = {}
    direct = np.zeros(len(qual), np.int64)
    if ops.num_rows:
        oc = ops.column("call_id").fill_null(-1).to_numpy()
        idx = np.array([pos.get(int(c), -1) for c in oc], dtype=np.int64) if len(oc) else np.zeros(0, np.int64)
        ok = idx >= 0
        np.add.at(direct, idx[ok], 1)
    for i, q in enumerate(qual):
        q = q or names[i] or "?"
        a = per_api.setdefault(q, dict(name=names[i], n_calls=0, no_op=0))
        a["n_calls"] += 1
        total = n_ops_col[i] if n_ops_col is not None and n_ops_col[i] >= 0 else direct[i]
        if total == 0 and direct[i] == 0:
            a["no_op"] += 1
    rows: List[Dict[str, Any]] = []
    seen_api = set()
    if ops.num_rows:
        sel = np.nonzero(ok)[0]
        if len(sel):
            sub = ops.take(pa.array(sel))
            api_of = [qual[j] or names[j] or "?" for j in idx[sel]]
            tags = sub.column("tags").to_pylist()
            core = ["core" in (tg or []) for tg in tags]
            work = pa.table({
                "api": pa.array(api_of, pa.string()),
                "op": sub.column("op"),
                "cpu_ns": sub.column("cpu_ns"),
                "core": pa.array(core, pa.bool_()),
                "hidden": pc.cast(sub.column("hidden_copy").fill_null(False), pa.int64()),
            })
            g = work.group_by(["api", "op"]).aggregate([("cpu_ns", "sum"), ("cpu_ns", "count"), ("core", "max"),
                                                         ("hidden", "sum")])
            for r in g.to_pylist():
                a = per_api[r["api"]]
                seen_api.add(r["api"])
                rows.append(dict(qualname=r["api"], name=a["name"], n_calls=a["n_calls"], no_op_calls=a["no_op"],
                                 op=r["op"], n_ops=r["cpu_ns_count"],
                                 ops_per_call=r["cpu_ns_count"] / max(a["n_calls"], 1),
                                 cpu_ns=r["cpu_ns_sum"], core=bool(r["core_max"]), hidden_copies=r["hidden_sum"]))
    for q, a in per_api.items():
        if q not in seen_api:
            rows.append(dict(qualname=q, name=a["name"], n_calls=a["n_calls"], no_op_calls=a["no_op"], op=None,
                             n_ops=0, ops_per_call=0.0, cpu_ns=0, core=None, hidden_copies=0))
    rows.sort(key=lambda r: (-(r["cpu_ns"] or 0), r["qualname"], r["op"] or ""))
    return pa.Table.from_pylist(rows, schema=S.API) if rows else S.empty("api")


def surprising(api: pa.Table, *, min_ops_per_call: float = 4.0, k: int = 8) -> List[Dict[str, Any]]:
    """APIs whose expansion is worth a look, most surprising first.

    Reasons: hidden copies under it; more than ``min_ops_per_call`` ATen ops per
    call; non-core ATen ops. ``backward`` (the whole autograd graph) and bookkeeping
    ops (``detach``, ``alias``…) are left out.
    """
    by: Dict[str, Dict[str, Any]] = {}
    for r in api.to_pylist():
        a = by.setdefault(r["qualname"], dict(api=r["qualname"], n_calls=r["n_calls"], no_op=r["no_op_calls"],
                                               ops=[], per_call=0.0, hidden=0, non_core=[], cpu_ns=0))
        if r["op"] is None or r["op"].split(".")[1:2] and r["op"].split(".")[1] in _BOOKKEEPING:
            continue
        a["ops"].append((r["op"], r["n_ops"]))
        a["per_call"] += r["ops_per_call"]
        a["hidden"] += r["hidden_copies"] or 0
        a["cpu_ns"] += r["cpu_ns"] or 0
        short = r["op"].split(".")
        if not r["core"] and short[0] == "aten" and (len(short) < 2 or short[1] not in _BOOKKEEPING):
            a["non_core"].append(r["op"])
    out = []
    for a in by.values():
        if a["api"].endswith(".backward"):
            continue   # backward runs the whole autograd graph: its expansion is the model's, not an API's
        reasons = []
        if a["hidden"]:
            reasons.append(f"{a['hidden']} hidden copies")
        if a["per_call"] > min_ops_per_call:
            reasons.append(f"{a['per_call']:.1f} ATen ops per call")
        if a["non_core"]:
            reasons.append("non-core ATen: " + ", ".join(sorted(set(a["non_core"]))[:4]))
        if not reasons:
            continue
        a["reasons"] = reasons
        a["score"] = (a["hidden"] > 0, a["per_call"], len(a["non_core"]))
        out.append(a)
    out.sort(key=lambda a: a["score"], reverse=True)
    return out[:k]


#: ops every eager program shows that say nothing about an API's expansion
_BOOKKEEPING = frozenset({"detach", "lift_fresh", "alias", "lift_fresh_copy", "_local_scalar_dense", "t"})
