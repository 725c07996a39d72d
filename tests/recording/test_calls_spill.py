"""The calls rows spill with the op chunks while the trace records (both engines).

The native function mode keeps its calls in blocks of 16384 calls, packed once full; each spill of
the recorder hands the blocks packed since the last one over (C frees them) and writes them out as
``calls-*.npz`` parts, as the python engine's ``CallStore`` spills its frozen chunks. A program of
well over three blocks of cheap torch-level calls (each call's function, source line, module and
first op differ from its neighbours', so a block read out of order, twice or not at all changes a
value) is traced in memory and with a tiny ``spill_rows``: every table equal (times and addresses as
structure, as tests/recording/test_spill_equal.py compares them), the summary equal, a ``dataset=``
trace whose rolling parts read the calls while some are handed over equal, a full disk while a calls
part is written keeps the rows in memory, and C no longer holds the blocks it handed over.
"""
from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest
import torch

import tensorscope
from tensorscope import schema as S
from tensorscope.errors import SpillError
from tensorscope.recording import live_calls, packed_rows, spill
from tests.helpers.disk import FullFile
from tests.recording.test_spill_equal import _text, _with_times_of, assert_tables_equal

CALLS = 60_000       # > 3 blocks of 16384 calls (native/fmode.h kBlock)
SPILL = dict(chunk_rows=4096, spill_rows=8192)
OPTS = dict(leaks=False, storages=False, nonfinite=False)
#: what an op takes from its call
OPS_COLS = ["seq", "call_id", "module", "source_file", "source_line"]


