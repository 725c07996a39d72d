"""A spilled trace's per-call facts (each call's source, whether its function is expected to be free)
are written to its spill directory and read back memory-mapped while the ops are decoded
(``spilled.call_facts``), not held in memory; the tables are those of the same trace in memory.

``CALL_RANGE`` is made small so a few hundred calls span many ranges (the file is written a range
at a time). Calls alternate between functions expected to be free (``reshape``: its hidden copy is
found through ``call_free``) and not, on several source lines, so a value from the wrong call or
range changes the ``ops`` table. A disk that fills while the file is written: the trace still
ends with the SpillError and is whole. Both engines (the environment's, and ``engine="python"``).
"""
from __future__ import annotations

import pytest
import torch

import tensorscope
from tensorscope.errors import SpillError
from tensorscope.recording import spill, spilled
from tests.helpers.disk import FullFile
from tests.recording.test_spill_equal import assert_tables_equal

SPILL = dict(chunk_rows=64, spill_rows=128, leaks=False)


def _program():
    x = torch.randn(6, 4).t()   # not contiguous: reshape copies
    out = []
    for i in range(300):
        if i % 3 == 0:
            out.append(x.reshape(24))                  # free expected, a hidden copy
        elif i % 3 == 1:
            out.append(x.sum())                        # another line, not free
        else:
            out.append(torch.add(x, i))                # another function
    return out


def _traced(engine, **opts):
    with tensorscope.trace(engine=engine, **opts) as t:
        _program()
    return t.result


@pytest.fixture(params=["auto", "python"])
def engine(request):
    return request.param


@pytest.fixture
def small_ranges(monkeypatch):
    monkeypatch.setattr(spilled, "CALL_RANGE", 37)
    written = []
    real = spilled.write_npy

    def spy(directory, name, *a, **k):
        written.append(name)
        return real(directory, name, *a, **k)

    monkeypatch.setattr(spilled, "write_npy", spy)
    return written


def test_call_facts_mapped_from_the_spill_dir_give_the_in_memory_tables(engine, small_ranges):
    _traced(engine, leaks=False)   # first runs claimed
    mem = _traced(engine, leaks=False)
    assert small_ranges == []      # in memory: no file
    spilled = _traced(engine, **SPILL)
    assert small_ranges == ["call-src.npy", "call-free.npy"]
    assert spilled.metadata["spilled_rows"] > 0 and spilled.calls.num_rows >= 300
    hidden = [r for r in mem.ops.to_pylist() if r["hidden_copy"]]
    assert len(hidden) >= 100   # the reshape copies, found through call_free
    for name in ("ops", "calls", "tensors"):
        assert_tables_equal(name, mem.table(name), spilled.table(name),
                            max_spills=spilled.metadata["spilled_rows"] // SPILL["chunk_rows"])


def test_a_full_disk_while_writing_the_call_facts(engine, small_ranges, monkeypatch):
    ref = _traced(engine, **SPILL)
    real = spill._open
    monkeypatch.setattr(spill, "_open", lambda p: FullFile(real(p)) if p.endswith("call-src.npy.part") else real(p))
    cm = tensorscope.trace(engine=engine, **SPILL)
    with pytest.raises(SpillError) as ei:
        with cm:
            _program()
    assert "while writing call-src.npy" in str(ei.value) and "spill_dir=" in str(ei.value)
    t = cm.result
    assert any("the calls' sources were kept in memory" in n for n in t.metadata["notes"])
    for name in ("ops", "calls", "tensors"):
        assert_tables_equal(name, ref.table(name), t.table(name),
                            max_spills=t.metadata["spilled_rows"] // SPILL["chunk_rows"])
