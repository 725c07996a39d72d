"""``op_totals`` by a dictionary column, a record batch at a time, equals the whole-column answers.

The same rows as (1) one table of several record batches sharing their dictionary (the batched path),
(2) the same table combined into one batch, (3) batches with different dictionaries (the whole-column
fallback) and (4) the key as plain strings (Arrow's group_by: an independent computation).
"""
from __future__ import annotations

import pyarrow as pa
import pytest

from tensorscope.analyses.totals import op_totals

_DICT = pa.array(["aten.add.Tensor", "aten.mul.Tensor", "aten.detach_.default", "aten.only_once.default",
                  "aten.never.default"])


def _batch(idx, cpu, cuda, flops, noise):
    ops = pa.DictionaryArray.from_arrays(pa.array(idx, pa.int32()), _DICT)
    return pa.record_batch({
        "op": ops, "cpu_ns": pa.array(cpu, pa.int64()), "cuda_ns": pa.array(cuda, pa.int64()),
        "flops": pa.array(flops, pa.int64()), "bytes_read": pa.array([c and c * 2 for c in cpu], pa.int64()),
        "bytes_written": pa.array([3] * len(idx), pa.int64()), "is_noise": pa.array(noise, pa.bool_())})


def _batches():
    big = 2**60   # sums past 2**53: exact int64 sums, not float64 ones
    return [
        _batch([0, 1, 0, None, 2], [5, 7, 5, 11, None], [None, 1, None, None, None], [1, big + 1, 2, None, 0],
               [False, False, False, False, True]),
        _batch([], [], [], [], []),                        # an empty batch
        _batch([1, 0, 3], [7, 9, 1], [2, None, None], [big, 3, 5], [False, None, False]),   # op 3: this batch only
        _batch([0, 2, None], [5, 4, 2], [None, None, 6], [None, 0, 1], [False, True, False]),
        _batch([], [], [], [], []),
    ]


def _rows(t: pa.Table) -> list:
    return t.to_pylist()


@pytest.mark.parametrize("include_noise", [False, True])
def test_batched_equals_whole_columns(include_noise):
    batched = pa.Table.from_batches(_batches())
    assert batched.column("op").num_chunks > 1
    got = op_totals(batched, include_noise=include_noise)
    whole = op_totals(batched.combine_chunks(), include_noise=include_noise)
    as_text = batched.set_column(0, "op", batched.column("op").cast(pa.string()))
    by_group_by = op_totals(as_text, include_noise=include_noise)
    assert _rows(got) == _rows(whole) == _rows(by_group_by)
    assert got.schema == whole.schema
    r = {x["op"]: x for x in _rows(got)}
    assert "aten.never.default" not in r                 # in the dictionary, in no row
    assert r["aten.only_once.default"]["calls"] == 1
    assert r["aten.mul.Tensor"]["flops"] == 2**61 + 1 and r["aten.mul.Tensor"]["cuda_ns"] == 3
    assert r["aten.add.Tensor"]["cuda_ns"] is None and r["aten.add.Tensor"]["max_cpu_ns"] == 9
    assert r[None]["calls"] == 2                          # null op names: a group of their own
    assert ("aten.detach_.default" in r) is include_noise
    assert [x["op"] for x in _rows(got)][:2] == ["aten.add.Tensor", "aten.mul.Tensor"]   # 24 ns, then a 14 ns tie
    order = [(-x["cpu_ns"], x["op"] is None, x["op"] or "") for x in _rows(got)]
    assert order == sorted(order)


def test_batches_with_different_dictionaries_fall_back_to_whole_columns():
    bs = _batches()
    other = pa.DictionaryArray.from_arrays(pa.array([1, 0], pa.int32()), pa.array(["aten.mul.Tensor", "aten.zeta.default"]))
    extra = pa.record_batch({**{n: bs[0].column(n).slice(0, 2) for n in bs[0].schema.names}, "op": other},
                            schema=bs[0].schema)
    t = pa.Table.from_batches(bs + [extra])
    got = op_totals(t)
    as_text = t.set_column(0, "op", t.column("op").cast(pa.string()))
    assert _rows(got) == _rows(op_totals(as_text))
    assert {x["op"]: x["calls"] for x in _rows(got)}["aten.zeta.default"] == 1


def test_empty_table():
    t = pa.Table.from_batches([_batch([], [], [], [], [])])
    got = op_totals(t)
    assert got.num_rows == 0 and got.column_names[0] == "op"
