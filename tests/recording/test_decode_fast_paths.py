"""The decode's shortcuts give the tables the general paths give: the uniform-length gather, the
storage ids split as a matrix, the shared all-null columns, first_run over run starts, and the calls
decoded ``chunk_rows`` at a time. Each is checked against a reference on its own, and a whole trace
(chunks that take a shortcut beside chunks that do not) is decoded with the shortcuts and without."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from tensorscope.options import TraceOptions
from tensorscope.recording import columns, decode
from tensorscope.recording.session import new_session


def _reference(ids, starts, lens, flat):
    rows = [flat[starts[k]:starts[k] + lens[k]].tolist() for k in ids.tolist()]
    return np.cumsum([0] + [len(r) for r in rows]).tolist(), [v for r in rows for v in r]


@pytest.mark.parametrize("width", [0, 1, 3])
@pytest.mark.parametrize("dtype", [np.int64, np.bool_])
def test_uniform_gather_matches_the_row_by_row_reference(monkeypatch, width, dtype):
    monkeypatch.setattr(columns, "_native_gather", lambda: None)   # the numpy path, where the shortcut is
    rng = np.random.default_rng(3)
    lens = rng.integers(0, 6, 40).astype(np.int64)
    lens[::3] = width
    lens[-1] = 5                 # the last segment runs to the end of the values: a clipped matrix row
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    flat = rng.integers(0, 100, int(lens.sum())).astype(dtype)
    chosen = np.flatnonzero(lens == width)
    ids = rng.choice(chosen, 500)
    off, vals = columns.gather(ids, starts, lens, flat)
    ref_off, ref_vals = _reference(ids, starts, lens, flat)
    assert off.dtype == np.int32 and vals.dtype == flat.dtype
    assert off.tolist() == ref_off and vals.tolist() == ref_vals
    mixed = np.concatenate([ids, np.flatnonzero(lens != width)[:1]])   # one other length: the general path
    off, vals = columns.gather(mixed, starts, lens, flat)
    assert (off.tolist(), vals.tolist()) == _reference(mixed, starts, lens, flat)


@pytest.mark.parametrize("ragged", [False, True])
def test_storage_lists_split_each_row_into_inputs_then_outputs(ragged):
    rng = np.random.default_rng(5)
    n = 300
    n_in = rng.integers(0, 4, n) if ragged else np.full(n, 2)
    n_out = rng.integers(0, 3, n) if ragged else np.full(n, 1)
    stor = np.arange(int(n_in.sum() + n_out.sum()), dtype=np.int64) * 7
    in_off = np.concatenate([[0], np.cumsum(n_in)]).astype(np.int32)
    out_off = np.concatenate([[0], np.cumsum(n_out)]).astype(np.int32)
    ins, outs = columns._storage_lists(stor, in_off, out_off)
    pos, ref_in, ref_out = 0, [], []
    for a, b in zip(n_in.tolist(), n_out.tolist()):
        ref_in.append(stor[pos:pos + a].tolist())
        ref_out.append(stor[pos + a:pos + a + b].tolist())
        pos += a + b
    assert ins.to_pylist() == ref_in and outs.to_pylist() == ref_out
    cut = stor.copy()
    cut[-3:] = -1                # a truncated chunk: the missing ids are -1, the rows stay aligned
    short = columns._storage_lists(stor[:-3], in_off, out_off)
    assert [c.to_pylist() for c in short] == [c.to_pylist() for c in columns._storage_lists(cut, in_off, out_off)]


def test_nulls_share_one_array_per_length_type_and_value():
    nulls = columns.Nulls()
    sevens = nulls.dense(np.full(6, 7, np.int64))
    assert nulls.dense(np.full(6, 7, np.int64)) is sevens and nulls.full(6, 7) is sevens
    assert nulls.dense(np.full(6, 8, np.int64)).to_pylist() == [8] * 6
    assert nulls.dense(np.full(6, 7, np.int32), pa.int32()).type == pa.int32()
    mixed = np.full(6, 7, np.int64)
    mixed[3] = 1                  # first and last alike, one row not: not shared
    assert nulls.dense(mixed).to_pylist() == [7, 7, 7, 1, 7, 7]
    zeros = nulls.nullable(np.zeros(6, np.float64), np.zeros(6, bool), pa.float64())
    signed = nulls.nullable(-np.zeros(6, np.float64), np.zeros(6, bool), pa.float64())
    assert np.signbit(signed.to_numpy()).all() and not np.signbit(zeros.to_numpy()).any()   # floats never shared
    a = nulls.nullable(np.full(5, -1, np.int64), np.ones(5, bool))
    assert a is nulls(5, pa.int64()) and a.null_count == 5
    assert nulls.nullable(np.arange(5), np.arange(5) < 2).to_pylist() == [None, None, 2, 3, 4]
    d = columns._Dict(["x", None]).take(np.ones(4, np.int64), nulls=nulls)
    shared = nulls(4, pa.int32())
    assert d.indices.buffers()[0].address == shared.buffers()[0].address and d.to_pylist() == [None] * 4


def _recorded(engine, chunk_rows):
    """A stopped, unbuilt session: a loop of one op (chunks the shortcuts take) then a training step
    and ragged ops (chunks they do not), nested calls."""
    torch.manual_seed(0)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    lin = torch.nn.Linear(4, 3)
    sess = new_session(TraceOptions(engine=engine, chunk_rows=chunk_rows, leaks=False))
    sess.start()
    try:
        for _ in range(3 * chunk_rows):
            a.add(b)
        for k in range(1, 40):
            torch.cat([a] * (k % 4 + 1))
            torch.nn.functional.relu(lin(a)).sum().backward()
        torch.split(a, 1)
    finally:
        sess._restore()
    sess.engine.finish(sess.ctx)
    return sess


@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_trace_decodes_alike_with_and_without_the_shortcuts(monkeypatch, engine):
    from tensorscope.recording.engines import _native_ext

    if engine == "native" and _native_ext(wait=True)[0] is None:
        pytest.skip("native engine unavailable")
    sess = _recorded(engine, chunk_rows=128)
    rec = sess.ctx.rec

    def tables():
        got = decode.decode_tables(rec, cell=None, screen=sess.ctx.screen, links=type(sess.links)(), spill_dir=None)[0]
        return got["ops"].drop_columns(["first_run"]), got["calls"]   # first_run: a decode claims keys process-wide

    fast_ops, fast_calls = tables()
    assert fast_ops.column("in_storages").num_chunks > 3 and fast_calls.column(0).num_chunks > 1
    with monkeypatch.context() as m:
        m.setattr(columns, "_steps", lambda off, k: False)
        m.setattr(columns, "_uniform_gather", lambda *a: pytest.fail("uniform gather with the shortcuts off"))
        m.setattr(columns.Nulls, "nullable", lambda self, v, mask, typ=pa.int64(): columns.nullable_array(v, mask, typ))
        m.setattr(columns.Nulls, "dense", lambda self, v, typ=pa.int64(): columns.dense_array(v, typ))
        m.setattr(rec, "chunk_rows", 10 ** 9)   # the calls in one batch
        m.setattr(columns, "gather", _general_gather)
        slow_ops, slow_calls = tables()
    assert fast_ops.equals(slow_ops) and fast_calls.equals(slow_calls)
    assert fast_ops.column("seq_nr").null_count < fast_ops.num_rows   # the backward step has some


def _general_gather(ids, starts, lens, flat):
    """numpy's general segment gather (no uniform shortcut), the reference for either engine."""
    starts = np.asarray(starts, np.int64)
    lens = np.asarray(lens, np.int64)
    if ids is not None:
        starts, lens = starts[ids], lens[ids]
    offsets = columns._offsets(lens)
    return offsets.astype(np.int32), np.asarray(flat)[columns._segments(starts, lens, offsets)]


