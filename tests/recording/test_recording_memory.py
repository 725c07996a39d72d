"""What a trace keeps per op while it records: the per-op facts are columns, not Python objects.

``probe_ns`` (the python engine's probe time after each op: one entry per screened op) and the
storage tracker's data pointers (one per storage: one per op in a loop that allocates) are
``array``/packed numpy columns; as dicts and lists of ints they held ~100 and ~40 bytes an op. The
probe times and the python engine's finished calls rows spill to disk with the op chunks.
These check the structures and their decoded result, not a time.
"""
from __future__ import annotations

import numpy as np
import torch

import tensorscope
from tensorscope.recording.decode import _sparse_rows
from tensorscope.recording.recorder import Recorder, SparseInts


def test_sparse_ints_read_as_the_dict_they_replace():
    rng = np.random.default_rng(0)
    seqs = np.sort(rng.choice(5000, 1200, replace=False))
    vals = rng.integers(0, 10**9, len(seqs))
    ref: dict[int, int] = {}
    d = SparseInts()
    for i, (s, v) in enumerate(zip(seqs.tolist(), vals.tolist())):
        ref[s] = v
        d[s] = v
        if i % 97 == 0:
            d.freeze()   # chunk boundaries anywhere
    assert len(d) == len(ref) and list(d) == list(ref) and d.values() == list(ref.values())
    assert dict(d.items()) == ref
    assert d.get(int(seqs[5])) == ref[int(seqs[5])] and d.get(-3) is None
    for start, n in ((0, 64), (100, 1000), (4990, 64), (6000, 10), (0, 5000)):
        got_rows, got_vals = _sparse_rows(d, start, n, np.int64)
        want_rows, want_vals = _sparse_rows(ref, start, n, np.int64)
        assert got_rows.tolist() == want_rows.tolist() and got_vals.tolist() == want_vals.tolist()
        assert got_vals.shape == (len(got_rows), 1)


def test_a_later_value_of_the_same_seq_wins_as_in_a_dict():
    d = SparseInts()
    d[3] = 1
    d.freeze()
    d[3] = 2
    rows, vals = _sparse_rows(d, 0, 10, np.int64)
    out = np.zeros(10, np.int64)
    out[rows] = vals[:, 0]
    assert out[3] == 2 and d.get(3) == 2


def test_pairs_of_values_spill_and_read_back_as_the_dict(tmp_path):
    ref = {s: (s % 7, s % 2 == 0) for s in range(0, 900, 3)}
    d = SparseInts("nonfinite", 2)
    items = list(ref.items())
    for s, v in items[:100]:
        d[s] = v
    d.spill(str(tmp_path))
    seqs = np.array([s for s, _ in items[100:]])
    d.extend(seqs, np.array([v for _, v in items[100:]], dtype=np.int64))
    d.freeze()
    assert len(d) == len(ref) and list(d) == list(ref) and d.get(3) == (3, False)
    assert dict(d.items()) == {s: (c, int(p)) for s, (c, p) in ref.items()}
    for start, n in ((0, 300), (290, 20), (600, 400)):
        got, want = _sparse_rows(d, start, n, np.int64, 2), _sparse_rows(ref, start, n, np.int64, 2)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_a_nan_loop_keeps_its_findings_packed_and_spilled(tmp_path):
    from tensorscope.recording.session import active_session

    x = torch.full((8,), float("nan"))
    with tensorscope.trace(chunk_rows=256, spill_rows=512, spill_dir=str(tmp_path), leaks=False) as t:
        for _ in range(3000):
            x = x + 1   # every output holds NaN
        rec = active_session().ctx.rec
        assert isinstance(rec.nonfinite, SparseInts) and rec.nonfinite.spilled
        assert rec.nonfinite.n_spilled > 2000
    nf = t.ops.column("nonfinite").to_pylist()
    assert nf.count(8) == 3000 and t.ops.column("nonfinite_produced").to_pylist().count(False) == 3000


def test_the_recorder_packs_probe_times_with_each_op_chunk():
    rec = Recorder(chunk_rows=16, spill_rows=64)
    for seq in range(100):
        rec.probe_ns[seq] = 1000 + seq
    rec.end_chunk()
    assert len(rec.probe_ns.seqs) == 0 and len(rec.probe_ns.frozen) == 1
    _, _, packed_seqs, packed_vals = rec.probe_ns.frozen[0]
    assert packed_seqs[1].itemsize == 1 and packed_vals[1].itemsize == 1   # 100 values in a byte each
    rows, vals = _sparse_rows(rec.probe_ns, 40, 20, np.int64)
    assert rows.tolist() == list(range(20)) and vals[:, 0].tolist() == list(range(1040, 1060))


def test_python_engine_per_op_facts_are_compact_spill_and_decode_alike(tmp_path):
    from tensorscope.recording.session import active_session

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    n = 3000
    with tensorscope.trace(engine="python", chunk_rows=256, spill_rows=512, spill_dir=str(tmp_path)) as t:
        for _ in range(n):
            a.add(b)   # one op, one torch-level call, one new storage each
        s = active_session()
        rec, tracker = s.ctx.rec, s.ctx.tracker
        probe, calls = rec.probe_ns, rec.calls
        assert isinstance(probe, SparseInts) and len(probe) >= n - 20
        assert probe.spilled and calls.spilled   # written out with the op chunks
        in_memory = sum(p[1].nbytes + v[1].nbytes for _, _, p, v in probe.frozen) + 16 * len(probe.seqs)
        assert in_memory / len(probe) < 16
        assert sum(k for _, k in calls.spilled) > n // 2 and len(calls) + sum(len(c["func"][1]) for c in calls.frozen) < n // 2
        old = calls.spilled[0][1] // 2   # a call whose row is on disk reads back field by field
        fields = {k: calls.field(old, i) for i, k in enumerate(calls.fields)}
        # the tracker holds the live storages only; the finished records spilled with the chunks
        assert len(tracker.live) <= 8 and tracker.n >= n and rec.tensors.resident_records < n // 2
        assert rec.tensors.n_spilled > n // 2
    assert t.metadata["engine"] == "python" and t.metadata["spilled_rows"] > 0
    assert t.ops.column("probe_ns").null_count < t.ops.num_rows // 10   # the probe times reached the table
    assert t.tensors.column("address").null_count == 0
    row = t.calls.slice(old, 1).to_pylist()[0]
    assert row["n_ops"] == fields["n_ops"] and row["first_seq"] == fields["first_seq"] and row["name"] == "add"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tensorscope-spill-")]


def test_tensors_addresses_come_from_the_tracker_array():
    x = torch.randn(4, 4)
    with tensorscope.trace(engine="python") as t:
        y = x * 2
    assert int(y.untyped_storage().data_ptr()) in t.tensors.column("address").to_pylist()
