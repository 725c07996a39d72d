"""A spilled ops file leaves out the columns null on every row of the trace, found before decoding
from the raw columns' one value on every row (``Recorder.op_constants``, ``spilled.null_ops``): a
loop of small ops without autograd or modules writes no ``seq_nr``, ``fwd_seq``, ``flops``,
``module`` or ``autograd_node``. A column null in some chunks only, or holding one non-null value on
every row, is written; the spilled trace's ops table equals the in-memory one either way."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pyarrow as pa
import pytest
import torch

import tensorscope

SPILL = dict(chunk_rows=64, spill_rows=128)
#: the columns a loop of small ops leaves null on every row
CONSTANT_NULL = {"seq_nr", "fwd_seq", "flops", "module", "autograd_node"}
#: compared as values (times are measured; seq_nr counts per process: compared as nulls)
COMPARED = ("op", "phase", "module", "autograd_node", "fwd_seq", "flops", "call_id", "source_line", "bytes_read")


class _Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 - x


def _small_loop() -> None:
    x = torch.ones(3)
    for _ in range(600):
        x = x + 1


def _module_late() -> None:
    """Small ops, then a module and autograd in the last chunks only: the columns vary across chunks."""
    x = torch.ones(3)
    for _ in range(600):
        x = x + 1
    m = _Double()
    for _ in range(30):
        x = m(x)
    w = torch.ones(3, requires_grad=True)
    (m(w) * x).sum().backward()


def _module_everywhere(m: torch.nn.Module) -> Callable[[], None]:
    """Every op inside one module: ``module`` holds one non-null value on every row."""
    def run() -> None:
        m()
    return run


class _Loop(torch.nn.Module):
    def forward(self) -> torch.Tensor:
        x = torch.ones(3)
        for _ in range(600):
            x = x + 1
        return x


def _ops_file_columns(root: Path) -> set[str]:
    (d,) = [p for p in root.iterdir() if p.name.startswith("tensorscope-tables-")]
    with pa.memory_map(str(d / "ops.arrow")) as f:
        return set(pa.ipc.open_file(f).schema.names)


def _traces(engine: str, program: Callable[[], None], tmp_path: Path) -> tuple[tensorscope.Trace, tensorscope.Trace]:
    with tensorscope.trace(engine=engine) as mem:
        program()
    with tensorscope.trace(engine=engine, spill_dir=str(tmp_path), **SPILL) as spilled:  # type: ignore[arg-type]
        program()
    assert spilled.metadata["spilled_rows"] > 0, spilled.metadata
    assert spilled.metadata["tracer_errors"] == 0, spilled.metadata["tracer_error_messages"]
    return mem, spilled


def _assert_equal(mem: tensorscope.Trace, spilled: tensorscope.Trace) -> None:
    a, b = mem.ops, spilled.ops
    assert a.schema == b.schema and a.num_rows == b.num_rows
    for name in COMPARED:
        assert a.column(name).combine_chunks().equals(b.column(name).combine_chunks()), name
    for name in set(a.schema.names) - {"probe_ns"}:   # the same nulls (probe_ns: see test_spill_equal)
        assert a.column(name).is_null().equals(b.column(name).is_null()), name


@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_loop_of_small_ops_leaves_its_null_columns_out_of_the_ops_file(engine, tmp_path):
    mem, spilled = _traces(engine, _small_loop, tmp_path)
    names = _ops_file_columns(tmp_path)
    assert not names & CONSTANT_NULL, names & CONSTANT_NULL
    for name in CONSTANT_NULL:
        col = spilled.ops.column(name)
        assert col.null_count == len(col) > 0, name
    _assert_equal(mem, spilled)


@pytest.mark.parametrize("engine", ["native", "python"])
def test_columns_null_in_some_chunks_only_are_written(engine, tmp_path):
    mem, spilled = _traces(engine, _module_late, tmp_path)
    names = _ops_file_columns(tmp_path)
    assert {"seq_nr", "fwd_seq", "module", "autograd_node"} <= names
    for name in ("seq_nr", "fwd_seq", "module", "autograd_node"):   # null in the first chunks, not in the last
        col = spilled.ops.column(name)
        assert col.chunk(0).null_count == len(col.chunk(0)) and col.null_count < len(col), name
    _assert_equal(mem, spilled)


@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_column_with_one_value_on_every_row_is_written(engine, tmp_path):
    mem, spilled = _traces(engine, _module_everywhere(_Loop()), tmp_path)
    names = _ops_file_columns(tmp_path)
    assert "module" in names and {"seq_nr", "fwd_seq", "flops", "autograd_node"}.isdisjoint(names)
    assert spilled.ops.column("module").null_count == 0
    _assert_equal(mem, spilled)


def test_null_columns_share_one_zero_buffer_and_equal_arrow_nulls(tmp_path):
    """``spilled.null_column`` over a ``shared`` dict: every type of the decoded tables (integers and
    floats over one zero-filled buffer, dictionaries over its indices, the rest ``pa.nulls``) equals
    ``pa.nulls`` chunk by chunk, validates, computes as nulls, and survives an IPC and a parquet file."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from tensorscope.recording.decode import DECODED_CALLS, DECODED_OPS, DECODED_TENSORS
    from tensorscope.recording.spilled import SharedNulls, null_column

    lengths = [700, 700, 33]
    shared = SharedNulls()
    fields = list(DECODED_OPS) + list(DECODED_CALLS) + list(DECODED_TENSORS)
    cols = {}
    for f in fields:
        c = null_column(sum(lengths), f.type, lengths, shared)
        c.validate(full=True)
        want = pa.chunked_array([pa.nulls(m, f.type) for m in lengths], f.type)
        assert c.type == f.type and c.null_count == sum(lengths) and c.equals(want), f.name
        assert c.slice(695, 10).to_pylist() == [None] * 10
        if pa.types.is_integer(f.type) or pa.types.is_floating(f.type):
            assert pc.max(c).as_py() is None and pc.fill_null(c, 7).to_pylist()[-1] == 7
        cols[f"{f.name}_{len(cols)}"] = c
    flat = [f for f in fields if pa.types.is_integer(f.type) or pa.types.is_floating(f.type)]
    assert flat and {null_column(10, f.type, [10], shared).chunk(0).buffers()[1].address
                     for f in flat} == {shared.zeros.address}, "one zero buffer"
    t = pa.table(cols)
    with pa.OSFile(str(tmp_path / "n.arrow"), "wb") as sink, pa.ipc.new_file(sink, t.schema) as w:
        w.write_table(t)
    with pa.memory_map(str(tmp_path / "n.arrow")) as src:
        assert pa.ipc.open_file(src).read_all().equals(t)
    pq.write_table(t, tmp_path / "n.parquet")
    assert pq.read_table(tmp_path / "n.parquet").equals(t)
