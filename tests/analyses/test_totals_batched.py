"""``module_totals``, ``cell_totals`` and the overview's counts read a record batch at a time equal the
answers computed row by row in Python, across batch boundaries: batches with different dictionaries,
plain-string batches, nulls, and one big batch read in slices of 2 rows (``BATCH_ROWS``)."""
from __future__ import annotations

import pyarrow as pa
import pytest

from tensorscope.analyses import totals as T

_MODS = ["<Net>", "<Net>.0", "<Net>.1", "<Net>.1.conv", "<Other>"]


def _batch(mods, phases, cpu, noise, dict_order):
    """One batch; ``dict_order``: the order of the module dictionary (None: plain strings)."""
    if dict_order is None:
        mod = pa.array(mods, pa.string())
    else:
        values = [_MODS[i] for i in dict_order]
        mod = pa.DictionaryArray.from_arrays(pa.array([None if m is None else values.index(m) for m in mods],
                                                      pa.int32()), pa.array(values))
    phase = pa.array(phases, pa.string()).dictionary_encode()
    return pa.record_batch({"module": mod, "phase": phase, "cpu_ns": pa.array(cpu, pa.int64()),
                            "is_noise": pa.array(noise, pa.bool_()),
                            "bytes_read": pa.array([c and 2 * c for c in cpu], pa.int64()),
                            "bytes_written": pa.array([None] * len(cpu), pa.int64()),
                            "flops": pa.array([3] * len(cpu), pa.int64())})


def _tables():
    b1 = _batch(["<Net>.0", "<Net>.1.conv", None, "<Net>.0"], ["forward", "forward", "backward", "backward"],
                [5, 7, 11, None], [False, True, None, False], [0, 1, 2, 3, 4])
    b2 = _batch(["<Net>.1", "<Net>.0", "<Net>.1.conv"], ["backward", None, "backward"], [2**54, 3, 1],
                [False, False, True], [3, 2, 1])     # another dictionary, other codes
    b3 = _batch(["<Net>.1.conv", "<Net>.0"], ["forward", "backward"], [4, 6], [False, False], None)
    b4 = _batch([], [], [], [], [0])
    same = [b.cast(b1.schema) for b in (b1, b2, b3, b4)]   # b3 dictionary-encoded by the cast
    return pa.Table.from_batches(same), [b1, b2, b3, b4]


def _by_python(batches):
    groups: dict = {}
    for b in batches:
        for r in b.to_pylist():
            if r["module"] is None:
                continue
            g = groups.setdefault((r["module"], r["phase"] == "backward"), [0, 0])
            g[0] += r["cpu_ns"] or 0
            g[1] += 1
    return sorted((m, back, ns, n) for (m, back), (ns, n) in groups.items())


@pytest.mark.parametrize("batch_rows", [2, None])
def test_module_totals_batched_equal_row_by_row(monkeypatch, batch_rows):
    table, batches = _tables()
    if batch_rows:
        monkeypatch.setattr(T, "BATCH_ROWS", batch_rows)
    assert sorted(T._module_groups(table)) == _by_python(batches)
    mixed = pa.Table.from_batches([b for b in batches if b.num_rows and b.schema.field(0).type == pa.string()])
    assert sorted(T._module_groups(mixed)) == _by_python([b for b in batches if b.schema.field(0).type == pa.string()])
    got = T.module_totals(table).to_pylist()
    one = T.module_totals(table.combine_chunks()).to_pylist()
    assert got == one
    rows = {r["module"]: r for r in got}
    assert rows["<Net>.1"]["total_ns"] == 2**54 + 12 and rows["<Net>.1"]["self_ns"] == 2**54
    assert rows["<Net>.0"]["ops"] == 4 and rows["<Net>.0"]["backward_ns"] == 6
    assert rows["<Net>"]["depth"] == -1 and rows["<Net>"]["ops"] == 8


@pytest.mark.parametrize("batch_rows", [2, None])
def test_cell_totals_batched_equal_row_by_row(monkeypatch, batch_rows):
    table, batches = _tables()
    if batch_rows:
        monkeypatch.setattr(T, "BATCH_ROWS", batch_rows)
    rows = [r for b in batches for r in b.to_pylist()]
    got = T.cell_totals(table, 100)
    assert got == {"ops": 9, "forward": 9 - sum(r["phase"] == "backward" for r in rows),
                   "backward": sum(r["phase"] == "backward" for r in rows),
                   "noise": sum(bool(r["is_noise"]) for r in rows), "cpu_ns": sum(r["cpu_ns"] or 0 for r in rows),
                   "wall_ns": 100, "bytes_read": sum(r["bytes_read"] or 0 for r in rows), "bytes_written": 0,
                   "flops": 27}
    assert T.column_sum(table.column("bytes_written")) is None
    assert T.count_equal(table.column("module"), "<Net>.0") == 4
    assert [b.num_rows for b in T.row_batches(table, ["cpu_ns"])] == ([2, 2, 2, 1, 2] if batch_rows else [4, 3, 2])


def test_op_totals_skips_a_batch_whose_column_is_all_null_and_still_sums_the_others():
    ops = pa.array(["aten.add.Tensor", "aten.mul.Tensor"]).dictionary_encode().dictionary

    def batch(idx, cpu, cuda, flops):
        n = len(idx)
        return pa.record_batch({"op": pa.DictionaryArray.from_arrays(pa.array(idx, pa.int32()), ops),
                                "cpu_ns": pa.array(cpu, pa.int64()), "cuda_ns": pa.array(cuda, pa.int64()),
                                "flops": pa.array(flops, pa.int64()), "bytes_read": pa.array([None] * n, pa.int64()),
                                "bytes_written": pa.array([1] * n, pa.int64()), "is_noise": pa.array([False] * n)})

    table = pa.Table.from_batches([batch([0, 1], [None, None], [None, None], [None, None]),
                                   batch([1, 0, 0], [4, 5, 6], [7, None, 2], [None, 9, None])])
    got = T.op_totals(table).to_pylist()
    as_text = table.set_column(0, "op", table.column("op").cast(pa.string()))
    assert got == T.op_totals(as_text).to_pylist()
    r = {x["op"]: x for x in got}
    assert r["aten.add.Tensor"]["cuda_ns"] == 2 and r["aten.add.Tensor"]["flops"] == 9
    assert r["aten.mul.Tensor"]["max_cpu_ns"] == 4 and r["aten.add.Tensor"]["calls"] == 3
