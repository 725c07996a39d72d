"""A trace too big for memory: its summary, derived tables and saved files are those of the same trace in memory.

The trace is recorded with a tiny ``spill_rows``, so its ops table is decoded into a memory-mapped
Arrow file (checked in /proc/self/maps); its twin holds the same tables copied into memory. Saving
writes row groups of a few rows (many per table), and loading maps a table past ``mmap_rows`` through
an unlinked Arrow file instead of reading it into memory. Run under both engines
(TENSORSCOPE_FORCE_FALLBACK=1 for the python one).
"""
from __future__ import annotations

import os
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import tensorscope
from tensorscope import schema as S
from tensorscope._trace import Trace
from tensorscope.io import parquet as P

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def _record(spill_dir):
    """A small training loop (modules, backward, an optimizer, a dtype cast, a kept list of losses)
    recorded with chunks of 8 rows spilled past 16."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 6)
    kept = []
    os.makedirs(spill_dir, exist_ok=True)
    with tensorscope.trace(chunk_rows=8, spill_rows=16, spill_dir=str(spill_dir)) as t:
        for _ in range(3):
            opt.zero_grad()
            loss = model(x.double().float()).pow(2).mean()
            loss.backward()
            opt.step()
            kept.append(loss.detach())
    return t.result


def _mapped_under(directory) -> list[str]:
    """The files under ``directory`` mapped into this process (an unlinked one ends with " (deleted)")."""
    with open("/proc/self/maps") as f:
        fields = [line.split(None, 5) for line in f]
    return sorted({f[5].strip() for f in fields if len(f) == 6 and f[5].startswith(str(directory))})


def _in_memory(t: Trace) -> Trace:
    """The same trace with every recorded table copied into memory (one chunk each)."""
    tables = {name: t.table(name).combine_chunks() for name in S.RECORDED}
    return Trace(tables, t.metadata)


@linux_only
def test_summary_of_a_memory_mapped_trace_equals_the_in_memory_one(tmp_path):
    t = _record(tmp_path)
    assert t.metadata.get("spilled_rows")
    assert t.ops.column("op").num_chunks > 1
    assert _mapped_under(tmp_path), "the spilled trace's ops table is not memory-mapped"
    twin = _in_memory(t)
    assert twin.ops.column("op").num_chunks == 1
    for name in S.TABLES:
        assert t.table(name).equals(twin.table(name)), name
    for view in ("memory_timeline", "module_memory"):
        assert getattr(t, view).to_arrow().equals(getattr(twin, view).to_arrow()), view
    assert t.memory_at().to_arrow().equals(twin.memory_at().to_arrow())
    assert t.op_totals().equals(twin.op_totals())
    assert t.op_totals(by=("op", "phase")).equals(twin.op_totals(by=("op", "phase")))
    adv, adv2 = t.advice(), twin.advice()   # the roofline's groups read batch by batch, the twin's at once
    assert adv.roofline.num_rows and adv.roofline.equals(adv2.roofline)
    assert adv.findings.equals(adv2.findings)
    s, s2 = t.summary(), twin.summary()
    assert s.to_text() == s2.to_text()
    assert s.to_html() == s2.to_html()
    # the summary says something about this trace: its ops, a memory peak, an api row
    text = s.to_text()
    assert f"{t.ops.num_rows:,} ops" in text and "peak" in text and "aten.addmm.default" in text


def test_save_of_a_spilled_trace_round_trips_row_group_by_row_group(tmp_path):
    t = _record(tmp_path / "spill")
    path = P.save(t, tmp_path / "run", row_group_rows=7)
    ops_file = pq.ParquetFile(os.path.join(path, "ops.parquet"))
    assert ops_file.num_row_groups == -(-t.ops.num_rows // 7) > 1
    back = tensorscope.load(path)
    for name in S.TABLES:
        assert back.table(name).equals(t.table(name)), name
    assert back.summary().to_text() == Trace({n: t.table(n) for n in S.TABLES}, back.metadata).summary().to_text()


@linux_only
def test_load_maps_a_big_table_instead_of_reading_it(tmp_path, monkeypatch):
    t = _record(tmp_path / "spill")
    path = P.save(t, tmp_path / "run", row_group_rows=5)
    eager, md = P.read(path, mmap_rows=None)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))   # where the mapped files are made
    mapped, md2 = P.read(path, mmap_rows=10)
    assert md2 == md
    for name in S.TABLES:
        if name in eager:
            assert mapped[name].equals(eager[name]), name
            assert mapped[name].equals(t.table(name)), name
    big = [name for name in mapped if mapped[name].num_rows > 10]
    assert "ops" in big
    maps = _mapped_under(scratch)
    # each big table is mapped from a file already unlinked: nothing is left in the directory
    assert {os.path.basename(m) for m in maps} >= {f"{name}.arrow (deleted)" for name in big}
    assert os.listdir(scratch) == []
    assert Trace(mapped, md2).summary().to_text() == Trace(eager, md).summary().to_text()


def test_load_reads_into_memory_a_file_whose_row_groups_have_different_dictionaries(tmp_path):
    t = _record(tmp_path / "spill")
    path = P.save(t, tmp_path / "run")
    ops = t.ops
    # another writer's file: each row group with its own dictionary of op names
    parts = [pa.Table.from_arrays([c.chunk(0) if c.num_chunks == 1 else c for c in
                                   ops.slice(a, 10).combine_chunks().columns], schema=ops.schema)
             for a in range(0, ops.num_rows, 10)]
    parts = [p.set_column(p.schema.get_field_index("op"), "op",
                          pa.chunked_array([p.column("op").combine_chunks().dictionary_decode().dictionary_encode()]))
             for p in parts]
    schema = parts[0].schema
    file = os.path.join(path, "ops.parquet")
    meta = pq.read_schema(file).metadata
    with pq.ParquetWriter(file, schema.with_metadata(meta)) as w:
        for p in parts:
            w.write_table(p.cast(schema))
    tables, _ = P.read(path, mmap_rows=0)
    assert tables["ops"].equals(P.read(path, mmap_rows=None)[0]["ops"])
    assert tables["ops"].column("op").to_pylist() == ops.column("op").to_pylist()
