"""Single-process datasets: layout, canonical schema, open_dataset, bad input, escaping."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import tensorscope
from tensorscope import schema as S
from tensorscope.errors import ExportError, OptionsError, TraceFormatError
from tests.helpers.datasets import check_layout


def _same(a, b) -> bool:
    """Equal values: dictionary columns compare by value (their dictionaries may be laid out differently
    once a table went through parquet)."""
    return S.plain_strings(a).equals(S.plain_strings(b))


def _traced(root, **kw):
    with tensorscope.trace(dataset=str(root), leaks=False, **kw) as t:
        x = torch.randn(8, 8)
        (x @ x).relu().sum()
    return t.result


def test_one_process_writes_one_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORSCOPE_RUN_ID", "2024-01-01:x/y=z")   # date-like, with : / =
    root = tmp_path / "ds"
    t = _traced(root)
    t2 = _traced(root)
    check_layout(str(root))
    ds = tensorscope.open_dataset(root)
    assert ds.runs == ["r2024-01-01-x-y-z"]   # a letter first; no ':', '/', '='
    r = ds.ranks
    assert list(r["trace_id"]) == [0, 1] and set(r["rank"]) == {0} and set(r["rank_source"]) == {"default"}
    assert not r["clock_synced"].any()
    back = ds.trace(trace_id=1)
    assert _same(back.ops, t2.ops) and _same(back.calls, t2.calls)
    assert back.metadata["torch_version"] == torch.__version__
    with pytest.raises(ValueError, match="trace_id"):
        ds.trace()
    # every table, also the empty ones, has parts with the full schema (collectives: 0 rows, typed)
    part = next((root / "collectives").rglob("part-*.parquet"))
    assert pq.read_table(part).num_rows == 0
    assert pq.read_schema(part).remove_metadata().equals(S.dataset_schema("collectives").remove_metadata())
    assert t.metadata["dataset"]["trace_id"] == 0


def test_all_null_columns_keep_their_types(tmp_path):
    from tensorscope.io.dataset import to_dataset_table

    ops = pa.table({"seq": pa.array([0, 1], pa.int64()), "cuda_ns": pa.nulls(2), "module": pa.nulls(2)})
    t = to_dataset_table("ops", ops, attempt=0, trace_id=0)
    assert t.schema.field("cuda_ns").type == pa.int64() and t.schema.field("module").type == S.OPS.field("module").type
    assert t.schema.equals(S.dataset_schema("ops"))


def test_sql_df_and_summary_escape(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORSCOPE_RUN_ID", "run1")
    root = tmp_path / "ds"
    with tensorscope.trace(dataset=str(root), leaks=False,
                           context=tensorscope.options.RunContext(cell=3, cell_source="<script>alert(1)</script>")):
        torch.ones(3).add(1)
    ds = tensorscope.open_dataset(root)
    assert int(ds.sql("SELECT count(*) AS n FROM ops")["n"][0]) == len(ds.df("ops")) >= 1
    assert ds.sql("SELECT cell_source FROM ranks")["cell_source"][0] == "<script>alert(1)</script>"
    html = ds.summary().to_html()
    assert "<script>" not in html
    assert isinstance(ds.sql("SELECT * FROM ops", arrow=True), pa.Table)


def test_bad_input(tmp_path):
    with pytest.raises(OptionsError):
        tensorscope.trace(dataset=3)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ExportError, match="a file with that name exists"):
        with tensorscope.trace(dataset=str(f), leaks=False):
            torch.ones(2) + 1
    assert tensorscope.last().ops.num_rows == 2   # the trace is kept (ones, add)
    with pytest.raises(TraceFormatError):
        tensorscope.open_dataset(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceFormatError, match="not a tensorscope dataset"):
        tensorscope.open_dataset(tmp_path / "empty")


def test_user_exception_wins_over_a_failed_write(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.warns(RuntimeWarning, match="a file with that name exists"):
        with pytest.raises(KeyError, match="mine"):
            with tensorscope.trace(dataset=str(f), leaks=False):
                raise KeyError("mine")


def test_newer_schema_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORSCOPE_RUN_ID", "run1")
    root = tmp_path / "ds"
    _traced(root)
    part = next((root / "ranks").rglob("part-*.parquet"))
    t = pq.read_table(part)
    t = t.set_column(t.schema.get_field_index("schema_version"), "schema_version", pa.array(["99.0"]))
    pq.write_table(t, part)
    with pytest.raises(tensorscope.errors.SchemaVersionError):
        tensorscope.open_dataset(root)


def test_big_tables_roll_into_parts(tmp_path, monkeypatch):
    from tensorscope.io import dataset as D

    monkeypatch.setattr(D, "PART_ROWS", 4)
    monkeypatch.setenv("TENSORSCOPE_RUN_ID", "run1")
    root = tmp_path / "ds"
    t = _traced(root)   # randn, mm, relu, sum + calls...
    with tensorscope.trace(dataset=str(root), leaks=False) as t2:
        x = torch.ones(3)
        for _ in range(5):
            x = x + 1
    check_layout(str(root))
    parts = sorted(os.listdir(root / "ops" / "run=run1" / "rank=0"))
    assert len(parts) == 1 + 2 and parts[0] == "part-a0-00000.parquet"   # 4 ops, then 6 ops in two parts
    ds = tensorscope.open_dataset(root)
    assert _same(ds.trace(trace_id=1).ops, t2.result.ops)
    assert _same(ds.trace(trace_id=0).ops, t.ops)


@pytest.mark.parametrize("engine", ["native", "python"])
def test_spilled_rows_become_parts_while_the_trace_runs(tmp_path, monkeypatch, engine):
    if engine == "native":
        from tests.recording.test_tables_build import _native

        _native()
    monkeypatch.setenv("TENSORSCOPE_RUN_ID", "run1")
    root = tmp_path / "ds"
    seen = []
    with tensorscope.trace(dataset=str(root), leaks=False, chunk_rows=8, spill_rows=16, engine=engine) as t:
        x = torch.ones(3)
        for i in range(60):
            x = x + 1
            if i == 40:   # parts of the rows spilled so far are on disk, complete and readable now
                files = sorted((root / "ops" / "run=run1" / "rank=0").glob("part-*.parquet"))
                seen = [pq.read_table(f).num_rows for f in files]
        y = x.sum()
    assert t.metadata["engine"] == engine
    assert len(seen) >= 1 and sum(seen) >= 16
    check_layout(str(root))
    ds = tensorscope.open_dataset(root)
    back = ds.trace()
    assert back.ops.num_rows == t.ops.num_rows == 62
    assert _same(back.ops, t.ops)
    assert _same(back.calls, t.calls)
