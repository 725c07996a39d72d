"""A trace whose chunks spilled to disk while it recorded equals the trace kept in memory.

The same program (transformer-block training steps with Adam, in-place ops, an autocast region, an
op that raises and is caught, NaN in many ops' outputs, a leak kept alive) is traced twice in one process, once in memory and
once with a tiny ``chunk_rows``/``spill_rows`` so dozens of chunks spill, under both engines. Every
table must hold the same rows and values. What legitimately differs between two runs of a program is
compared as structure only (same type, same nulls):

* times: ``ops.start_ns/cpu_ns/probe_ns/cuda_ns``, ``calls.start_ns/dur_ns``, ``api.cpu_ns``,
  ``kernels``/``collectives``/``allocator_events`` times (measured clocks);
* addresses: ``tensors.address``, ``allocator_*`` addresses (where the allocator put each storage);
* ``ops.probe_ns`` (python engine): null on the row whose append spilled its chunk;
* ``api`` rows are ordered by their time: compared in name order;
* ``ops.seq_nr``: autograd's sequence counter is per thread and keeps counting across traces, so it is
  compared as offsets from the trace's first one.

The summary of the spilled trace equals the summary of the in-memory trace's tables with the spilled
run's times put in (so no number in it can differ by timing noise), and a spilled trace saved and
loaded back has every table unchanged.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

import tensorscope
from tensorscope import schema as S
from tensorscope._trace import Trace

#: columns measured by a clock: compared as type and nulls only
TIMES = {
    "ops": ("start_ns", "cpu_ns", "probe_ns", "cuda_ns"),
    "calls": ("start_ns", "dur_ns"),
    "api": ("cpu_ns",),
    "kernels": ("start_ns", "dur_ns"),
    "collectives": ("start_ns", "enqueue_ns", "done_ns"),
    "allocator_events": ("time_us", "start_ns"),
}
#: where the allocator put things: a fact of the run, compared as type and nulls only
ADDRESSES = {
    "tensors": ("address",),
    "allocator_segments": ("address",),
    "allocator_blocks": ("segment_address", "address"),
    "allocator_events": ("address",),
}
#: a process-wide counter: compared as offsets from the first value
OFFSETS = {"ops": ("seq_nr",)}
#: times the python engine leaves null on the row whose own append spilled its chunk (the chunk, and a
#: ``dataset=`` part of it, was written before the probes after the op ran): the spilled trace's
#: non-null rows are the in-memory trace's less at most one row per spill
SPILL_NULLED = {"ops": ("probe_ns",)}
#: tables whose rows are ordered by a measured time: compared in the order of these columns
TIME_ORDERED = {"api": ("qualname", "name", "op")}

SPILL = dict(chunk_rows=64, spill_rows=128)
STEPS = 6

#: the leak the program keeps alive (module level: it outlives the traced block)
KEPT: list[Any] = []


def _forced_fallback() -> bool:
    return os.environ.get("TENSORSCOPE_FORCE_FALLBACK", "") not in ("", "0")


def _native_available() -> bool:
    from tensorscope.recording.engines import _native_ext

    ext, _ = _native_ext(wait=True)
    return ext is not None


@pytest.fixture(params=["native", "python"])
def engine(request):
    if request.param == "native" and (_forced_fallback() or not _native_available()):
        pytest.skip("native engine unavailable (or TENSORSCOPE_FORCE_FALLBACK): the python engine is covered")
    return request.param


def _program():
    """A fresh model (same seed every time) and the function that runs its training steps."""
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), block, torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(2, 8, 8)
    target = torch.randn(2, 8, 4)

    def run():
        for step in range(STEPS):
            out = model(x)
            loss = (out - target).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            h = out.detach().clone()
            h.relu_()                      # in-place
            h.add_(1.0).mul_(0.5)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                torch.mm(h[0], h[0].t())   # an autocast region: mm runs in bfloat16
            try:
                torch.mm(h[0], h[0])       # 8x4 @ 8x4: raises, and the program catches it
            except RuntimeError:
                pass
            bad = torch.full((4,), float("nan")) if step == 1 else torch.ones(4)
            for _ in range(40):
                bad = bad * 2 + 1                  # NaN from step 1 on, in every op's output after it
            if step % 2 == 0:
                KEPT.append(loss)          # a leak: each kept loss holds its autograd graph
    return run


def _traced(engine: str, **opts):
    KEPT.clear()   # each run's leak is KEPT[0], KEPT[1]...: the same holders in every trace
    run = _program()
    with tensorscope.trace(engine=engine, **opts) as t:
        run()
    t = t.result
    assert t.metadata["engine"] == engine, t.metadata.get("engine_reason")
    assert t.metadata["tracer_errors"] == 0, t.metadata["tracer_error_messages"]
    return t


@pytest.fixture
def pair(engine):
    """(in-memory trace, spilled trace) of the same program; a first trace claims every op's first
    run in this process (``ops.first_run``), so both compare alike."""
    try:
        _traced(engine, leaks=False)
        mem = _traced(engine)
        spilled = _traced(engine, **SPILL)
        yield mem, spilled
    finally:
        KEPT.clear()


def _structure(col: pa.ChunkedArray) -> tuple[Any, list[bool]]:
    return col.type, col.is_null().to_pylist()


def _offsets(col: pa.ChunkedArray) -> list[Any]:
    vals = col.to_pylist()
    base = next((v for v in vals if v is not None), 0)
    return [None if v is None else v - base for v in vals]


def assert_tables_equal(name: str, a: pa.Table, b: pa.Table, max_spills: int = 0) -> None:
    """Same schema, rows and values; times and addresses as structure, counters as offsets."""
    assert a.schema.equals(b.schema), name
    assert a.num_rows == b.num_rows, (name, a.num_rows, b.num_rows)
    if name in TIME_ORDERED:
        keys = [(k, "ascending") for k in TIME_ORDERED[name]]
        a, b = a.sort_by(keys), b.sort_by(keys)
    loose = set(TIMES.get(name, ())) | set(ADDRESSES.get(name, ()))
    for col in a.column_names:
        x, y = a.column(col), b.column(col)
        if col in SPILL_NULLED.get(name, ()):
            kept_x, kept_y = np.asarray(x.is_valid()), np.asarray(y.is_valid())
            assert x.type == y.type and not (kept_y & ~kept_x).any(), f"{name}.{col}"
            assert (kept_x & ~kept_y).sum() <= max_spills, f"{name}.{col}"
        elif col in loose:
            assert _structure(x) == _structure(y), f"{name}.{col}"
        elif col in OFFSETS.get(name, ()):
            assert _offsets(x) == _offsets(y), f"{name}.{col}"
        else:
            xs, ys = x.to_pylist(), y.to_pylist()
            if xs != ys:
                bad = next(i for i, (p, q) in enumerate(zip(xs, ys)) if p != q)
                raise AssertionError(f"{name}.{col} row {bad}: {xs[bad]!r} (in memory) != {ys[bad]!r} (spilled)")


def test_every_table_of_a_spilled_trace_equals_the_in_memory_one(pair):
    mem, spilled = pair
    assert mem.metadata["spilled_rows"] == 0
    assert spilled.metadata["spilled_rows"] >= 10 * SPILL["spill_rows"]   # many chunks went to disk
    assert mem.ops.num_rows > 2000
    # the program did what the test says: every feature it exercises is in the tables
    ops = mem.ops.to_pylist()
    assert any(r["inplace"] for r in ops)
    assert any(r["phase"] == "backward" and r["fwd_seq"] is not None for r in ops)
    assert any("bfloat16" in (r["out_dtypes"] or []) for r in ops)
    assert any(r["error_id"] is not None for r in ops)
    assert sum(1 for r in ops if r["nonfinite"]) >= 80   # the NaN screen's findings, across spills
    assert mem.errors.num_rows >= STEPS and mem.leaks.num_rows > 0
    assert mem.calls.num_rows > 0 and mem.tensors.num_rows > 0
    for name in S.TABLES:
        assert_tables_equal(name, mem.table(name), spilled.table(name),
                            max_spills=spilled.metadata["spilled_rows"] // SPILL["chunk_rows"])


def _with_times_of(ref: Trace, src: Trace) -> Trace:
    """``ref``'s tables with ``src``'s measured times and addresses put in (same rows), and ``src``'s
    metadata: a trace that differs from ``src`` only in what ``ref`` recorded."""
    tables = {}
    for name in S.RECORDED:
        t = ref.table(name)
        for col in set(TIMES.get(name, ())) | set(ADDRESSES.get(name, ())) | set(OFFSETS.get(name, ())):
            if col in t.column_names:
                i = t.schema.get_field_index(col)
                t = t.set_column(i, t.schema.field(i), src.table(name).column(col))
        tables[name] = t
    return Trace(tables, src.metadata)


def _text(t: Trace) -> str:
    return t.summary().to_text()


def test_the_summary_of_a_spilled_trace_equals_the_in_memory_one(pair):
    mem, spilled = pair
    ref = _with_times_of(mem, spilled)
    got, want = _text(spilled), _text(ref)
    assert "still alive" in want   # the leak made it into the summary
    assert got == want


def test_a_spilled_trace_saves_and_loads_back_unchanged(pair, tmp_path):
    _, spilled = pair
    back = tensorscope.load(spilled.save(tmp_path / "spilled"))
    for name in S.TABLES:
        a, b = spilled.table(name), back.table(name)
        assert a.num_rows == b.num_rows, name
        assert a.equals(b), name
    assert back.metadata["spilled_rows"] == spilled.metadata["spilled_rows"]
    assert _text(back) == _text(spilled)


def test_spilled_chunks_are_removed_once_the_trace_is_built(engine, tmp_path):
    run = _program()
    try:
        with tensorscope.trace(engine=engine, spill_dir=str(tmp_path), **SPILL) as t:
            run()
        assert t.metadata["spilled_rows"] > 0
        assert not [p for p in os.listdir(tmp_path) if p.startswith("tensorscope-spill-")]
        n = t.ops.num_rows
        assert np.array_equal(np.asarray(t.ops.column("seq")), np.arange(n))
    finally:
        KEPT.clear()
