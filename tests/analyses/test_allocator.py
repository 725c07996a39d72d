"""The CUDA caching allocator's view (analyses/allocator.py): counters, snapshot tables, the join.

No CUDA device is available here or in CI, so the snapshot below is a stand-in: a dict shaped
exactly as torch 2.13's ``torch.cuda.memory._snapshot()`` returns it (torch/csrc/cuda/Module.cpp,
``THCPModule_memorySnapshot``: ``segments`` with ``blocks``, ``device_traces`` of entries with
``action``, ``addr`` (``device_free`` for ``oom``), ``size``, ``stream``, ``time_us`` on the unix
clock in microseconds, ``frames``), and the ``memory_stats`` dicts use its flat keys. The real
thing runs in tests/recording/test_allocator_probe.py when a GPU is present, and in
tests/gpu/check_cuda.py.
"""
from __future__ import annotations

import json

import pyarrow as pa
import pytest

import tensorscope
from tensorscope import schema as S
from tensorscope.analyses.allocator import (
    allocator_rows,
    allocator_table,
    allocator_timeline,
    snapshot_tables,
    with_history,
)

A = 1_700_000_000_000_000_000          # the trace start on the unix clock (ns)
US = 1000
X, Y, Z, Q, P = 0x7F0000200000, 0x7F0000001000, 0x7F0000400000, 0x7F0000600000, 0x7F0000000000
MiB2 = 2 * 1024 * 1024


def _ops():
    rows = [{"seq": i, "op": "aten.mul.Tensor", "start_ns": i * 100 * US, "cpu_ns": 50 * US, "is_noise": False}
            for i in range(4)]
    return pa.Table.from_pylist([{f.name: r.get(f.name) for f in S.OPS} for r in rows], schema=S.OPS)


def _tensors():
    rows = [
        # a parameter made before the trace, alive at the end
        dict(storage_id=0, nbytes=4096, device="cuda:0", alloc_seq=None, free_seq=None, category="parameter", address=P),
        # made by op 0, freed in op 2; then op 2 makes another of the same size at the same address
        dict(storage_id=1, nbytes=8192, device="cuda:0", alloc_seq=0, free_seq=2, category="activation", address=X),
        dict(storage_id=2, nbytes=8192, device="cuda:0", alloc_seq=2, free_seq=3, category="temporary", address=X),
        dict(storage_id=3, nbytes=1024, device="cuda:0", alloc_seq=3, free_seq=None, category="other", address=Y),
        # made before the trace (its alloc is not in the history), freed in op 1
        dict(storage_id=4, nbytes=256, device="cuda:0", alloc_seq=None, free_seq=1, category="input", address=Q),
        dict(storage_id=5, nbytes=64, device="cpu", alloc_seq=0, free_seq=None, category="other", address=X),
    ]
    return pa.Table.from_pylist([{f.name: r.get(f.name) for f in S.TENSORS} for r in rows], schema=S.TENSORS)


def _ev(action, addr, size, t_ns, **extra):
    e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": (A + t_ns) // US, "frames": [],
         "compile_context": "N/A", "user_metadata": ""}
    if action == "oom":
        del e["addr"]
        e["device_free"] = extra["device_free"]
    return e


def snapshot():
    """A stand-in for torch 2.13's torch.cuda.memory._snapshot() (no CUDA device here)."""
    blocks1 = [{"address": P, "size": 4096, "requested_size": 4096, "state": "active_allocated", "frames": []},
               {"address": Y, "size": 1024, "requested_size": 1024, "state": "active_allocated", "frames": []},
               {"address": Y + 1024, "size": MiB2 - 5120, "requested_size": 0, "state": "inactive", "frames": []}]
    blocks2 = [{"address": X, "size": 8192, "requested_size": 8192, "state": "inactive", "frames": []},
               {"address": X + 8192, "size": MiB2 - 8192, "requested_size": 0, "state": "inactive", "frames": []}]
    seg = dict(device=0, stream=0, segment_type="large", segment_pool_id=(0, 0), is_expandable=False, frames=[])
    return {
        "segments": [dict(seg, address=P, total_size=MiB2, allocated_size=5120, active_size=5120,
                          requested_size=5120, blocks=blocks1),
                     dict(seg, address=X, total_size=MiB2, allocated_size=0, active_size=0, requested_size=0,
                          blocks=blocks2)],
        "device_traces": [[
            _ev("alloc", X, 8192, -5_000 * US),                 # older history: left out
            _ev("segment_alloc", X, MiB2, 10 * US),
            _ev("alloc", X, 8192, 20 * US),                     # sid 1
            _ev("alloc", Z, 512, 110 * US),                     # a workspace: not ours
            _ev("free_requested", Z, 512, 115 * US),
            _ev("free_completed", Z, 512, 116 * US),
            _ev("free_requested", Q, 256, 120 * US),            # sid 4, allocated before the trace
            _ev("free_completed", Q, 256, 121 * US),
            _ev("free_requested", X, 8192, 205 * US),           # sid 1
            _ev("free_completed", X, 8192, 206 * US),
            _ev("alloc", X, 8192, 210 * US),                    # sid 2: same address and size
            _ev("free_requested", X, 8192, 305 * US),
            _ev("free_completed", X, 8192, 306 * US),
            _ev("alloc", Y, 1024, 310 * US),                    # sid 3
            _ev("oom", None, 10 ** 12, 330 * US, device_free=12345),
            _ev("snapshot", 0, 5120, 340 * US),
        ], []],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1},
        "external_annotations": [],
    }


