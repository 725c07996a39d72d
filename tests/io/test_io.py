"""Parquet round trips on real files, DuckDB over real exports, bad input, spilling."""
from __future__ import annotations

import json
import os
import stat

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import tensorscope
from tensorscope import schema as S
from tests.helpers import TESTS


def _traced():
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with tensorscope.trace() as t:
        y = m(x)
        y.sum().backward()
        try:
            x + torch.randn(5)
        except RuntimeError:
            pass
    return t.result


def test_save_load_round_trips_every_column(tmp_path):
    t = _traced()
    path = t.save(tmp_path / "run")
    files = sorted(os.listdir(path))
    assert "metadata.json" in files and "ops.parquet" in files
    assert all(f.endswith(".parquet") or f == "metadata.json" for f in files)
    assert pq.ParquetFile(os.path.join(path, "ops.parquet")).metadata.row_group(0).column(0).compression == "ZSTD"
    back = tensorscope.load(path)
    for name in S.TABLES:
        assert back.table(name).equals(t.table(name)), name
    md = json.load(open(os.path.join(path, "metadata.json")))
    for key in ("schema_version", "tensorscope_version", "torch_version", "python_version", "device", "options"):
        assert key in md
    assert back.metadata["torch_version"] == torch.__version__
    assert back.errors.num_rows == t.errors.num_rows >= 1


def test_duckdb_queries_the_exported_files(tmp_path):
    t = _traced()
    path = t.save(tmp_path / "run")
    con = duckdb.connect()
    n = con.execute(f"select count(*) from read_parquet('{path}/ops.parquet')").fetchone()[0]
    assert n == t.ops.num_rows
    by_phase = dict(con.execute(
        f"select phase, count(*) from read_parquet('{path}/ops.parquet') group by phase").fetchall())
    assert by_phase["forward"] > 0 and by_phase["backward"] > 0
    shapes = con.execute(f"select in_shapes from read_parquet('{path}/ops.parquet') where op = 'aten.addmm.default' "
                         "order by seq limit 1").fetchone()[0]
    assert shapes == [[8], [3, 4], [4, 8]]
    assert tensorscope.load(path).sql("select count(*) as n from ops")["n"][0] == n


def test_unwritable_path_is_a_clear_error_and_keeps_the_trace(tmp_path):
    t = _traced()
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    target = ro / "sub" / "run"
    try:
        if os.access(ro, os.W_OK):   # running as root: permissions do not bind, use a file in the way
            (tmp_path / "file").write_text("x")
            target = tmp_path / "file" / "run"
        with pytest.raises(tensorscope.errors.ExportError, match="still in memory"):
            t.save(target)
    finally:
        ro.chmod(stat.S_IRWXU)
    assert t.ops.num_rows > 0
    not_a_trace = tmp_path / "precious"
    not_a_trace.mkdir()
    (not_a_trace / "notes.txt").write_text("keep me")
    with pytest.raises(tensorscope.errors.ExportError, match="not a tensorscope trace"):
        t.save(not_a_trace)
    assert (not_a_trace / "notes.txt").read_text() == "keep me"


def test_newer_schema_major_is_refused(tmp_path):
    t = _traced()
    path = t.save(tmp_path / "run")
    mfile = os.path.join(path, "metadata.json")
    md = json.load(open(mfile))
    md["schema_version"] = f"{S.SCHEMA_MAJOR + 1}.0"
    json.dump(md, open(mfile, "w"))
    with pytest.raises(tensorscope.errors.SchemaVersionError, match="newer"):
        tensorscope.load(path)


def test_older_minor_with_missing_columns_loads(tmp_path):
    t = _traced()
    path = t.save(tmp_path / "run")
    ops = pq.read_table(os.path.join(path, "ops.parquet")).drop(["num_rel_err", "nonfinite"])
    pq.write_table(ops, os.path.join(path, "ops.parquet"))
    back = tensorscope.load(path)
    assert back.ops.column("num_rel_err").null_count == back.ops.num_rows
    assert back.ops.column("op").equals(t.ops.column("op"))


def test_not_a_trace_and_corrupt_files(tmp_path):
    with pytest.raises(tensorscope.errors.TraceFormatError):
        tensorscope.load(tmp_path)
    t = _traced()
    path = t.save(tmp_path / "run")
    with open(os.path.join(path, "ops.parquet"), "wb") as f:
        f.write(b"not parquet")
    with pytest.raises(tensorscope.errors.TraceFormatError):
        tensorscope.load(path)


def test_saved_traces_hold_no_pickle_and_loading_runs_no_code(tmp_path):
    t = _traced()
    path = t.save(tmp_path / "run")
    for f in os.listdir(path):
        data = open(os.path.join(path, f), "rb").read()
        assert b"\x80\x04\x95" not in data and b"\x80\x05\x95" not in data, f   # pickle protocol 4/5 frames
        if f.endswith(".parquet"):
            md = pq.read_schema(os.path.join(path, f)).metadata or {}
            assert b"pandas" not in md   # no pandas metadata to interpret
    with pytest.raises(TypeError, match="not pickled"):
        import pickle

        pickle.dumps(t)

    # a hostile directory: a column claiming pyarrow's pickle-based extension type, with a payload
    # that would create a file if it were ever unpickled
    import pickle

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = tmp_path / "evil"
    t.save(evil)
    field = pa.field("x", pa.int64(), metadata={b"ARROW:extension:name": b"arrow.py_extension_type",
                                               b"ARROW:extension:metadata": pickle.dumps(Payload())})
    ops = t.ops.append_column(field, pa.array(list(range(t.ops.num_rows)), pa.int64()))
    pq.write_table(ops, os.path.join(evil, "ops.parquet"))
    try:
        back = tensorscope.load(evil)
        assert back.ops.column_names == t.ops.column_names   # the unknown column is dropped
    except tensorscope.errors.TraceFormatError:
        pass                                                  # or refused: both are safe
    assert not marker.exists(), "loading a trace ran code"


