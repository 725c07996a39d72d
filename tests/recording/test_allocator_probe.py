"""The CUDA allocator probe in a live trace (recording/allocator.py, the session's start/restore path).

Without a GPU (here and in CI) the probe is driven through its two seams, ``_cuda`` (torch.cuda
when initialised) and ``_history_api`` (torch's history functions), with stand-ins shaped as torch
2.13's (``memory_stats`` flat keys; ``_snapshot()`` segments/device_traces): they check the order
(snapshot before the history is turned off, also when the block raised), that a program's own
history recording is left alone, and that nothing initialises CUDA. The tests marked ``cuda``
run the real thing when a device is present.
"""
from __future__ import annotations

import time

import pytest
import torch

import tensorscope
from tensorscope.recording import allocator as probe_mod

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here or in CI)")


class FakeCuda:
    """Stand-in for an initialised torch.cuda: one device whose counters move during the block."""

    def __init__(self):
        self.calls = 0

    def device_count(self):
        return 1

    def memory_stats(self, d):
        self.calls += 1
        n = self.calls
        return {"allocated_bytes.all.current": 1024 * n, "allocated_bytes.all.peak": 4096 * n,
                "reserved_bytes.all.current": 2 << 20, "reserved_bytes.all.peak": 2 << 20,
                "inactive_split_bytes.all.current": 0, "allocation.all.allocated": n,
                "segment.all.allocated": 1, "num_alloc_retries": 0, "num_ooms": n - 1}


class FakeHistory:
    """Stand-in for torch.cuda.memory._record_memory_history / _snapshot / torch._C._cuda_isHistoryEnabled."""

    def __init__(self, on=False):
        self.on = on
        self.log = []

    def record(self, enabled="all", **kw):
        self.log.append(("record", enabled, kw.get("context")))
        self.on = enabled is not None

    def snapshot(self):
        self.log.append(("snapshot", self.on))
        now = time.time_ns() // 1000
        return {"segments": [{"device": 0, "address": 1 << 40, "total_size": 2 << 20, "allocated_size": 512,
                              "active_size": 512, "requested_size": 500, "stream": 0, "segment_type": "large",
                              "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                              "blocks": [{"address": 1 << 40, "size": 512, "requested_size": 500,
                                          "state": "active_allocated", "frames": []}]}],
                "device_traces": [[{"action": "alloc", "addr": 1 << 40, "size": 500, "stream": 0,
                                    "time_us": now - 10, "frames": []},
                                   {"action": "oom", "device_free": 0, "size": 1 << 50, "stream": 0,
                                    "time_us": now - 5, "frames": []}]],
                "allocator_settings": {}, "external_annotations": []}

    def is_enabled(self):
        return self.on


@pytest.fixture
def fake(monkeypatch):
    c, h = FakeCuda(), FakeHistory()
    monkeypatch.setattr(probe_mod, "_cuda", lambda: c)
    monkeypatch.setattr(probe_mod, "_history_api", lambda: probe_mod.HistoryAPI(h.record, h.snapshot, h.is_enabled))
    return c, h


def _work():
    x = torch.randn(8, 8)
    return (x @ x).sum()


def test_on_a_cpu_only_machine_the_option_notes_it_and_changes_nothing():
    torch.manual_seed(0)
    with tensorscope.trace() as plain:
        a = _work()
    torch.manual_seed(0)
    with tensorscope.trace(memory_history=True) as t:
        b = _work()
    assert torch.equal(a, b)
    assert [r["op"] for r in t.ops.select(["op"]).to_pylist()] == [r["op"] for r in plain.ops.select(["op"]).to_pylist()]
    if not torch.cuda.is_available():
        notes = [n for n in t.metadata.notes if n.startswith("memory_history")]
        assert len(notes) == 1 and "nothing recorded" in notes[0]
        assert t.allocator.num_rows == 0 and t.allocator_events.num_rows == 0
        assert not any(n.startswith("memory_history") for n in plain.metadata.notes)
        assert not torch.cuda.is_initialized()
    assert t.metadata.tracer_errors == 0


def test_stats_rows_without_history_and_nothing_reset(fake):
    c, h = fake
    with tensorscope.trace() as t:
        _work()
    rows = t.allocator.to_pylist()
    assert len(rows) == 1 and rows[0]["source"] == "stats" and rows[0]["device"] == "cuda:0"
    assert rows[0]["allocated_start"] == 1024 and rows[0]["allocated_end"] == 2048 and rows[0]["num_ooms"] == 1
    assert h.log == [] and t.allocator_events.num_rows == 0


