"""Table building from the engines' columns: the list-column gather (native and numpy give the
same buffers), the native engine's packed row chunks, and its spilling past ``spill_rows`` (to
disk, and as ``dataset=`` parts while the trace runs)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import tensorscope
from tensorscope.recording import columns as build


def _native():
    from tensorscope.recording.engines import _native_ext

    ext, reason = _native_ext(wait=True)
    if ext is None:
        if os.environ.get("TENSORSCOPE_REQUIRE_NATIVE") == "1" and "FORCE_FALLBACK" not in reason:
            pytest.fail(f"TENSORSCOPE_REQUIRE_NATIVE=1 but the native engine is unavailable: {reason}")
        pytest.skip(f"native engine unavailable: {reason}")
    return ext


def _numpy_gather(ids, starts, lens, flat):
    """The reference: python lists, one row at a time."""
    keys = range(len(starts)) if ids is None else ids.tolist()
    rows = [flat[starts[k]:starts[k] + lens[k]].tolist() for k in keys]
    offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int32)
    return offsets, [v for r in rows for v in r]


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.bool_, np.uint16])
@pytest.mark.parametrize("ids_dtype", [None, np.int32, np.int64])
@pytest.mark.parametrize("which", ["native", "numpy"])
def test_gather_matches_a_row_by_row_reference(monkeypatch, dtype, ids_dtype, which):
    if which == "native":
        _native()
    else:
        monkeypatch.setattr(build, "_native_gather", lambda: None)
    rng = np.random.default_rng(7)
    k = 50
    lens = rng.integers(0, 9, k).astype(np.int64)   # 0..8 items: the switch cases and the memcpy path
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    flat = (rng.integers(0, 1000, int(lens.sum()) + 10)).astype(dtype)
    starts[::7] = 0                                   # segments may overlap / repeat
    lens[::7] = np.minimum(lens[::7], 3)
    ids = None if ids_dtype is None else rng.integers(0, k, 2000).astype(ids_dtype)
    off, vals = build.gather(ids, starts, lens, flat)
    ref_off, ref_vals = _numpy_gather(ids, starts, lens, flat)
    assert off.dtype == np.int32 and vals.dtype == flat.dtype
    assert off.tolist() == ref_off.tolist()
    assert vals.tolist() == ref_vals


@pytest.mark.parametrize("which", ["native", "numpy"])
def test_gather_empty_and_bad_ids(monkeypatch, which):
    if which == "native":
        _native()
    else:
        monkeypatch.setattr(build, "_native_gather", lambda: None)
    starts = np.array([0, 2], np.int64)
    lens = np.array([2, 1], np.int64)
    flat = np.arange(3, dtype=np.int64)
    off, vals = build.gather(np.zeros(0, np.int64), starts, lens, flat)
    assert off.tolist() == [0] and len(vals) == 0
    with pytest.raises(IndexError):
        build.gather(np.array([0, 2], np.int64), starts, lens, flat)


def test_native_gather_rejects_segments_outside_the_values():
    ext = _native()
    with pytest.raises(IndexError, match="outside"):
        ext.gather(None, np.array([2], np.int64), np.array([5], np.int64), np.arange(3, dtype=np.int64), 8)
    with pytest.raises(ValueError):
        ext.gather(None, np.array([0], np.int32), np.array([1], np.int64), np.arange(3, dtype=np.int64), 8)


def _workload(n_small):
    """Small ops, then an MLP step (backward rows link to forward rows across chunks)."""
    torch.manual_seed(0)
    x = torch.ones(3)
    for _ in range(n_small):
        x = x + 1
    lin = torch.nn.Linear(4, 4)
    inp = torch.randn(2, 4)
    loss = torch.nn.functional.relu(lin(inp)).sum()
    for _ in range(n_small // 4):
        x = x * 1
    loss.backward()


_TIMES = {"start_ns", "cpu_ns", "seq_nr", "first_run", "probe_ns"}   # times, and process-wide state (autograd counter, ops seen)


def _ops_rows(t):
    cols = [c for c in t.ops.column_names if c not in _TIMES]
    return t.ops.select(cols).to_pylist()


def _tensor_rows(t):
    return t.tensors.drop_columns(["address"]).to_pylist()


def test_native_engine_spills_past_spill_rows_and_builds_the_same_tables():
    _native()
    with tensorscope.trace(engine="native", leaks=False) as plain:
        _workload(600)
    with tensorscope.trace(engine="native", leaks=False, chunk_rows=64, spill_rows=128) as spilled:
        _workload(600)
    for t in (plain, spilled):
        assert t.metadata["engine"] == "native"
        assert t.metadata["tracer_errors"] == 0, t.metadata["tracer_error_messages"]
    assert plain.metadata["spilled_rows"] == 0
    assert spilled.metadata["spilled_rows"] >= 512   # rows were written out while recording
    assert spilled.ops.num_rows == plain.ops.num_rows > 700
    assert _ops_rows(spilled) == _ops_rows(plain)
    # tensors.address is where this run's allocator put each storage: a fact of the run, not of the build
    assert _tensor_rows(spilled) == _tensor_rows(plain)
    bwd = [r for r in _ops_rows(spilled) if r["phase"] == "backward" and r["fwd_seq"] is not None]
    assert bwd and all(r["fwd_seq"] < r["seq"] for r in bwd)


def test_native_chunks_are_packed_while_recording():
    ext = _native()
    n = 40_000
    with tensorscope.trace(engine="native", leaks=False, nonfinite=False, chunk_rows=4096):
        x = torch.ones(3)
        for _ in range(n):
            x = x + 1
        own = ext.resident()
    assert own["n_rows"] == n + 1   # torch.ones, then the adds
    # a 56-byte Row per op unpacked; packed: a few bytes per column, plus the live block
    assert 0 < own["rows"] / n < 40, own


def _global_links(chunks):
    """The reference: one pass over the whole trace (first forward row per sequence number)."""
    cat = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
    first = {}
    for i, (node, sn) in enumerate(zip(cat["node"].tolist(), cat["seq_nr"].tolist())):
        if node == 0 and sn >= 0:
            first.setdefault(sn, i)
    fwd = np.full(len(cat["op"]), -1)
    module, call = cat["module"].copy(), cat["call"].copy()
    for i, (node, sn) in enumerate(zip(cat["node"].tolist(), cat["seq_nr"].tolist())):
        if node != 0 and sn in first:
            fwd[i] = first[sn]
            module[i], call[i] = cat["module"][first[sn]], cat["call"][first[sn]]
    return fwd, module, call


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("increasing", [True, False])
def test_links_built_chunk_by_chunk_match_one_global_pass(increasing, wide):
    """``wide``: past the middle, sequence numbers and call ids beyond int32: the index (int32 while
    every value fits) widens then, and nothing stored before changes."""
    rng = np.random.default_rng(3)
    n, size = 3000, 128
    node = (rng.random(n) < 0.4).astype(np.int64) * rng.integers(1, 5, n)
    seq_nr = np.full(n, -1, np.int64)
    claimed = []
    for i in range(n):   # a backward row reuses a number a forward row claimed before it
        if node[i] == 0:
            seq_nr[i] = i if increasing else rng.integers(-1, 200)   # not increasing: threads, restarts
            if wide and i >= n // 2 and seq_nr[i] >= 0:
                seq_nr[i] += 2**33
            if seq_nr[i] >= 0:
                claimed.append(seq_nr[i])
        elif claimed and rng.random() < 0.8:
            seq_nr[i] = claimed[rng.integers(0, len(claimed))]
    cols = {"op": np.zeros(n, np.int64), "node": node, "seq_nr": seq_nr.astype(np.int64),
            "module": rng.integers(0, 9, n), "call": rng.integers(-1, 500, n)}
    if wide:
        cols["call"][np.arange(n) >= n // 2] += 2**33
    chunks = [{k: v[i:i + size] for k, v in cols.items()} for i in range(0, n, size)]
    links = build._Links()
    got = [[], [], []]
    for i, c in enumerate(chunks):
        links.extend(c, i * size)
        links.extend(c, i * size)   # a chunk decoded twice (dataset part, then the final build) adds nothing
        for acc, part in zip(got, links.resolve(c)):
            acc.append(part)
    ref = _global_links(chunks)
    for g, r in zip(got, ref):
        assert np.concatenate(g).tolist() == r.tolist()
    assert links.keys.dtype == (np.int64 if wide else np.int32)


def test_native_hand_over_is_invisible_to_the_profiler_and_the_program():
    """The hand-over runs Python between two ops (RecordFunction off): torch.profiler sees the
    same ops as without spilling, and the program's results are unchanged."""
    _native()
    from torch.profiler import ProfilerActivity, profile

    def run():
        x = torch.ones(3)
        for _ in range(300):
            x = x + 1
        return x

    seen = {}
    for spill in (False, True):
        kw = dict(chunk_rows=16, spill_rows=32) if spill else {}
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with tensorscope.trace(engine="native", leaks=False, **kw) as t:
                out = run()
        assert t.metadata["tracer_errors"] == 0, t.metadata["tracer_error_messages"]
        assert (t.metadata["spilled_rows"] > 0) == spill
        assert torch.equal(out, torch.full((3,), 301.0))
        seen[spill] = sorted(e.name for e in prof.events() if e.name.startswith("aten::"))
    assert seen[True] == seen[False] and len(seen[True]) >= 301
