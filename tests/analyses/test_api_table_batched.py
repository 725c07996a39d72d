"""``api_table`` reads the ops a record batch at a time: the same table from several batches (an op name
in one batch only, empty batches, nulls, sums past 2**53) as from one, and as a plain Python count."""
from __future__ import annotations

import pyarrow as pa

from tensorscope.analyses.api import api_table

_OPS = pa.schema([("call_id", pa.int64()), ("op", pa.dictionary(pa.int32(), pa.string())),
                  ("cpu_ns", pa.int64()), ("tags", pa.list_(pa.dictionary(pa.int32(), pa.string()))),
                  ("hidden_copy", pa.bool_())])
_BIG = 2**60 + 1


def _ops_batches() -> list[pa.RecordBatch]:
    rows = [
        [(1, "aten.add.Tensor", 5, ["core"], False), (2, "aten.clone.default", 7, [], True),
         (1, "aten.add.Tensor", _BIG, ["core", "pointwise"], None), (None, "aten.mul.Tensor", 3, ["core"], False),
         (3, None, 2, None, False)],
        [],
        [(2, "aten.only_here.default", None, [], False), (9, "aten.add.Tensor", 4, ["core"], False),   # no call 9
         (4, "aten.add.Tensor", _BIG, [], False)],
        [(2, "aten.clone.default", None, ["core"], True), (3, None, None, [], False)],
        [],
    ]
    return [pa.RecordBatch.from_pylist([dict(zip(_OPS.names, r)) for r in b], schema=_OPS) for b in rows]


def _calls() -> pa.Table:
    return pa.table({"call_id": [1, 2, 3, 4, 5], "qualname": ["torch.add", None, "Tensor.foo", "torch.add", None],
                     "name": ["add", "clone", "foo", "add", ""], "n_ops": [None, 2, None, None, 0]})


def _reference(ops: pa.Table, calls: pa.Table) -> dict:
    api = {c["call_id"]: c["qualname"] or c["name"] or "?" for c in calls.to_pylist()}
    out: dict = {}
    for r in ops.to_pylist():
        if r["call_id"] not in api:
            continue
        g = out.setdefault((api[r["call_id"]], r["op"]), {"n_ops": 0, "cpu_ns": None, "core": False, "hidden": 0})
        if r["cpu_ns"] is not None:
            g["n_ops"] += 1
            g["cpu_ns"] = (g["cpu_ns"] or 0) + r["cpu_ns"]
        g["core"] |= "core" in (r["tags"] or [])
        g["hidden"] += bool(r["hidden_copy"])
    return out


def test_batched_equals_one_batch_and_a_python_count():
    ops = pa.Table.from_batches(_ops_batches(), schema=_OPS)
    assert ops.column("op").num_chunks > 1
    calls = _calls()
    got = api_table(ops, calls)
    assert got.to_pylist() == api_table(ops.combine_chunks(), calls).to_pylist()
    unified = ops.unify_dictionaries()
    assert got.to_pylist() == api_table(unified, calls).to_pylist()
    groups = {(r["qualname"], r["op"]): {"n_ops": r["n_ops"], "cpu_ns": r["cpu_ns"], "core": r["core"],
                                         "hidden": r["hidden_copies"]} for r in got.to_pylist() if r["n_ops"] or r["op"]}
    assert groups == _reference(ops, calls)
    by = {(r["qualname"], r["op"]): r for r in got.to_pylist()}
    assert by[("torch.add", "aten.add.Tensor")]["cpu_ns"] == 2 * _BIG + 5      # exact int64 sums
    assert by[("clone", "aten.only_here.default")]["cpu_ns"] is None           # no CPU time in the group
    assert by[("clone", "aten.clone.default")]["hidden_copies"] == 2
    assert by[("?", None)]["n_calls"] == 1 and by[("?", None)]["no_op_calls"] == 1   # call 5: no op
    assert by[("Tensor.foo", None)]["n_ops"] == 1                              # null op names: a group
    keys = [(-(r["cpu_ns"] or 0), r["qualname"], r["op"] or "") for r in got.to_pylist()]
    assert keys == sorted(keys)


def test_no_op_inside_a_call():
    ops = pa.Table.from_batches([b for b in _ops_batches() if b.num_rows == 0], schema=_OPS)
    got = api_table(ops, _calls())
    assert {r["op"] for r in got.to_pylist()} == {None} and got.num_rows == 4