class _Block(torch.nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z.mul(1.0)   # a call from inside a module (its module path)


def _program(x, stats=None):
    """CALLS torch-level calls of one op each from four source lines (one in a module, every 39th call)."""
    blk = _Block()
    z = x   # made by the caller before the trace (a module global tensor is a leak later leak tests find)
    for i in range(CALLS // 3):
        z = z + 1
        z = blk(z) if i % 13 == 0 else z.sub(1)
        z = torch.mul(z, 1.0)
    if stats is not None:   # C's calls blocks at the end of recording
        from tensorscope.native import _build

        stats.update(_build._STATES["fmode"].module.stats())
    return z


def _engine(name):
    forced = os.environ.get("TENSORSCOPE_FORCE_FALLBACK", "") not in ("", "0")
    if name == "native":
        if forced:
            pytest.skip("TENSORSCOPE_FORCE_FALLBACK=1: the native engine is off")
        from tests.recording.test_tables_build import _native

        _native()
    return name


def _traced(engine, stats=None, **opts):
    x = torch.ones(2)
    with tensorscope.trace(engine=engine, **OPTS, **opts) as t:
        _program(x, stats)
    t = t.result
    assert t.metadata["engine"] == engine and t.metadata["tracer_errors"] == 0
    return t


def _same_tables(mem, got, spills):
    for name in S.TABLES:
        assert_tables_equal(name, mem.table(name), got.table(name), max_spills=spills)


@pytest.mark.parametrize("engine", ["native", "python"])
def test_calls_spilled_while_recording_equal_the_in_memory_trace(engine, monkeypatch):
    engine = _engine(engine)
    monkeypatch.setattr(packed_rows, "OPEN_CHUNKS", 1)   # a spilled chunk read back is dropped at the next
    _traced(engine)   # claims every op's first run in this process (ops.first_run)
    native = engine == "native"
    mem_stats, spilled_stats = {}, {}
    mem = _traced(engine, mem_stats if native else None)
    got = _traced(engine, spilled_stats if native else None, **SPILL)
    assert mem.metadata["spilled_rows"] == 0 and got.metadata["spilled_rows"] >= 6 * SPILL["spill_rows"]
    assert mem.calls.num_rows == got.calls.num_rows == CALLS
    calls = mem.calls.to_pydict()
    assert len(set(calls["source_line"])) == 4 and len(set(calls["module"])) == 2
    assert calls["first_seq"] == list(range(CALLS))   # one op each: a block out of place shows
    _same_tables(mem, got, got.metadata["spilled_rows"] // SPILL["chunk_rows"])
    ops = OPS_COLS
    assert got.ops.select(ops).equals(mem.ops.select(ops))
    starts = got.calls.column("start_ns").to_pylist()
    assert starts == sorted(starts)
    assert _text(got) == _text(_with_times_of(mem, got))
    if native:
        # C handed the full blocks over as the recorder spilled: it holds none of them any more
        assert mem_stats["packed_blocks"] == spilled_stats["packed_blocks"] == CALLS // 16384
        assert mem_stats["taken_blocks"] == 0 and spilled_stats["taken_blocks"] == CALLS // 16384
        live_block = 16384 * 56   # the block being written (abi.h CallRow)
        assert mem_stats["row_bytes"] > live_block + 3 * 16384 * 8
        assert spilled_stats["row_bytes"] == live_block


def test_blocks_spilled_together_are_one_part_equal_to_the_in_memory_trace(monkeypatch):
    # the first spill comes after two full blocks: they are re-packed as one calls part; its
    # fields vary across the blocks (first_seq, start_ns...), others are constant (parent, error)
    engine = _engine("native")
    _traced(engine)
    mem = _traced(engine)
    stats = {}
    seen = []
    real = live_calls.LiveCalls._merged
    monkeypatch.setattr(live_calls.LiveCalls, "_merged", lambda self, blocks: seen.append(len(blocks)) or real(self, blocks))
    got = _traced(engine, stats, chunk_rows=8192, spill_rows=40000)
    assert stats["taken_blocks"] == 2 and seen[:1] == [2] and got.metadata["spilled_rows"] > 0
    assert_tables_equal("calls", mem.calls, got.calls)
    assert got.ops.select(OPS_COLS).equals(mem.ops.select(OPS_COLS))


def test_a_dataset_trace_spilling_calls_while_recording_is_equal(tmp_path, monkeypatch):
    _engine("native")
    monkeypatch.setenv("TENSORSCOPE_RUN_ID", "run1")
    _traced("native")
    mem = _traced("native")
    root = tmp_path / "ds"
    stats = {}
    x = torch.ones(2)
    with tensorscope.trace(engine="native", dataset=str(root), **OPTS, **SPILL) as t:
        _program(x, stats)
    assert t.metadata["tracer_errors"] == 0, t.metadata["tracer_error_messages"]
    assert stats["taken_blocks"] == CALLS // 16384   # handed over before the last rolling parts read the calls
    parts = sorted((root / "ops" / "run=run1" / "rank=0").glob("part-*.parquet"))
    assert len(parts) > 3 and t.metadata["spilled_rows"] > 0
    rolled = pq.read_table(parts[-2])   # a part decoded while recording, after the blocks were taken
    lo = rolled.column("seq")[0].as_py()
    ops = OPS_COLS
    assert rolled.select(ops).to_pylist() == mem.ops.select(ops).slice(lo, rolled.num_rows).to_pylist()
    back = tensorscope.open_dataset(root).trace()
    assert_tables_equal("calls", mem.calls, S.plain_strings(back.calls).cast(mem.calls.schema))
    assert back.ops.select(ops).to_pylist() == mem.ops.select(ops).to_pylist()


@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_full_disk_while_writing_a_calls_part_keeps_the_calls_in_memory(engine, monkeypatch, tmp_path):
    engine = _engine(engine)
    _traced(engine)
    mem = _traced(engine)
    real = spill._open
    opened = []

    def opener(path):   # the second calls part fills the disk
        opened.append(path)
        f = real(path)
        n = sum(os.path.basename(p).startswith("calls-") for p in opened)
        return FullFile(f) if os.path.basename(path).startswith("calls-") and n == 2 else f

    monkeypatch.setattr(spill, "_open", opener)
    (tmp_path / "spill").mkdir()
    x = torch.ones(2)
    with pytest.raises(SpillError, match=r"calls-000001\.npz"):
        with tensorscope.trace(engine=engine, spill_dir=str(tmp_path / "spill"), **OPTS, **SPILL):
            _program(x)
    t = tensorscope.last()
    assert any("kept in memory" in n for n in t.metadata["notes"])
    assert all(not p.endswith(".part") or not os.path.exists(p) for p in opened)
    assert_tables_equal("calls", mem.calls, t.calls)
    ops = OPS_COLS
    assert t.ops.select(ops).equals(mem.ops.select(ops))
    back = tensorscope.load(t.save(tmp_path / "saved"))
    assert_tables_equal("calls", mem.calls, back.calls)


def test_calls_handed_over_read_back_while_recording():
    # rec.calls.field (an error's or a warning's call) and .column (a dataset= spill) while the
    # trace records: the calls C handed over come from their chunks, the rest from C
    _engine("native")
    from tensorscope.options import TraceOptions
    from tensorscope.recording.recorder import C_FIRST_SEQ, C_SRC
    from tensorscope.recording.session import new_session

    x = torch.ones(2)
    sess = new_session(TraceOptions(engine="native", **OPTS, **SPILL))
    sess.start()
    try:
        _program(x)
        calls = sess.ctx.rec.calls
        assert calls.live and calls.base == 3 * 16384 and calls.spilled   # three blocks handed over, spilled
        ids = [0, 16383, 16384, 40000, 3 * 16384 - 1, 3 * 16384, CALLS - 1]
        first = [calls.field(i, C_FIRST_SEQ) for i in ids]
        src = [calls.field(i, C_SRC) for i in ids]
        col = calls.column("first_seq")
        srcs = sess.ctx.rec.sources.values
    finally:
        t = sess.stop()
    assert first == ids and col.tolist() == list(range(CALLS))
    lines = t.calls.column("source_line").to_pylist()
    assert [srcs[s][1] for s in src] == [lines[i] for i in ids]
