"""Perfetto / Chrome trace-event export: document structure, nesting, flows, counters, errors."""
from __future__ import annotations

import gzip
import json
import os

import pytest
import torch

import tensorscope
from tensorscope.errors import ExportError
from tensorscope.render.perfetto import CPU_PID, GPU_PID_BASE, trace_events, validate_trace_events, write_perfetto
from tests.helpers.synthetic import make_trace, table


def StandIn(**tables):
    return make_trace({"cell": 3, "wall_ns": 60_000, "device": {"torch": "x"}, "notes": ["a note"]}, **tables)


def _op(seq, op, start, dur, call_id, **kw):
    row = dict(seq=seq, op=op, start_ns=start, cpu_ns=dur, call_id=call_id, phase="forward", module="0",
               source_file="/tmp/cell.py", source_line=4, in_shapes=[[2, 3]], in_dtypes=["float32"],
               in_formats=["contiguous"], out_shapes=[[2, 3]], out_dtypes=["float32"], out_formats=["contiguous"],
               flops=12, bytes_read=24, bytes_written=24, cuda_ns=None)
    row.update(kw)
    return row


def sample_trace():
    calls = table("calls", [
        dict(call_id=0, parent_id=None, depth=0, name="linear", qualname="torch.nn.functional.linear", module="0",
             source_file="/tmp/cell.py", source_line=4, start_ns=1_000, dur_ns=20_000, n_ops=2),
        dict(call_id=1, parent_id=0, depth=1, name="t", qualname="Tensor.t", module="0",
             source_file="/tmp/cell.py", source_line=4, start_ns=2_000, dur_ns=3_000, n_ops=1),
        dict(call_id=2, parent_id=None, depth=0, name="relu", qualname="torch.relu", module="1",
             source_file="/tmp/cell.py", source_line=5, start_ns=30_000, dur_ns=5_000, n_ops=1),
    ])
    ops = table("ops", [
        _op(0, "aten.t.default", 2_500, 1_000, 1, flops=-1),
        _op(1, "aten.addmm.default", 8_000, 12_000, 0, cuda_ns=9_000),
        # measured by separate clock reads, it pokes 300 ns past its call: must be clamped, not overlap
        _op(2, "aten.relu.default", 31_000, 4_300, 2),
    ])
    kernels = table("kernels", [
        dict(seq=1, name="ampere_sgemm_64x64", device=0, stream=7, start_ns=9_000, dur_ns=8_000, grid=[4, 1, 1],
             block=[128, 1, 1], correlation_id=55),
        dict(seq=2, name="relu_kernel", device=0, stream=13, start_ns=33_000, dur_ns=1_000, correlation_id=56),
        dict(seq=None, name="probe_kernel", device=0, stream=7, start_ns=40_000, dur_ns=500, correlation_id=57),
        dict(seq=1, name="bad_stamp", device=0, stream=7, start_ns=None, dur_ns=100, correlation_id=58),
    ])
    memory = table("memory", [
        dict(seq=1, device="cuda:0", live_bytes=4096, delta_bytes=4096),
        dict(seq=2, device="cuda:0", live_bytes=8192, delta_bytes=4096),
        dict(seq=0, device="cpu", live_bytes=100, delta_bytes=100),
    ])
    return StandIn(ops=ops, calls=calls, kernels=kernels, memory=memory)


def _by(doc, **kw):
    return [e for e in doc["traceEvents"] if all(e.get(k) == v for k, v in kw.items())]


def test_document_is_well_formed_and_nested():
    doc = trace_events(sample_trace())
    assert validate_trace_events(doc) == []
    json.dumps(doc, allow_nan=False)
    assert doc["otherData"]["clamped_slices"] == 1
    assert doc["otherData"]["kernels_not_drawn"] == 1
    assert doc["otherData"]["cell"] == 3 and json.loads(doc["otherData"]["device"]) == {"torch": "x"}
    cpu = _by(doc, ph="X", pid=CPU_PID)
    assert [e["name"] for e in cpu] == ["linear", "t", "aten.t.default", "aten.addmm.default", "relu",
                                        "aten.relu.default"]
    relu_call = _by(doc, ph="X", name="relu")[0]
    relu_op = _by(doc, ph="X", name="aten.relu.default")[0]
    assert relu_op["ts"] + relu_op["dur"] <= relu_call["ts"] + relu_call["dur"] + 1e-9
    addmm = _by(doc, ph="X", name="aten.addmm.default")[0]
    assert addmm["ts"] == 8.0 and addmm["dur"] == 12.0                    # µs
    a = addmm["args"]
    assert a["in_shapes"] == [[2, 3]] and a["in_dtypes"] == ["float32"] and a["out_formats"] == ["contiguous"]
    assert a["module"] == "0" and a["line"] == "cell.py:4" and a["cuda_ns"] == 9_000 and a["flops"] == 12
    assert "flops" not in _by(doc, ph="X", name="aten.t.default")[0]["args"]   # -1: no formula, not a number
    assert _by(doc, ph="X", name="linear")[0]["args"]["qualname"] == "torch.nn.functional.linear"