def test_spill_keeps_memory_bounded_and_results_identical(tmp_path):
    x = torch.randn(4, 4)

    def work():
        z = x
        for _ in range(600):
            z = z + 1
        return z

    # spilling is the python engine's recorder; the native engine keeps its compact rows in C++ memory
    with tensorscope.trace(chunk_rows=64, spill_rows=128, spill_dir=str(tmp_path), engine="python") as t:
        work()
    with tensorscope.trace() as ref:
        work()
    assert t.metadata["spilled_rows"] > 0
    assert t.ops.num_rows == ref.ops.num_rows == 600
    cols = ["seq", "op", "in_shapes", "out_shapes", "in_storages", "source_line", "call_id"]
    a = t.ops.select(cols).to_pylist()
    b = ref.ops.select(cols).to_pylist()
    assert [r["op"] for r in a] == [r["op"] for r in b]
    assert [r["seq"] for r in a] == list(range(600))
    assert [r["source_line"] for r in a] == [r["source_line"] for r in b]
    out = t.save(tmp_path / "saved")
    assert tensorscope.load(out).ops.num_rows == 600
    leftovers = [p for p in os.listdir(tmp_path) if p.startswith("tensorscope-spill-")]
    assert leftovers == [], "spilled chunks are removed after the build"


def test_golden_file_of_each_released_schema_version_loads():
    golden = os.path.join(TESTS, "data")
    dirs = sorted(d for d in os.listdir(golden) if d.startswith("golden-schema-"))
    assert dirs, "a golden trace per released schema version lives in tests/data"
    for d in dirs:
        t = tensorscope.load(os.path.join(golden, d))
        assert t.metadata["schema_version"] == d.split("-")[-1]
        assert t.ops.schema.equals(S.OPS, check_metadata=False)
        ops = t.ops.to_pylist()
        assert [r["op"] for r in ops][:2] == ["aten.t.default", "aten.addmm.default"]
        assert ops[1]["in_shapes"] == [[4], [2, 4], [4, 4]] and ops[1]["module"] == "0"
        assert any(r["phase"] == "backward" and r["fwd_seq"] == 1 for r in ops)


def test_a_data_page_damaged_with_the_footer_intact_is_a_trace_format_error_naming_the_file(tmp_path):
    t = _traced()
    path = t.save(tmp_path / "run")
    f = os.path.join(path, "ops.parquet")
    meta = pq.ParquetFile(f).metadata
    col = meta.row_group(0).column(0)
    start = col.data_page_offset
    with open(f, "r+b") as fh:           # garbage over the first data page; footer and schema untouched
        fh.seek(start)
        fh.write(b"\xff" * min(64, col.total_compressed_size))
    assert pq.read_schema(f).names == S.OPS.names       # the footer still reads
    with pytest.raises(tensorscope.errors.TraceFormatError, match="ops.parquet.*damaged parquet data"):
        tensorscope.load(path)


def test_a_table_file_with_the_wrong_schema_is_refused_naming_the_columns(tmp_path):
    t = _traced()
    path = t.save(tmp_path / "run")
    f = os.path.join(path, "calls.parquet")
    good = pq.read_table(f)
    # wrong types: a string where ids are int64, a float where a name is a string
    bad = good.set_column(good.schema.get_field_index("call_id"), "call_id",
                          pa.array([str(v) for v in good.column("call_id").to_pylist()], pa.string()))
    bad = bad.set_column(bad.schema.get_field_index("name"), "name", pa.array([1.5] * bad.num_rows, pa.float64()))
    pq.write_table(bad, f)
    with pytest.raises(tensorscope.errors.TraceFormatError) as e:
        tensorscope.load(path)
    msg = str(e.value)
    assert "calls.parquet" in msg and "call_id (string, expected int64)" in msg and "name (double, expected string)" in msg
    # missing required columns: another table's file under this name is not loaded as a half-null trace
    pq.write_table(pq.read_table(os.path.join(path, "memory.parquet")), f)
    with pytest.raises(tensorscope.errors.TraceFormatError, match=r"missing required column\(s\) call_id, name"):
        tensorscope.load(path)
    # compatible storage types still load: int32 ids, dictionary-encoded strings
    ok = good.set_column(good.schema.get_field_index("call_id"), "call_id", good.column("call_id").cast(pa.int32()))
    ok = ok.set_column(ok.schema.get_field_index("name"), "name", ok.column("name").dictionary_encode())
    pq.write_table(ok, f)
    back = tensorscope.load(path)
    assert back.calls.column("call_id").to_pylist() == good.column("call_id").to_pylist()
    assert back.calls.column("name").to_pylist() == good.column("name").to_pylist()