def stats(**kw):
    base = {"allocated_bytes.all.current": 4608, "allocated_bytes.all.peak": 4608,
            "reserved_bytes.all.current": MiB2, "reserved_bytes.all.peak": MiB2,
            "requested_bytes.all.current": 4352, "inactive_split_bytes.all.current": 0,
            "allocation.all.allocated": 10, "segment.all.allocated": 1, "num_alloc_retries": 0, "num_ooms": 0}
    base.update(kw)
    return base


START = {0: stats(), 1: stats(**{"allocation.all.allocated": 0})}
END = {0: stats(**{"allocated_bytes.all.current": 5120, "allocated_bytes.all.peak": 17000,
                   "reserved_bytes.all.current": 2 * MiB2, "reserved_bytes.all.peak": 2 * MiB2,
                   "inactive_split_bytes.all.current": 8192, "allocation.all.allocated": 14,
                   "segment.all.allocated": 2, "num_alloc_retries": 1, "num_ooms": 1}),
       1: stats(**{"allocation.all.allocated": 0})}


def test_counters_per_touched_device_during_the_trace():
    rows = allocator_rows(START, END, touched=[0])
    assert [r["device"] for r in rows] == ["cuda:0"]       # cuda:1: untouched, nothing moved
    r = rows[0]
    assert (r["allocated_start"], r["allocated_end"], r["allocated_peak"]) == (4608, 5120, 17000)
    assert (r["reserved_start"], r["reserved_end"], r["reserved_peak"]) == (MiB2, 2 * MiB2, 2 * MiB2)
    assert r["peak_in_trace"] and r["source"] == "stats"
    assert (r["num_alloc_retries"], r["num_ooms"], r["inactive_split_bytes"]) == (1, 1, 8192)
    assert r["fragmentation_bytes"] == 2 * MiB2 - 5120 and r["fragmentation_seq"] is None   # at the end
    # a device CUDA had no context for at the start counts from zero
    late = allocator_rows({}, {0: END[0]})[0]
    assert late["allocated_start"] == 0 and late["num_ooms"] == 1
    assert allocator_table(rows).schema.equals(S.ALLOCATOR)


def _tables():
    return snapshot_tables(snapshot(), anchor_unix_ns=A, tensors=_tensors(), ops=_ops())


def test_snapshot_becomes_tables_without_frames():
    t = _tables()
    for name, tab in t.items():
        assert tab.schema.equals(S.TABLES[name]), name
    seg = t["allocator_segments"].to_pylist()
    assert [(s["address"], s["total_size"], s["n_blocks"], s["segment_type"]) for s in seg] == [
        (P, MiB2, 3, "large"), (X, MiB2, 2, "large")]
    ev = t["allocator_events"].to_pylist()
    assert len(ev) == 15 and ev[0]["action"] == "segment_alloc"      # the older entry is left out
    assert ev[0]["start_ns"] == 10 * US and ev[0]["seq"] == 0
    oom = [e for e in ev if e["action"] == "oom"][0]
    assert oom["address"] is None and oom["device_free"] == 12345 and oom["size"] == 10 ** 12 and oom["seq"] == 3
    assert "frames" not in t["allocator_events"].column_names


def test_events_and_blocks_join_our_storages_by_address_and_time():
    t = _tables()
    got = [(e["action"], e["address"], e["storage_id"], e["category"]) for e in t["allocator_events"].to_pylist()
           if e["address"] in (X, Y, Z, Q)]
    assert got == [
        ("segment_alloc", X, None, None),         # a segment is no storage
        ("alloc", X, 1, "activation"),
        ("alloc", Z, None, None), ("free_requested", Z, None, None), ("free_completed", Z, None, None),
        ("free_requested", Q, 4, "input"), ("free_completed", Q, 4, "input"),
        ("free_requested", X, 1, "activation"), ("free_completed", X, 1, "activation"),
        ("alloc", X, 2, "temporary"),             # the same address and size again: the next storage
        ("free_requested", X, 2, "temporary"), ("free_completed", X, 2, "temporary"),
        ("alloc", Y, 3, "other"),
    ]
    blocks = {(b["address"], b["state"]): (b["storage_id"], b["category"]) for b in t["allocator_blocks"].to_pylist()}
    assert blocks[(P, "active_allocated")] == (0, "parameter")
    assert blocks[(Y, "active_allocated")] == (3, "other")
    assert blocks[(X, "inactive")] == (None, None)          # freed: nobody's