def test_history_is_turned_on_then_snapshot_before_it_is_turned_off(fake):
    _c, h = fake
    with tensorscope.trace(memory_history=True) as t:
        _work()
    assert h.log == [("record", "all", None), ("snapshot", True), ("record", None, None)]
    assert not h.on
    assert t.allocator.column("source").to_pylist() == ["history"]
    assert t.allocator_segments.num_rows == 1 and t.allocator_blocks.num_rows == 1
    assert t.allocator_events.column("action").to_pylist() == ["alloc", "oom"]


def test_out_of_memory_in_the_block_still_snapshots_first_and_restores(fake):
    _c, h = fake
    tr = tensorscope.trace(memory_history=True)
    with pytest.raises(torch.OutOfMemoryError, match="stand-in"):
        with tr:
            _work()
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
    assert h.log == [("record", "all", None), ("snapshot", True), ("record", None, None)] and not h.on
    t = tr.result
    assert "oom" in t.allocator_events.column("action").to_pylist()
    assert any(r["py_type"] == "OutOfMemoryError" for r in t.errors.to_pylist())


def test_keyboard_interrupt_restores_the_history(fake):
    _c, h = fake
    with pytest.raises(KeyboardInterrupt):
        with tensorscope.trace(memory_history=True):
            raise KeyboardInterrupt
    assert h.log[-2:] == [("snapshot", True), ("record", None, None)] and not h.on


def test_a_programs_own_history_recording_is_left_alone(fake):
    _c, h = fake
    h.on = True
    with tensorscope.trace(memory_history=True) as t:
        _work()
    assert h.log == [("snapshot", True)] and h.on
    assert t.allocator_events.num_rows == 2


def test_cuda_not_initialised_is_never_initialised(monkeypatch):
    h = FakeHistory()
    monkeypatch.setattr(probe_mod, "_cuda", lambda: None)
    monkeypatch.setattr(probe_mod, "_history_api", lambda: probe_mod.HistoryAPI(h.record, h.snapshot, h.is_enabled))
    with tensorscope.trace(memory_history=True) as t:
        _work()
    assert h.log == []
    assert any("not initialised" in n for n in t.metadata.notes)


def test_the_option_is_a_flag_of_the_magic_and_the_cli():
    from tensorscope.options import TraceOptions, cli_flag, fields, to_flags

    f = [x for x in fields() if x.name == "memory_history"][0]
    assert cli_flag(f) == ("--memory-history",) and "snapshot" in f.metadata["help"]
    assert to_flags(TraceOptions(memory_history=True)) == ["--memory-history"]


# -- the real thing (a GPU machine; tests/gpu/check_cuda.py runs the same checks as a script) --------

@cuda
def test_cuda_stats_beside_our_view():
    torch.zeros(1, device="cuda")   # CUDA initialised before the block (tensorscope never does it)
    m = torch.nn.Linear(256, 256).cuda()
    x = torch.randn(64, 256, device="cuda")
    before = torch.cuda.max_memory_allocated()
    with tensorscope.trace() as t:
        m(x).sum().backward()
    r = t.allocator.to_pylist()[0]
    assert r["device"].startswith("cuda") and r["source"] == "stats"
    assert r["reserved_end"] >= r["allocated_end"] > 0 and r["fragmentation_bytes"] >= 0
    assert torch.cuda.max_memory_allocated() >= before   # nothing reset
    assert t.tensors.filter(t.tensors.column("device") != "cpu").column("address").null_count == 0


@cuda
def test_cuda_oom_snapshot_joined_to_our_categories():
    torch.zeros(1, device="cuda")
    m = torch.nn.Linear(256, 256).cuda()
    x = torch.randn(64, 256, device="cuda")
    was = torch._C._cuda_isHistoryEnabled()
    tr = tensorscope.trace(memory_history=True)
    with pytest.raises(torch.OutOfMemoryError):
        with tr:
            m(x).sum().backward()
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")   # far beyond any device: the allocator raises
    assert torch._C._cuda_isHistoryEnabled() == was
    t = tr.result
    a = t.allocator.to_pylist()[0]
    assert a["source"] == "history" and a["num_ooms"] >= 1 and a["fragmentation_seq"] is not None
    ev = t.allocator_events.to_pylist()
    assert any(e["action"] == "oom" for e in ev)
    cats = {e["category"] for e in ev if e["storage_id"] is not None}
    assert cats and cats <= set(tensorscope.schema.MEMORY_CATEGORIES)
    assert t.allocator_segments.num_rows > 0
    assert any(b["category"] == "parameter" for b in t.allocator_blocks.to_pylist())
    assert t.allocator_timeline.num_rows == len(ev)
    assert "CUDA caching allocator" in t.summary().to_text()
