"""The live-bytes tables of a big trace are built a block of ops at a time into memory-mapped files.

A spilled trace (ops, calls and tensors memory-mapped) and its twin in memory, with blocks of a few ops,
storages read a few at a time and a map threshold of a few rows (so every derived table here is "big"):
``memory`` and ``memory_timeline`` come back memory-mapped from unlinked files (the spilled trace's
table directory; a temporary one for the twin, left empty), equal to the twin's and to the whole-array
definitions; ``module_memory`` and the summary are equal; ``save`` writes the mapped ``memory`` and
``load`` reads back the same tables. Run under both engines (TENSORSCOPE_FORCE_FALLBACK=1 for the
python one).
"""
from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch

import tensorscope
from tensorscope import schema as S
from tensorscope._trace import Trace
from tensorscope.analyses import live_sweep, memory_batches
from tensorscope.io import derived
from tests.analyses.test_memory_batches import whole_memory_table, whole_memory_timeline, whole_module_memory

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def _record(spill_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(5, 6)
    kept = []
    os.makedirs(spill_dir, exist_ok=True)
    with tensorscope.trace(chunk_rows=8, spill_rows=16, spill_dir=str(spill_dir)) as t:
        for _ in range(3):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            kept.append(loss.detach())
    return t.result


def _mapped_under(directory) -> list[str]:
    with open("/proc/self/maps") as f:
        fields = [line.split(None, 5) for line in f]
    return sorted({f[5].strip() for f in fields if len(f) == 6 and f[5].startswith(str(directory))})


@pytest.fixture
def small_blocks(monkeypatch, tmp_path):
    """Blocks of 5 ops, 3 storages at a time, tables of more than 4 rows mapped; temporary files under
    ``tmp_path / "tmp"``."""
    monkeypatch.setattr(memory_batches, "OP_BLOCK", 5)
    monkeypatch.setattr(live_sweep, "STORAGE_STEP", 3)
    monkeypatch.setattr(derived, "MAP_ROWS", 4)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


@linux_only
def test_the_derived_tables_of_a_spilled_trace_are_mapped_and_equal_the_in_memory_ones(tmp_path, small_blocks):
    t = _record(tmp_path / "spill")
    assert t.metadata.get("spilled_rows") and t.tensors.column("alloc_seq").num_chunks > 1
    twin = Trace({name: t.table(name).combine_chunks() for name in S.RECORDED}, t.metadata)
    n = t.ops.num_rows
    for tr in (t, twin):
        assert tr.memory.equals(whole_memory_table(twin.tensors, n))
        assert tr.memory.num_rows == n and tr.memory.column("seq").num_chunks > 1   # one batch per block
        assert tr.memory_timeline.to_arrow().equals(whole_memory_timeline(twin.tensors, twin.ops))
        assert tr.module_memory.to_arrow().equals(whole_module_memory(twin.tensors, twin.ops, twin.calls))
        assert tr.memory_at().to_arrow().equals(twin.memory_at().to_arrow())
    # the spilled trace's are mapped from unlinked files in its table directory; the twin's in a temporary one
    spill_dir = t._spill_dir
    maps = [os.path.basename(m) for m in _mapped_under(spill_dir)]
    assert any(m.startswith("memory-") and m.endswith(".arrow (deleted)") for m in maps), maps
    assert any(m.startswith("memory_timeline-") and m.endswith(".arrow (deleted)") for m in maps), maps
    assert not [f for f in os.listdir(spill_dir) if f.startswith("memory")]
    assert [os.path.basename(m) for m in _mapped_under(small_blocks)]
    assert os.listdir(small_blocks) == []   # nothing left behind
    s, s2 = t.summary(), twin.summary()
    assert s.to_text() == s2.to_text() and s.to_html() == s2.to_html()
    assert "peak" in s.to_text()


def test_save_and_load_of_a_trace_whose_memory_table_is_mapped(tmp_path, small_blocks):
    t = _record(tmp_path / "spill")
    mem = t.memory
    assert mem.column("seq").num_chunks > 1
    path = t.save(tmp_path / "run")
    back = tensorscope.load(path)
    for name in S.TABLES:
        assert back.table(name).equals(t.table(name)), name
    assert back.memory.equals(whole_memory_table(t.tensors, t.ops.num_rows))
    assert back.summary().to_text() == t.summary().to_text()


def test_a_derived_table_that_cannot_be_written_is_built_in_memory(tmp_path, small_blocks, monkeypatch):
    t = _record(tmp_path / "spill")
    gone = tmp_path / "gone"   # no such directory: no temporary directory can be made in it
    monkeypatch.setattr(tempfile, "tempdir", str(gone))
    got = derived.table_from_batches(S.MEMORY, lambda: memory_batches.memory_batches(t.tensors, t.ops.num_rows),
                                     t.ops.num_rows, None, "memory")
    assert got.equals(whole_memory_table(t.tensors, t.ops.num_rows))
    assert got.column("seq").num_chunks > 1 and not gone.exists()
