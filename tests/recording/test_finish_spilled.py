"""Finishing a spilled trace (recording/decode.py, recording/probes.py): its ``ops``, ``calls`` and
``tensors`` are decoded chunk by chunk into Arrow IPC files in one directory and the Trace reads them
memory-mapped (what probes contributed too), the directory goes with the Trace, and the memory
categories, computed batch by batch over those files, equal the in-memory trace's."""
from __future__ import annotations

import gc
import os
import sys

import numpy as np
import pyarrow as pa
import pytest
import torch

import tensorscope
from tensorscope.analyses.opview import take_table_rows as take_rows
from tensorscope.recording import history


def _step(n_small: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Small ops, then a module's forward and backward with an optimizer (every category); the model
    and optimizer are returned (alive at the end: their storages are parameters and gradients)."""
    torch.manual_seed(0)
    x = torch.ones(3)
    for _ in range(n_small):
        x = x + 1
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        loss = model(torch.randn(3, 4)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def _mappings() -> list[tuple[int, int, str]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6:
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                out.append((lo, hi, parts[5].strip()))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_spilled_trace_reads_its_big_tables_from_mapped_files_removed_with_it(engine, tmp_path):
    with tensorscope.trace(engine=engine, chunk_rows=64, spill_rows=128, spill_dir=str(tmp_path)) as t:
        _step(400)
    assert t.metadata["spilled_rows"] > 0 and t.metadata["tracer_errors"] == 0, t.metadata["tracer_error_messages"]
    (d,) = [p for p in tmp_path.iterdir() if p.name.startswith("tensorscope-tables-")]
    names = set(os.listdir(d))
    assert {"ops.arrow", "calls.arrow", "tensors.arrow"} <= names
    assert "tensors-category.arrow" in names   # the memory categories, written a block at a time beside them
    maps = _mappings()
    for name in ("ops", "calls", "tensors"):
        table = t.table(name)
        assert table.column(0).num_chunks > 1   # decoded chunk by chunk
        for col in table.column_names:
            c = table.column(col)
            if c.null_count == len(c):
                continue   # null chunks share one small array
            for buf in c.chunk(0).buffers():
                if buf is None or buf.size == 0:
                    continue
                where = [path for lo, hi, path in maps if lo <= buf.address < hi]
                assert where and where[0].startswith(str(d)), (name, col, where)
    history.set_history_limits(max_traces=1)
    with tensorscope.trace(engine=engine):   # takes the spilled trace's place in history() and last()
        torch.ones(1)
    del t, table, c
    gc.collect()
    assert not d.exists()


@pytest.mark.parametrize("engine", ["native", "python"])
def test_memory_categories_of_a_spilled_trace_equal_the_in_memory_ones(engine):
    with tensorscope.trace(engine=engine) as plain:
        kept = _step(300)
    with tensorscope.trace(engine=engine, chunk_rows=64, spill_rows=128) as spilled:
        kept = _step(300)   # alive at the end of both traces
    assert spilled.metadata["spilled_rows"] > 0
    cats = [t.tensors.column("category").to_pylist() for t in (plain, spilled)]
    assert cats[0] == cats[1]
    assert {"parameter", "gradient", "activation", "temporary"} <= set(cats[0])


def test_take_rows_gives_what_take_gives_chunk_by_chunk():
    t = pa.Table.from_batches([pa.record_batch({"a": np.arange(i * 10, i * 10 + 10),
                                                "b": pa.array([str(x % 3) for x in range(10)]).dictionary_encode()})
                               for i in range(7)])
    for rows in ([5, 69, 0, 33, 33, 12], [3], list(range(70))[::-1], []):
        assert take_rows(t, rows).equals(t.take(pa.array(rows, pa.int64()))), rows
    with pytest.raises(IndexError):
        take_rows(t, [70])
