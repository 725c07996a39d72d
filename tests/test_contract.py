"""The typed contract: TraceOptions parsed once, DisplayOptions and RunContext apart from them,
TraceMetadata in metadata.json and in every parquet file's key-value metadata, a read-only Trace."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import tensorscope
from tensorscope import schema as S
from tensorscope.errors import OptionsError, SchemaVersionError, TraceFormatError
from tensorscope.metadata import PARQUET_KEY, TraceMetadata

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _small(**options):
    lin = torch.nn.Linear(4, 4)
    with tensorscope.trace(leaks=False, **options) as t:
        lin(torch.randn(2, 4)).relu().sum()
    return t.result


# -- options: one typed object ----------------------------------------------------------------

def test_trace_takes_an_options_object_and_keywords_replace_its_fields():
    opts = tensorscope.TraceOptions(modules=False, leaks=False)
    with tensorscope.trace(opts, flops=False) as t:
        torch.nn.Linear(2, 2)(torch.randn(1, 2))
    md = t.metadata
    assert isinstance(md, TraceMetadata) and isinstance(md.options, tensorscope.TraceOptions)
    assert (md.options.modules, md.options.flops, md.options.leaks) == (False, False, False)
    assert md["options"]["modules"] is False and md.options.changed() == {"modules": False, "flops": False,
                                                                          "leaks": False}
    assert t.ops.column("module").null_count == t.ops.num_rows    # modules off: no module recorded


@pytest.mark.parametrize("kwargs, match", [
    ({"modulez": False}, r"unknown trace option\(s\): modulez; known: .*modules"),
    ({"_cell": 3}, r"unknown trace option\(s\): _cell"),   # the context is not an option
    ({"modules": "no"}, "modules must be True or False"),
    ({"chunk_rows": 1.5}, "chunk_rows must be an integer"),
    ({"baseline_time": float("nan")}, "baseline_time must be a finite number"),
    ({"max_casts": -1}, "max_casts must be >= 0"),
    ({"numerics_threshold": -1.0}, "numerics_threshold must be >= 0"),
    ({"expect": "fast"}, "unknown expectation 'fast'"),
])
def test_bad_options_fail_before_anything_runs(kwargs, match):
    ran = []
    with pytest.raises(OptionsError, match=match):
        with tensorscope.trace(**kwargs):
            ran.append(1)
    assert ran == []


def test_trace_refuses_a_non_options_positional_and_a_bad_context():
    with pytest.raises(OptionsError, match="takes a TraceOptions"):
        tensorscope.trace({"modules": False})
    with pytest.raises(OptionsError, match="origin must be one of"):
        tensorscope.options.RunContext(origin="elsewhere")
    with pytest.raises(OptionsError, match="cell must be an integer"):
        tensorscope.options.RunContext(cell="3")


def test_options_objects_are_frozen():
    opts = tensorscope.TraceOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.modules = False
    assert opts.replace(modules=False).modules is False and opts.modules is True
    with pytest.raises(OptionsError, match="unknown trace option"):
        opts.replace(numerics_threshold=0.5)   # a display option, not a trace option


def test_flags_parse_once_into_typed_objects_and_back():
    import argparse

    from tensorscope import options as O

    p = argparse.ArgumentParser()
    O.add_to_parser(p)
    ns = p.parse_args(["--no-modules", "--numerics", "--expect", "no_leaks", "--expect", "channels_last",
                       "--max-casts", "3", "--numerics-threshold", "0.5"])
    opts, display = O.parse_namespace(ns)
    assert opts == tensorscope.TraceOptions(modules=False, numerics="fp32", expect=("no_leaks", "channels_last"),
                                            max_casts=3)
    assert display == tensorscope.DisplayOptions(numerics_threshold=0.5)
    again = O.parse_namespace(p.parse_args(O.to_flags(opts, display)))
    assert again == (opts, display)
    with pytest.raises(OptionsError, match="spill_rows >= chunk_rows"):
        O.parse_namespace(p.parse_args(["--chunk-rows", "10", "--spill-rows", "5"]))


# -- display options are not recorded ----------------------------------------------------------

def test_display_options_change_the_summary_not_the_trace(tmp_path):
    with tensorscope.trace(numerics=True, leaks=False) as t:
        torch.ones(70000, dtype=torch.float16).sum()      # inf against 70000: an infinite error
        torch.randn(4096).half().cumsum(0)                # a small, finite one
    assert "numerics_threshold" not in t.metadata["options"]
    strict = t.summary(tensorscope.DisplayOptions(numerics_threshold=0.0)).to_text()
    loose = t.summary(tensorscope.DisplayOptions(numerics_threshold=1e300)).to_text()
    assert "numerics error | aten.cumsum.default" in strict and "numerics error | aten.cumsum" not in loose
    assert "above rel. error 1e+300" in loose and "numerics error | aten.sum.default" in loose   # inf > any threshold
    back = tensorscope.load(t.save(tmp_path / "n"))
    assert back.summary(tensorscope.DisplayOptions(numerics_threshold=0.0)).to_text().count("numerics error") == \
        strict.count("numerics error")


def test_cli_summary_takes_the_display_options(tmp_path):
    with tensorscope.trace(numerics=True, leaks=False) as t:
        torch.randn(4096).half().cumsum(0)                # a small, finite error
    path = t.save(tmp_path / "n")
    def run(*a):
        return subprocess.run([sys.executable, "-m", "tensorscope", "summary", path, *a],
                              capture_output=True, text=True, timeout=300)
    strict, loose, bad = run("--numerics-threshold", "0"), run("--numerics-threshold", "1e300"), run(
        "--numerics-threshold", "-1")
    assert strict.returncode == loose.returncode == 0, strict.stderr + loose.stderr
    assert "numerics error | aten.cumsum.default" in strict.stdout
    assert "numerics error" not in loose.stdout and "above rel. error 1e+300" in loose.stdout
    assert bad.returncode == 2 and "numerics_threshold must be >= 0" in bad.stderr


# -- TraceMetadata: typed, JSON, and in every parquet file ----------------------------------------

def test_metadata_is_typed_and_round_trips_through_json_and_load(tmp_path):
    t = _small(modules=False)
    md = t.metadata
    assert md.schema_version == S.SCHEMA_VERSION and md.torch_version == torch.__version__
    assert md.engine in ("native", "python") and md.n_ops == t.ops.num_rows and md.origin == "api"
    assert TraceMetadata.from_json(md.to_json(), where="x") == md
    path = t.save(tmp_path / "run")
    assert md.saved_to is None and t.metadata is md and t.saved_to == path     # save() changes nothing: it says where
    back = tensorscope.load(path)
    assert back.metadata.options == t.metadata.options
    assert back.metadata.replace(saved_to=None, tables=None) == t.metadata.replace(saved_to=None, tables=None)
    on_disk = json.load(open(os.path.join(path, "metadata.json")))
    assert on_disk["options"]["modules"] is False and on_disk["tables"]["ops"] == t.ops.num_rows
    assert on_disk["saved_to"] is None and back.metadata.saved_to == path   # where it is now, never written


def test_every_parquet_file_carries_the_metadata_for_pyarrow_and_duckdb(tmp_path):
    import duckdb

    path = _small(modules=False).save(tmp_path / "run")
    files = sorted(f for f in os.listdir(path) if f.endswith(".parquet"))
    assert files == sorted(f"{name}.parquet" for name in S.TABLES)
    for f in files:
        kv = pq.read_schema(os.path.join(path, f)).metadata
        md = json.loads(kv[PARQUET_KEY])
        assert md["format"] == "tensorscope-trace" and md["options"]["modules"] is False, f
    con = duckdb.connect()
    rows = con.execute("SELECT file_name, decode(value) FROM parquet_kv_metadata(?) WHERE decode(key) = 'tensorscope'",
                       [os.path.join(path, "*.parquet")]).fetchall()
    assert len(rows) == len(files)
    assert {json.loads(v)["options"]["modules"] for _, v in rows} == {False}
    # "modules off" and "no module" are told apart from the files alone
    got = con.execute(
        "SELECT json_extract(decode(value), '$.options.modules')::BOOLEAN FROM parquet_kv_metadata(?) "
        "WHERE decode(key) = 'tensorscope'", [os.path.join(path, "ops.parquet")]).fetchone()
    assert got == (False,)


def test_dataset_parts_carry_the_metadata(tmp_path):
    import duckdb

    root = tmp_path / "ds"
    with tensorscope.trace(dataset=str(root), leaks=False, modules=False,
                           context=tensorscope.options.RunContext(cell=7, cell_source="y = x")):
        torch.randn(3).exp()
    parts = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".parquet")]
    assert parts
    for p in parts:
        md = json.loads(pq.read_schema(p).metadata[PARQUET_KEY])
        assert md["options"]["modules"] is False and md["cell"] == 7 and md["distributed"]["rank"] == 0, p
    n = duckdb.connect().execute("SELECT count(*) FROM parquet_kv_metadata(?) WHERE decode(key) = 'tensorscope'",
                                 [os.path.join(str(root), "*", "*", "*", "part-*.parquet")]).fetchone()[0]
    assert n == len(parts)
    t = tensorscope.open_dataset(root).trace()
    assert isinstance(t.metadata, TraceMetadata) and t.metadata.cell == 7 and t.metadata.options.modules is False


def test_golden_traces_still_load_and_keep_what_this_version_does_not_know(tmp_path):
    old = tensorscope.load(os.path.join(GOLDEN, "golden-schema-1.1"))
    assert old.metadata.schema_version == "1.1"
    assert old.metadata["compiled_calls"] is not None and "compiled_calls" in old.metadata.extra   # 1.1's own key
    assert not hasattr(old.metadata.options, "numerics_threshold")   # a display option now: ignored
    again = tensorscope.load(old.save(tmp_path / "again"))
    assert again.metadata["compiled_calls"] == old.metadata["compiled_calls"]
    assert tensorscope.load(os.path.join(GOLDEN, "golden-schema-1.2")).metadata.engine == "native"


# -- load() re-validates ------------------------------------------------------------------------

def _rewrite_json(path, change):
    f = os.path.join(path, "metadata.json")
    md = json.load(open(f))
    change(md)
    with open(f, "w") as out:
        json.dump(md, out)
    return f


@pytest.mark.parametrize("change, err, match", [
    (lambda md: md.update(n_ops="many"), TraceFormatError, r"metadata\.json.*field 'n_ops'.*wrong kind"),
    (lambda md: md["options"].update(modules="off"), TraceFormatError, r"metadata\.json.*invalid trace options"),
    (lambda md: md.update(format="something-else"), TraceFormatError, r"metadata\.json.*not tensorscope"),
    (lambda md: md.update(schema_version="99.0"), SchemaVersionError, "newer than this tensorscope"),
    (lambda md: md.update(schema_version="one"), TraceFormatError, "unreadable schema version"),
])
def test_a_damaged_or_foreign_metadata_file_is_refused_naming_it(tmp_path, change, err, match):
    path = _small().save(tmp_path / "run")
    _rewrite_json(path, change)
    with pytest.raises(err, match=match):
        tensorscope.load(path)


def test_metadata_that_is_not_json_or_not_an_object_is_refused(tmp_path):
    path = _small().save(tmp_path / "run")
    f = os.path.join(path, "metadata.json")
    for text in ("{not json", "[1, 2]"):
        open(f, "w").write(text)
        with pytest.raises(TraceFormatError, match="metadata.json"):
            tensorscope.load(path)


def test_a_parquet_file_with_damaged_or_newer_kv_metadata_is_refused_naming_it(tmp_path):
    path = _small().save(tmp_path / "run")
    calls = os.path.join(path, "calls.parquet")
    table = pq.read_table(calls)
    kv = dict(table.schema.metadata)
    pq.write_table(table.replace_schema_metadata({**kv, PARQUET_KEY: b"{broken"}), calls)
    with pytest.raises(TraceFormatError, match=r"calls\.parquet.*b'tensorscope'.*not valid JSON"):
        tensorscope.load(path)
    newer = json.loads(kv[PARQUET_KEY])
    newer["schema_version"] = f"{S.SCHEMA_MAJOR + 1}.0"
    pq.write_table(table.replace_schema_metadata({**kv, PARQUET_KEY: json.dumps(newer).encode()}), calls)
    with pytest.raises(SchemaVersionError, match=r"calls\.parquet"):
        tensorscope.load(path)


# -- a finished or loaded Trace is read-only ------------------------------------------------------

def test_a_finished_trace_cannot_be_changed_by_callers(tmp_path):
    t = _small()
    for target in (t, tensorscope.load(t.save(tmp_path / "run"))):
        with pytest.raises(AttributeError, match="read-only"):
            target.metadata = {}
        with pytest.raises(AttributeError, match="read-only"):
            target.ops = pa.table({})
        with pytest.raises(AttributeError, match="read-only"):
            del target.metadata
        with pytest.raises(TypeError):
            target.metadata["cell"] = 3
        with pytest.raises(dataclasses.FrozenInstanceError):
            target.metadata.cell = 3
        notes = target.metadata["notes"]
        notes.append("mine")                          # a copy: the trace's own notes do not change
        target.metadata["options"]["modules"] = False
        assert "mine" not in target.metadata["notes"] and target.metadata.options.modules is True
        assert isinstance(target.metadata.notes, tuple)
        with pytest.raises(TypeError):
            target.metadata.device["x"] = 1           # nested mappings are read-only too


def test_metadata_is_checked_and_frozen_however_it_is_made():
    with pytest.raises(TraceFormatError, match="field 'n_ops' has a value of the wrong kind"):
        TraceMetadata(n_ops="many")
    with pytest.raises(TraceFormatError, match="'options' must be a TraceOptions"):
        TraceMetadata(options={"modules": False})
    mine = {"rank": 1, "hosts": ["a"]}
    md = TraceMetadata(distributed=mine)
    mine["rank"] = 2
    mine["hosts"].append("b")                       # the caller's dict is not the metadata's
    assert md.distributed == {"rank": 1, "hosts": ("a",)}
    with pytest.raises(TraceFormatError, match="field 'notes'"):
        md.replace(notes="one string")              # replace() checks what it changes
    assert md.replace(n_ops=3).n_ops == 3 and md.n_ops == 0
    assert md.replace(future_key={"a": 1})["future_key"] == {"a": 1} and "future_key" not in md


def test_metadata_keeps_the_mapping_api_of_earlier_versions():
    md = _small().metadata
    assert md["engine"] == md.get("engine") == md.engine
    assert "options" in md and "nope" not in md and md.get("nope", 1) == 1
    assert set(md) >= {"schema_version", "options", "cell", "notes", "n_ops", "wall_ns"} and len(md) == len(list(md))
    assert dict(md)["n_ops"] == md.n_ops
    json.dumps(dict(md))   # every value is plain JSON


# -- the CLI parses the same declarations once --------------------------------------------------

def test_cli_run_refuses_a_bad_option_before_running(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("open(%r, 'w').write('ran')\n" % str(tmp_path / "ran"))
    r = subprocess.run([sys.executable, "-m", "tensorscope", "run", "--chunk-rows", "10", "--spill-rows", "5",
                        "--out", str(tmp_path / "ds"), str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "spill_rows >= chunk_rows" in r.stderr
    assert not (tmp_path / "ran").exists()


def test_cli_run_records_its_options_and_origin(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import torch\ntorch.randn(3).exp()\n")
    out = tmp_path / "ds"
    r = subprocess.run([sys.executable, "-m", "tensorscope", "run", "--no-modules", "--no-leaks", "--out", str(out),
                        str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    md = tensorscope.open_dataset(out).trace().metadata
    assert md.origin == "cli" and md.options.modules is False and md.options.dataset == str(out)


# -- the magic: flags -> TraceOptions -> trace -> file -> load -------------------------------------

@pytest.mark.kernel
def test_magic_options_round_trip_to_the_files_and_back(tmp_path):
    from tests.helpers.kernel_utils import Kernel

    k = Kernel(cwd=str(tmp_path))
    try:
        r = k.run("%load_ext tensorscope\nimport torch, tensorscope\nx = torch.randn(4, 4)")
        assert r.status == "ok", r.error
        save = tmp_path / "cell"
        r = k.run(f"%%tensorscope -q -o t --no-modules --no-leaks --max-casts 9 --numerics-threshold 0.5 "
                  f"--save {save}\ny = (x @ x).relu()")
        assert r.status == "ok", r.error
        assert k.value("t.metadata.origin") == "magic"
        assert k.value("t.metadata.cell") == r.execution_count
        assert k.value("t.metadata.cell_source") == "y = (x @ x).relu()\n"
        assert k.value("t.saved_to") == str(save)
        assert k.value("t.metadata.options.changed()") == {"modules": False, "leaks": False, "max_casts": 9}
        back = tensorscope.load(save)
        assert back.metadata.options == tensorscope.TraceOptions(modules=False, leaks=False, max_casts=9)
        assert back.metadata.cell == r.execution_count and back.metadata.origin == "magic"
        kv = json.loads(pq.read_schema(os.path.join(save, "ops.parquet")).metadata[PARQUET_KEY])
        assert kv["options"]["modules"] is False and "numerics_threshold" not in kv["options"]
        # an unknown flag or a bad value: a usage error, and the cell does not run
        r = k.run("%%tensorscope --no-modulez\nran = True")
        assert r.status == "error" and r.error["ename"] == "UsageError"
        r = k.run("%%tensorscope --chunk-rows 10 --spill-rows 5\nran = True")
        assert r.status == "error" and "spill_rows >= chunk_rows" in r.error["evalue"]
        assert k.value("'ran' in globals()") is False
        # always-on cells carry their own origin, and the options parsed once by %tensorscope on
        assert k.run("%tensorscope on --no-flops").status == "ok"
        r = k.run("z = x.exp()")
        assert r.status == "ok", r.error
        assert k.run("%tensorscope off").status == "ok"
        assert k.value("(tensorscope.last().metadata.origin, tensorscope.last().metadata.options.flops)") == \
            ("always_on", False)
    finally:
        k.close()


def test_parts_written_while_the_trace_records_carry_what_is_known_then(tmp_path):
    root = tmp_path / "ds"
    # the python engine spills rows to parts while it records (the native engine writes at the end)
    with tensorscope.trace(dataset=str(root), leaks=False, modules=False, chunk_rows=8, spill_rows=16,
                           engine="python") as t:
        x = torch.zeros(4)
        for _ in range(60):
            x = x + 1
    ops_parts = sorted(os.path.join(d, f) for d, _, fs in os.walk(root / "ops") for f in fs if f.endswith(".parquet"))
    assert len(ops_parts) > 1                               # spilled parts, then the rest at the end
    kvs = [json.loads(pq.read_schema(p).metadata[PARQUET_KEY]) for p in ops_parts]
    assert all(md["options"]["modules"] is False and md["options"]["spill_rows"] == 16 for md in kvs)
    early = [md for md in kvs if md["n_ops"] == 0]
    assert early and all("written while the trace was recording" in md["notes"][0] for md in early)
    assert any(md["n_ops"] == t.ops.num_rows for md in kvs)   # the final parts: the whole metadata
