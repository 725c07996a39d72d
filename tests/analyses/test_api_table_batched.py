"""``api_table`` reads the ops a record batch at a time: the same table from several batches (an op name
in one batch only, empty batches, nulls, sums past 2**53) as from one, and as a plain Python count."""
from __future__ import annotations

import pyarrow as pa
import pytest

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


# -- the calls a record batch at a time -------------------------------------------------------------------

_CALLS = pa.schema([("call_id", pa.int64()), ("qualname", pa.dictionary(pa.int32(), pa.string())),
                    ("name", pa.dictionary(pa.int32(), pa.string())), ("n_ops", pa.int64()),
                    ("compiled", pa.bool_())])


def _calls_batches(rows: list, size: int) -> pa.Table:
    """``rows`` of calls as batches of ``size`` rows, each with dictionaries of its own (other codes)."""
    batches = []
    for lo in range(0, len(rows), size):
        part = rows[lo:lo + size]
        cols = {n: [r[i] for r in part] for i, n in enumerate(_CALLS.names)}
        arrays = []
        for f in _CALLS:
            v = cols[f.name]
            if pa.types.is_dictionary(f.type):   # each batch's dictionary in reverse order of first sight
                values = list(dict.fromkeys(x for x in v if x is not None))[::-1]
                arrays.append(pa.DictionaryArray.from_arrays(
                    pa.array([None if x is None else values.index(x) for x in v], pa.int32()), pa.array(values, pa.string())))
            else:
                arrays.append(pa.array(v, f.type))
        batches.append(pa.RecordBatch.from_arrays(arrays, schema=_CALLS))
    return pa.Table.from_batches(batches, schema=_CALLS)


def _reference_rows(ops: pa.Table, calls: pa.Table) -> list:
    """The api table's rows counted row by row in Python (the definition, not the implementation)."""
    kept = [c for c in calls.to_pylist() if not c["compiled"]]
    owner: dict = {}
    for i, c in enumerate(kept):
        if c["call_id"] is not None and c["call_id"] >= 0:
            owner.setdefault(c["call_id"], i)
    api = [c["qualname"] or c["name"] or "?" for c in kept]
    direct = [0] * len(kept)
    groups: dict = {}
    for r in ops.to_pylist():
        i = owner.get(r["call_id"]) if r["call_id"] is not None and r["call_id"] >= 0 else None
        if i is None:
            continue
        direct[i] += 1
        g = groups.setdefault((api[i], r["op"]), [0, 0, False, 0])
        g[0] += r["cpu_ns"] is not None
        g[1] += r["cpu_ns"] or 0
        g[2] |= "core" in (r["tags"] or [])
        g[3] += bool(r["hidden_copy"])
    n_calls: dict = {}
    no_op: dict = {}
    name: dict = {}
    for i, c in enumerate(kept):
        n_calls[api[i]] = n_calls.get(api[i], 0) + 1
        name.setdefault(api[i], c["name"])
        total = c["n_ops"] if c["n_ops"] is not None and c["n_ops"] >= 0 else direct[i]
        no_op[api[i]] = no_op.get(api[i], 0) + (total == 0 and direct[i] == 0)
    rows = [dict(qualname=a, name=name[a], n_calls=n_calls[a], no_op_calls=no_op[a], op=op, n_ops=g[0],
                 ops_per_call=g[0] / n_calls[a], cpu_ns=g[1] if g[0] else None, core=g[2], hidden_copies=g[3])
            for (a, op), g in groups.items()]
    rows += [dict(qualname=a, name=name[a], n_calls=n, no_op_calls=no_op[a], op=None, n_ops=0, ops_per_call=0.0,
                  cpu_ns=0, core=None, hidden_copies=0) for a, n in n_calls.items() if not any(k[0] == a for k in groups)]
    return sorted(rows, key=lambda r: (-(r["cpu_ns"] or 0), r["qualname"], r["op"] or ""))


def _call_rows(offset: int = 0) -> list:
    """Calls: duplicate ids (the first kept call owns the ops), compiled calls (skipped, one of them
    the first call of an id), null and negative ids, n_ops recorded or not, an API only compiled code
    calls, APIs first seen in a later batch."""
    return [(offset + 1, "torch.add", "add", None, False), (offset + 2, None, "clone", 2, False),
            (offset + 3, "Tensor.foo", "foo", None, None), (offset + 4, "torch.add", "add", None, False),
            (offset + 5, None, "", 0, False), (offset + 2, "torch.dup", "dup", None, False),
            (offset + 6, "torch.compiled_only", "c", 0, True), (offset + 7, "torch.add", "add_", 0, True),
            (offset + 7, "torch.late", "late", None, False), (None, "torch.nullid", "n", None, False),
            (-3, "torch.neg", "neg", 0, False), (offset + 8, "torch.add", "add2", 0, False),
            (offset + 9, "torch.late", "late2", 5, False)]


def _ops_for(offset: int) -> pa.Table:
    rows = [(offset + 1, "aten.add.Tensor", 5, ["core"], False), (offset + 2, "aten.clone.default", 7, [], True),
            (offset + 7, "aten.mul.Tensor", 3, ["core"], False), (offset + 6, "aten.x.default", 1, [], False),
            (offset + 2, None, None, None, None), (offset + 3, "aten.add.Tensor", _BIG, [], False),
            (None, "aten.add.Tensor", 9, [], False), (offset + 99, "aten.add.Tensor", 9, [], False)]
    return pa.Table.from_pylist([dict(zip(_OPS.names, r)) for r in rows], schema=_OPS)


@pytest.mark.parametrize("offset", [0, 10**12])   # 10**12: ids far past the row count (the sparse lookup)
@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_calls_read_a_batch_at_a_time_equal_a_python_count(monkeypatch, size, offset):
    from tensorscope.analyses import totals

    monkeypatch.setattr(totals, "BATCH_ROWS", 3)     # batches sliced further: boundaries inside them too
    calls = _calls_batches(_call_rows(offset), size)
    ops = _ops_for(offset)
    got = api_table(ops, calls).to_pylist()
    assert got == _reference_rows(ops, calls)
    by = {(r["qualname"], r["op"]): r for r in got}
    assert ("torch.compiled_only", None) not in by and by[("torch.late", "aten.mul.Tensor")]["n_ops"] == 1
    assert ("torch.dup", None) in by and by[("torch.dup", None)]["no_op_calls"] == 1   # id 2 is clone's
    add = by[("torch.add", "aten.add.Tensor")]
    assert add["name"] == "add" and add["n_calls"] == 3 and add["no_op_calls"] == 2   # calls 4 and 8


def test_more_apis_than_a_two_byte_slot_holds():
    n = 9000
    rows = [(i, f"torch.api{i}", f"api{i}", None, False) for i in range(n)]
    calls = _calls_batches(rows, 4096)
    ops = pa.Table.from_pylist([dict(zip(_OPS.names, (i, "aten.add.Tensor", i, [], False))) for i in range(0, n, 7)],
                               schema=_OPS)
    got = api_table(ops, calls).to_pylist()
    assert got == _reference_rows(ops, calls)
    assert len(got) == n and sum(r["n_ops"] for r in got) == len(range(0, n, 7))
