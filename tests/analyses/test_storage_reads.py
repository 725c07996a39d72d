"""The memory categories read the tensors table's per-storage columns a block of rows at a time
(``analyses/storage_reads.py``, ``Lifetimes``): the categories of a table made of many small record
batches, categorised a few rows at a time, equal the whole table's categorised at once; the block
readers equal numpy over the whole column, across chunk and block boundaries."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

import tensorscope
from tensorscope.analyses import memory_categories as mc
from tensorscope.analyses.storage_reads import read_column, rows_where


def _trace():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    kept = []
    with tensorscope.trace(chunk_rows=16, spill_rows=32) as t:   # tables in many small chunks
        for step in range(4):
            loss = model(x + 0).square().mean()   # x + 0: made in the trace outside modules, read by one: input
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 2:
                kept.append(model(x).sum())   # a graph held to the end
    return t.result, kept


def _whole(table: pa.Table) -> pa.Table:
    return pa.Table.from_batches([table.combine_chunks().to_batches()[0]]) if table.num_rows else table


@pytest.mark.parametrize("step", [3, 7, 1 << 16])
def test_categories_by_blocks_equal_the_whole_tables(step, monkeypatch):
    t, _kept = _trace()
    tensors, ops, calls = t.tensors, t.ops, t.calls
    assert tensors.column("alloc_seq").num_chunks > 4   # many record batches
    whole = mc.categorize(_whole(tensors), _whole(ops), _whole(calls), graph_held=[0, 1, 2])
    monkeypatch.setattr(mc, "_STORAGE_STEP", step)
    got = mc.categorize(tensors, ops, calls, graph_held=[0, 1, 2])
    assert got.to_pylist() == whole.to_pylist()
    assert {"temporary", "activation"} <= set(got.to_pylist())
    lt = mc.Lifetimes(tensors, ops, calls)
    assert lt.sid is None and lt.pos is None   # a recorded trace: ids are rows, nothing read whole
    rows, seqs = mc.made_by_out_argument(tensors, ops, lt)
    wr, ws = mc.made_by_out_argument(_whole(tensors), _whole(ops))
    assert rows.tolist() == wr.tolist() and seqs.tolist() == ws.tolist()


def test_a_table_whose_ids_are_not_its_rows_reads_them_whole():
    t, _kept = _trace()
    part = t.tensors.slice(5)   # ids 5.. at rows 0..: the id -> row map is built
    lt = mc.Lifetimes(part, t.ops, t.calls)
    assert lt.pos is not None and lt.sid is not None and lt.sid[0] == 5
    assert mc.categorize(part, t.ops, t.calls).to_pylist() == mc.categorize(_whole(part), t.ops, t.calls).to_pylist()


def test_block_readers_equal_numpy_across_chunk_and_block_boundaries():
    rng = np.random.default_rng(1)
    vals = rng.integers(-1, 50, 300)
    valid = vals >= 0
    chunks = [pa.array(np.where(valid[a:b], vals[a:b], 0), pa.int64(), mask=~valid[a:b])
              for a, b in zip([0, 13, 14, 100, 250], [13, 14, 100, 250, 300])]
    table = pa.table({"alloc_seq": pa.chunked_array(chunks)})
    assert read_column(table, "alloc_seq", 10, 120).tolist() == vals[10:120].tolist()
    rows = rng.permutation(300)[:40]
    assert read_column(table, "alloc_seq", 0, 0, rows).tolist() == vals[rows].tolist()
    moved = (np.array([3, 99, 260]), np.array([7, 8, 9]))
    want = vals.copy()
    want[moved[0]] = moved[1]
    assert read_column(table, "alloc_seq", 0, 300, None, moved).tolist() == want.tolist()
    assert read_column(table, "alloc_seq", 0, 0, rows, moved).tolist() == want[rows].tolist()
    for step in (1, 11, 64, 1000):
        assert rows_where(table, "alloc_seq", lambda a: a < 0, step, moved).tolist() == np.nonzero(want < 0)[0].tolist()


@pytest.mark.parametrize("lengths", [[1] * 400, [3, 7, 1, 50, 2, 500], None])
def test_category_blocks_equal_the_whole_column_across_block_boundaries(lengths):
    """``category_blocks`` (a spilled trace writes each block to its file as it comes) gives the
    whole column's codes block by block, the overrides (gradients, state, graph-held, known) applied
    to the rows of the block they fall in."""
    t, _kept = _trace()
    tensors, ops, calls = t.tensors, t.ops, t.calls
    n = tensors.num_rows
    known = {5: "parameter", 17: "buffer", n - 2: "optimizer_state", n + 7: "parameter"}
    whole = mc.categorize(_whole(tensors), _whole(ops), _whole(calls), known, graph_held=[0, 1, 2, n - 1],
                          optimizer_held=[9, 40]).to_pylist()
    blocks = list(mc.category_blocks(tensors, ops, calls, known, graph_held=[n - 1, 2, 1, 0], optimizer_held=[40, 9],
                                     lengths=lengths))
    assert n > 100 and len(blocks) > (5 if lengths is not None else 0)
    if lengths is not None:   # blocks of those lengths (then of _STORAGE_STEP), covering every row
        ends = np.minimum(np.cumsum(lengths), n)
        want = [int(m) for m in np.diff(ends, prepend=0) if m > 0]
        assert [len(b) for b in blocks][:len(want)] == want
    got = [v for b in blocks for v in b.to_pylist()]
    assert got == whole
    assert {"parameter", "buffer", "optimizer_state", "gradient", "input"} <= set(got)
    lt = mc.Lifetimes(tensors, ops, calls)   # what a module read: a bit per storage, read at any offset
    every = lt.read_by_module(0, n)
    assert every.sum() >= 4 and len(every) == n
    in_mod = ops.filter(pc.is_valid(ops.column("module"))).column("in_storages").to_pylist()
    assert set(np.nonzero(every)[0].tolist()) == {s for ins in in_mod for s in ins if s is not None and 0 <= s < n}
    for lo, hi in ((0, 1), (3, 11), (7, 9), (8, 16), (5, n), (n - 3, n)):
        assert lt.read_by_module(lo, hi).tolist() == every[lo:hi].tolist(), (lo, hi)