def test_kernels_on_stream_tracks_with_flows_and_memory_counters():
    doc = trace_events(sample_trace())
    k = _by(doc, ph="X", cat="kernel")
    assert {(e["name"], e["pid"], e["tid"]) for e in k} == {
        ("ampere_sgemm_64x64", GPU_PID_BASE, 7), ("relu_kernel", GPU_PID_BASE, 13), ("probe_kernel", GPU_PID_BASE, 7)}
    assert _by(doc, ph="X", name="ampere_sgemm_64x64")[0]["args"]["op"] == "aten.addmm.default"
    names = {(e["pid"], e.get("tid"), e["args"]["name"]) for e in _by(doc, ph="M") if e["name"] in ("process_name", "thread_name")}
    assert (GPU_PID_BASE, None, "GPU cuda:0") in names and (GPU_PID_BASE, 7, "stream 7") in names
    assert (GPU_PID_BASE, 13, "stream 13") in names
    s, f = _by(doc, ph="s"), _by(doc, ph="f")
    assert len(s) == len(f) == 2                       # the unlinked probe kernel gets no arrow
    flow = {e["id"]: e for e in f}
    for e in s:
        assert e["pid"] == CPU_PID and flow[e["id"]]["bp"] == "e"
    c = _by(doc, ph="C")
    assert [(e["name"], e["args"]["live_bytes"]) for e in c] == [
        ("live bytes cpu", 100), ("live bytes cuda:0", 4096), ("live bytes cuda:0", 8192)]
    assert c[1]["pid"] == GPU_PID_BASE and c[0]["pid"] == CPU_PID


def test_timestamps_are_monotonic_in_emission_order():
    doc = trace_events(sample_trace())
    ts = [e["ts"] for e in doc["traceEvents"] if e["ph"] != "M"]
    assert ts == sorted(ts) and ts[0] >= 0
    assert all(e["ph"] == "M" for e in doc["traceEvents"][:len(doc["traceEvents"]) - len(ts)])


def test_validator_catches_broken_documents():
    ok = trace_events(sample_trace())
    assert validate_trace_events({"events": []})
    bad = json.loads(json.dumps(ok))
    xs = [e for e in bad["traceEvents"] if e["ph"] == "X" and e["pid"] == CPU_PID]
    xs[2]["dur"] = 10_000.0                                     # child now outlives its parent
    assert any("overlaps its parent" in p for p in validate_trace_events(bad))
    bad = json.loads(json.dumps(ok))
    bad["traceEvents"].append({"ph": "X", "pid": 1, "tid": 1, "name": "late", "ts": 0.5, "dur": 0.1})
    assert any("goes back" in p for p in validate_trace_events(bad))
    bad = json.loads(json.dumps(ok))
    bad["traceEvents"] = [e for e in bad["traceEvents"] if e["ph"] != "f"]
    assert any("start without finish" in p for p in validate_trace_events(bad))
    bad = json.loads(json.dumps(ok))
    bad["traceEvents"].append({"ph": "C", "pid": 1, "name": "c", "ts": 1e9, "args": {"v": "x"}})
    assert any("counter" in p for p in validate_trace_events(bad))


def test_empty_trace_exports():
    doc = trace_events(StandIn())
    assert validate_trace_events(doc) == []
    assert [e["ph"] for e in doc["traceEvents"]] == ["M", "M", "M"]


def test_write_plain_and_gzip(tmp_path):
    t = sample_trace()
    p = write_perfetto(t, tmp_path / "t.json")
    with open(p) as f:
        assert validate_trace_events(json.load(f)) == []
    pg = write_perfetto(t, str(tmp_path / "t.json.gz"))
    with gzip.open(pg, "rt") as f:
        assert json.load(f)["traceEvents"]


def test_unwritable_path_raises_export_error(tmp_path):
    with pytest.raises(ExportError, match="cannot write the Perfetto trace"):
        write_perfetto(sample_trace(), tmp_path / "no" / "such" / "dir" / "t.json")
    d = tmp_path / "adir"
    d.mkdir()
    with pytest.raises(ExportError):
        write_perfetto(sample_trace(), d)


def test_real_trace_of_a_small_cpu_model(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    with tensorscope.trace() as t:
        m(torch.randn(4, 8)).sum().backward()
    p = t.to_perfetto(os.path.join(tmp_path, "real.json"))
    with open(p) as f:
        doc = json.load(f)
    assert validate_trace_events(doc) == []
    ops = [e for e in doc["traceEvents"] if e.get("cat") == "op"]
    calls = [e for e in doc["traceEvents"] if e.get("cat") == "call"]
    assert len(ops) == t.ops.num_rows and len(calls) == t.calls.num_rows
    assert any(e["name"] == "aten.addmm.default" and e["args"].get("module") for e in ops)
    assert any(e["args"].get("phase") == "backward" for e in ops)