def test_first_run_marks_the_first_row_of_each_key_once():
    """Run starts only: a key that comes back after another is not first again; one that is new in
    a later run is."""
    from tensorscope.recording.engines import _native_ext

    engine = "native" if _native_ext(wait=True)[0] is not None else "python"
    x, y = torch.randn(13, 5), torch.randn(13, 7)   # shapes no other test runs
    sess = new_session(TraceOptions(engine=engine, leaks=False))
    sess.start()
    try:
        for v in (x, x, y, y, x, y, x):
            v.neg()
    finally:
        sess._restore()
    sess.engine.finish(sess.ctx)
    ops = decode.decode_tables(sess.ctx.rec, cell=None, screen=sess.ctx.screen, links=type(sess.links)(),
                               spill_dir=None)[0]["ops"]
    neg = [(r["first_run"], tuple(r["in_shapes"][0])) for r in ops.select(["op", "first_run", "in_shapes"]).to_pylist()
           if r["op"] == "aten.neg.default"]
    assert neg == [(True, (13, 5)), (False, (13, 5)), (True, (13, 7)), (False, (13, 7)), (False, (13, 5)),
                   (False, (13, 7)), (False, (13, 5))]


def test_call_store_reads_any_row_range_as_its_whole_column_has_it(tmp_path):
    """The python engine's calls store a range at a time (the calls table's batches): ranges across
    spilled, frozen and live rows, and their boundaries, against the whole column."""
    from tensorscope.recording.recorder import CALL_FIELDS, CallStore

    store = CallStore(CALL_FIELDS)
    rng = np.random.default_rng(11)
    rows = rng.integers(-5, 10 ** 12, (230, len(CALL_FIELDS)))
    for cut in (40, 95, 150):   # three chunks: two spilled, one frozen, then live rows
        while len(store) + store.base < cut:
            store.data.extend(rows[len(store) + store.base].tolist())
        store.freeze_below(cut)
        if cut < 150:
            store.spill(str(tmp_path))
    store.data.extend(rows[150:].ravel().tolist())
    assert store.spilled and store.frozen and len(store)
    for name in ("func", "start", "parent"):
        whole = store.column(name)
        assert whole.tolist() == rows[:, CALL_FIELDS.index(name)].tolist()
        for lo, hi in ((0, 230), (0, 40), (39, 41), (40, 95), (90, 160), (149, 151), (150, 230), (200, 230), (7, 7)):
            assert columns.call_rows(store, name, lo, hi).tolist() == whole[lo:hi].tolist(), (name, lo, hi)