def test_timeline_and_fragmentation_at_our_peak():
    t = _tables()
    allocator = allocator_table(allocator_rows(START, END, touched=[0]))
    tl = allocator_timeline(t["allocator_events"], allocator)
    assert tl.schema.equals(S.ALLOCATOR_TIMELINE)
    rows = tl.to_pylist()
    assert rows[0]["reserved_bytes"] == 2 * MiB2 and rows[0]["allocated_bytes"] == 4608
    assert rows[1]["allocated_bytes"] == 4608 + 8192
    # our live bytes on cuda:0 peak while op 2 runs (an op's inputs count until it returns: storage 1,
    # freed in op 2, and storage 2, made by it: 20 KiB with the parameter); reserved - allocated at its end
    out = with_history(allocator, tl, _ops(), _tensors()).to_pylist()[0]
    assert out["source"] == "history" and out["fragmentation_seq"] == 2
    assert out["fragmentation_bytes"] == 2 * MiB2 - (4352 + 8192)


def _trace():
    tabs = {"ops": _ops(), "tensors": _tensors(), **_tables()}
    allocator = allocator_table(allocator_rows(START, END, touched=[0]))
    tl = allocator_timeline(tabs["allocator_events"], allocator)
    tabs["allocator"] = with_history(allocator, tl, tabs["ops"], tabs["tensors"])
    return tensorscope.Trace(tabs, {"n_ops": 4})


def test_summary_shows_allocated_vs_reserved_fragmentation_and_ooms():
    t = _trace()
    text = t.summary().to_text()
    assert "CUDA caching allocator" in text and "cuda:0" in text
    assert "at our peak, op 2" in text and "out of memory during the trace" in text
    assert "15 allocator events (9 joined to our storages)" in text
    html = t.summary().to_html()
    assert "CUDA caching allocator" in html and "reserved − allocated" in html
    assert t.allocator_timeline.num_rows == 15


def test_summary_escapes_what_it_shows():
    tabs = {"ops": _ops(), "tensors": _tensors()}
    rows = allocator_rows(START, END, touched=[0])
    rows[0]["device"] = "<script>cuda</script>"
    tabs["allocator"] = allocator_table(rows)
    html = tensorscope.Trace(tabs, {"n_ops": 4}).summary().to_html()
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_parquet_round_trip_and_old_traces(tmp_path):
    t = _trace()
    back = tensorscope.load(t.save(tmp_path / "run"))
    for name in ("allocator", "allocator_segments", "allocator_blocks", "allocator_events"):
        assert back.table(name).equals(t.table(name)), name
    assert back.tensors.column("address").to_pylist() == t.tensors.column("address").to_pylist()
    assert back.allocator_timeline.equals(t.allocator_timeline)
    files = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"allocator.parquet", "allocator_events.parquet"} <= files
    md = json.load(open(tmp_path / "run" / "metadata.json"))
    assert md["schema_version"] == S.SCHEMA_VERSION and S.parse_version(S.SCHEMA_VERSION) >= (1, 4)


@pytest.mark.parametrize("version", ["1.1", "1.2", "1.3"])
def test_traces_older_than_1_4_load_with_empty_allocator_tables(version):
    import os

    old = tensorscope.load(os.path.join(os.path.dirname(__file__), "..", "data", f"golden-schema-{version}"))
    for name in ("allocator", "allocator_segments", "allocator_blocks", "allocator_events"):
        assert old.table(name).num_rows == 0 and old.table(name).schema.equals(S.TABLES[name], check_metadata=False)
    assert old.tensors.column("address").null_count == old.tensors.num_rows
    assert old.allocator_timeline.num_rows == 0


def test_dataset_carries_the_allocator_tables(tmp_path):
    from tensorscope.io.dataset import write_trace

    t = _trace()
    ident = {"run_id": "r1", "rank": 0, "attempt": 0, "world_size": 1, "local_rank": 0}
    write_trace(t, tmp_path / "ds", ident=ident)
    ds = tensorscope.open_dataset(tmp_path / "ds")
    back = ds.trace()
    for name in ("allocator", "allocator_segments", "allocator_blocks", "allocator_events"):
        assert back.table(name).num_rows == t.table(name).num_rows, name
    assert back.allocator.column("fragmentation_bytes").to_pylist() == t.allocator.column("fragmentation_bytes").to_pylist()
    n = ds.sql("SELECT count(*) AS n FROM allocator_events WHERE action = 'oom'")
    assert int(n["n"][0]) == 1
