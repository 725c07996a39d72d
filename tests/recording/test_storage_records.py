"""Storage records leave memory once finished: both engines hold the live storages only, the
finished records spill with the op chunks (``recording/storage_rows.py``), and the ``tensors``
table built from them a block of ids at a time equals the in-memory trace's.

The traces here free their storages out of creation order (a shuffled pool), keep some alive to
the end (a leak the leak finder names, and a list the program holds), and spill with a tiny
``chunk_rows``/``spill_rows`` so the records come in many parts and the table in many blocks.
"""
from __future__ import annotations

import contextlib
import glob
import os
import random
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

import tensorscope
from tensorscope.errors import SpillError
from tensorscope.recording import spill
from tensorscope.recording.storage_rows import RECORD_FIELDS, StorageRows
from tests.helpers.disk import FullFile

from .test_spill_equal import _with_times_of

SPILL = dict(chunk_rows=16, spill_rows=32)
KEPT: list[Any] = []


@pytest.fixture(autouse=True)
def _kept_released():
    """KEPT holds its tensors only during a test: a module global still holding them would be a
    leak every later leak test in the process finds."""
    yield
    KEPT.clear()


def _forced_fallback() -> bool:
    return os.environ.get("TENSORSCOPE_FORCE_FALLBACK", "") not in ("", "0")


def _native_available() -> bool:
    from tensorscope.recording.engines import _native_ext

    ext, _ = _native_ext(wait=True)
    return ext is not None


@pytest.fixture(params=["native", "python"])
def engine(request):
    if request.param == "native" and (_forced_fallback() or not _native_available()):
        pytest.skip("native engine unavailable (or TENSORSCOPE_FORCE_FALLBACK): the python engine is covered")
    return request.param


def _program(seen_spill: list[int], spill_dir: Any = None) -> torch.Tensor:
    """Storages made in a pool and freed in a shuffled order; a few held to the end (KEPT: one with
    an autograd graph, the leak finder's), the rest of the program's results returned."""
    rnd = random.Random(0)
    torch.manual_seed(0)
    w = torch.randn(6, 6, requires_grad=True)
    pool: list[torch.Tensor] = []
    acc = torch.zeros(6)
    for step in range(30):
        pool.append(torch.randn(6) * (step + 1))
        pool.append(pool[-1].add(1.0))
        if len(pool) > 6:
            del pool[rnd.randrange(len(pool))]      # frees out of creation order
            del pool[rnd.randrange(len(pool))]
        acc = acc + pool[rnd.randrange(len(pool))]
        if step % 10 == 3:
            KEPT.append((w @ w).sum())              # holds its graph: a leak
        if spill_dir is not None:
            seen_spill.append(len(glob.glob(os.path.join(spill_dir, "tensorscope-spill-*", "storages-*-sid.npy"))))
    KEPT.append(pool)                               # alive past the trace too
    return acc + torch.stack(pool).sum(0)


def _traced(engine: str, **opts: Any) -> tuple[Any, torch.Tensor, list[int]]:
    KEPT.clear()
    seen: list[int] = []
    with tensorscope.trace(engine=engine, **opts) as t:
        out = _program(seen, opts.get("spill_dir"))
    t = t.result
    assert t.metadata["engine"] == engine, t.metadata.get("engine_reason")
    assert t.metadata["tracer_errors"] == 0, t.metadata["tracer_error_messages"]
    return t, out, seen


def _rows(table: pa.Table, skip: tuple[str, ...] = ()) -> dict[str, list[Any]]:
    return {c: table.column(c).to_pylist() for c in table.column_names if c not in skip}


def test_finished_storage_records_spill_and_the_tables_equal_the_in_memory_trace(engine, tmp_path):
    _traced(engine, leaks=False)   # the first trace claims every op's first run in this process
    mem, out_mem, _ = _traced(engine)
    spilled, out_sp, seen = _traced(engine, spill_dir=str(tmp_path), **SPILL)
    assert torch.equal(out_mem, out_sp)
    assert spilled.metadata["spilled_rows"] > 0
    assert max(seen) >= 2, seen   # finished records were written while recording, in several parts
    a, b = mem.tensors, spilled.tensors
    assert a.num_rows == b.num_rows > 100
    assert b.column("storage_id").to_pylist() == list(range(b.num_rows))   # id order, every id once
    assert b.column("storage_id").num_chunks > 3                            # built a block at a time
    # addresses differ between runs: the same ones null, all known ones distinct per live interval
    assert a.column("address").is_null().to_pylist() == b.column("address").is_null().to_pylist()
    assert _rows(a, ("address",)) == _rows(b, ("address",))
    free = b.column("free_seq").to_pylist()
    freed = [s for s in free if s is not None]
    assert any(x > y for x, y in zip(freed, freed[1:]))        # freed out of creation order
    assert free.count(None) >= 8                                # and some live to the end
    # memory categories, leaks and the summary: the same
    assert mem.tensors.column("category").to_pylist() == spilled.tensors.column("category").to_pylist()
    assert mem.leaks.num_rows == spilled.leaks.num_rows >= 3
    assert _rows(mem.leaks) == _rows(spilled.leaks)
    ref = _with_times_of(mem, spilled)   # the measured times (and addresses) of the spilled run
    assert "still alive" in ref.summary().to_text()
    assert spilled.summary().to_text() == ref.summary().to_text()


def test_the_in_memory_tensors_table_is_built_a_chunk_rows_block_at_a_time(engine):
    """Not spilled, the tensors table is decoded ``chunk_rows`` storages at a time too (a record batch
    each): with a tiny ``chunk_rows`` many batches, equal row for row to the default's, and so are the
    categories, the leaks and the summary built over them."""
    _traced(engine, leaks=False)   # the first trace claims every op's first run in this process
    whole, out_whole, _ = _traced(engine)
    small, out_small, _ = _traced(engine, chunk_rows=16)
    assert torch.equal(out_whole, out_small)
    assert not small.metadata.get("spilled_rows")
    a, b = whole.tensors, small.tensors
    assert a.num_rows == b.num_rows > 100
    assert a.column("storage_id").num_chunks == 1 and b.column("storage_id").num_chunks > 5
    assert b.column("storage_id").to_pylist() == list(range(b.num_rows))
    assert a.column("address").is_null().to_pylist() == b.column("address").is_null().to_pylist()
    assert _rows(a, ("address",)) == _rows(b, ("address",))
    assert _rows(whole.leaks) == _rows(small.leaks) and whole.leaks.num_rows >= 3
    ref = _with_times_of(whole, small)
    assert small.summary().to_text() == ref.summary().to_text()


def test_storage_rows_blocks_merge_parts_across_block_boundaries(tmp_path):
    """Parts made of records finished out of id order, some spilled (memory-mapped) and some in
    memory, read back in blocks of every size: each block is exactly the id-sorted rows."""
    rng = np.random.default_rng(0)
    n = 1000
    full = np.zeros((n, len(RECORD_FIELDS)), np.int64)
    sid = RECORD_FIELDS.index("sid")
    full[:, sid] = np.arange(n)
    for k, name in enumerate(RECORD_FIELDS):
        if name != "sid":
            full[:, k] = rng.integers(-1, 1 << (8 * (k % 4 + 1) + 3), n) if name != "ptr" else rng.integers(1, 1 << 60, n)
    order = rng.permutation(n)
    rows = StorageRows()
    cuts = np.sort(rng.choice(np.arange(1, n), 12, replace=False))
    for i, part in enumerate(np.split(order, cuts)):
        if i % 3 == 0:   # the python engine's buffer, frozen into a part
            rows.buffer.extend(full[part].ravel().tolist())
            rows.freeze()
        else:
            rows.add(full[part].tobytes())
        if i in (4, 9):
            rows.spill(str(tmp_path))   # the parts in memory so far, merged into one, to .npy files
    assert len(rows) == n and rows.n_spilled > 0 and rows.resident_records < n
    assert glob.glob(str(tmp_path / "storages-*-sid.npy"))
    names = [f for f in RECORD_FIELDS if f != "sid"]
    for step in (1, 7, 64, 333, n):
        got = {k: [] for k in names}
        for lo, hi, b in rows.blocks(step):
            for k in names:
                assert len(b[k]) == hi - lo
                got[k].append(b[k])
        for k in names:
            assert np.array_equal(np.concatenate(got[k]), full[:, RECORD_FIELDS.index(k)]), (step, k)
    ids = rng.choice(n, 50, replace=False)
    assert np.array_equal(rows.values("ptr", ids), full[ids, RECORD_FIELDS.index("ptr")])
    with pytest.raises(RuntimeError, match="found"):   # an id no part holds is an error, not a zero
        rows.block(n - 1, n + 1)


def test_the_native_engine_keeps_only_live_storage_records(tmp_path):
    if _forced_fallback() or not _native_available():
        pytest.skip("native engine unavailable (or TENSORSCOPE_FORCE_FALLBACK)")
    from tensorscope.recording.engines import _native_ext
    from tensorscope.recording.session import active_session

    ext, _ = _native_ext(wait=True)
    a, b = torch.ones(4), torch.ones(4)
    seen: list[dict[str, int]] = []
    with tensorscope.trace(engine="native", spill_dir=str(tmp_path), chunk_rows=256, spill_rows=512) as t:
        for i in range(5000):
            a.add(b)                        # one output storage per op, freed at once
            if i % 1000 == 999:
                seen.append(dict(ext.resident(), held=active_session().ctx.rec.tensors.resident_records))
    t = t.result
    assert t.tensors.num_rows >= 5000
    last = seen[-1]
    assert last["storages_made"] >= 4999
    assert last["storage_slots"] <= 64, last            # the live ones (a few), not every one made
    assert last["storages_finished"] <= 2 * 512, last   # handed over with the chunks
    assert last["held"] <= 2 * 512, last                # and spilled with them by the recorder


@pytest.mark.parametrize("engine_name", ["auto", "python"])
def test_a_full_disk_at_the_storage_records_is_a_clear_error_and_the_trace_stays_whole(
        engine_name, monkeypatch, tmp_path):
    KEPT.clear()
    with tensorscope.trace(engine=engine_name, leaks=False) as ref:
        expected = _program([])
    ref = ref.result
    real = spill._open

    def opener(path: str) -> Any:
        f = real(path)
        return FullFile(f) if os.path.basename(path).startswith("storages-") else f

    monkeypatch.setattr(spill, "_open", opener)
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    KEPT.clear()
    cm = tensorscope.trace(engine=engine_name, spill_dir=str(spill_dir), leaks=False, **SPILL)
    with pytest.raises(SpillError) as ei:
        got = None
        with cm:
            got = _program([])
    assert got is not None and torch.equal(got, expected)
    e = ei.value
    assert "storages-000000-" in str(e) and "No space left on device" in str(e)
    t = e.trace
    assert any("kept in memory" in n for n in t.metadata["notes"])
    assert _rows(t.tensors, ("address",)) == _rows(ref.tensors, ("address",))
    back = tensorscope.load(t.save(tmp_path / "saved"))
    assert back.tensors.num_rows == ref.tensors.num_rows
    assert os.listdir(spill_dir) == []
    with contextlib.suppress(Exception):
        KEPT.clear()


def _native_only() -> None:
    if _forced_fallback() or not _native_available():
        pytest.skip("native engine unavailable (or TENSORSCOPE_FORCE_FALLBACK)")


def test_finished_records_are_handed_over_while_recording_at_default_spill_rows():
    """With every default option (nothing spills before 500,000 rows) the native engine still hands its
    finished storage records over (with its packed chunks) every ``HANDOVER_RECORDS`` records: the
    engine holds the live storages and at most about one hand-over's records, never every storage
    the trace made (64 B each in C; the recorder packs them to ~15 B)."""
    _native_only()
    from tensorscope.recording.engines import _native_ext
    from tensorscope.recording.engines.native import HANDOVER_RECORDS
    from tensorscope.recording.session import active_session

    ext, _ = _native_ext(wait=True)
    a, b = torch.ones(4), torch.ones(4)
    n = 3 * HANDOVER_RECORDS
    with tensorscope.trace(engine="native", leaks=False) as t:
        for _ in range(n):
            a.add(b)                        # one output storage per op, freed at once
        own = ext.resident()
        rec = active_session().ctx.rec
        held, spilled, mem_rows = rec.tensors.resident_records, rec.n_spilled, rec.mem_rows
    t = t.result
    assert not t.metadata.get("spilled_rows") and spilled == 0         # nothing spilled
    assert own["storages_made"] >= n and own["handovers"] >= 2, own
    assert own["storages_finished"] <= 2 * HANDOVER_RECORDS, own       # not every one made
    assert held >= n - 2 * HANDOVER_RECORDS, held                       # the recorder holds them
    assert mem_rows >= n - 2 * HANDOVER_RECORDS, mem_rows                # and the op chunks with them
    assert t.tensors.num_rows >= n
    assert t.tensors.column("storage_id").to_pylist() == list(range(t.tensors.num_rows))


def test_the_python_engine_packs_finished_records_a_chunk_at_a_time():
    """The python engine's tracker moves each finished record to ``rec.tensors.buffer`` (8 int64),
    which is packed into a part at every chunk: it never holds more than a chunk's records unpacked."""
    from tensorscope.recording.session import active_session

    a, b = torch.ones(4), torch.ones(4)
    buffered: list[int] = []
    with tensorscope.trace(engine="python", leaks=False, chunk_rows=64) as t:
        for i in range(2000):
            a.add(b)
            if i % 100 == 99:
                buffered.append(len(active_session().ctx.rec.tensors.buffer) // len(RECORD_FIELDS))
        parts = len(active_session().ctx.rec.tensors.parts)
    assert max(buffered) <= 2 * 64, buffered
    assert parts >= 10, parts
    assert t.result.tensors.num_rows >= 2000


def _traced_resident(**opts: Any) -> tuple[Any, torch.Tensor, dict[str, int]]:
    """``_traced("native", ...)`` that also reads the engine's ``resident()`` right before the exit."""
    from tensorscope.recording.engines import _native_ext

    ext, _ = _native_ext(wait=True)
    KEPT.clear()
    with tensorscope.trace(engine="native", **opts) as t:
        out = _program([])
        own = ext.resident()
    t = t.result
    assert t.metadata["engine"] == "native", t.metadata.get("engine_reason")
    assert t.metadata["tracer_errors"] == 0, t.metadata["tracer_error_messages"]
    return t, out, own


def test_several_hand_overs_without_spilling_give_the_single_hand_over_trace(monkeypatch):
    """A tiny ``HANDOVER_RECORDS`` and ``chunk_rows`` make the engine hand its chunks and records over
    several times while recording, without spilling (the recorder keeps them in memory): every
    table and the summary equal the trace whose rows were all handed over once, at the end."""
    _native_only()
    from tensorscope import schema as S
    from tensorscope.recording.engines import native as native_engine

    from .test_spill_equal import assert_tables_equal

    _traced("native", leaks=False)   # the first trace claims every op's first run in this process
    once, out_once, own_once = _traced_resident(chunk_rows=16)
    monkeypatch.setattr(native_engine, "HANDOVER_RECORDS", 4)
    many, out_many, own_many = _traced_resident(chunk_rows=16)
    assert torch.equal(out_once, out_many)
    assert own_once["handovers"] == 0 and own_many["handovers"] >= 5, (own_once, own_many)
    assert not many.metadata.get("spilled_rows") and not once.metadata.get("spilled_rows")
    for name in S.RECORDED:
        assert_tables_equal(name, once.table(name), many.table(name))
    ref = _with_times_of(once, many)
    assert "still alive" in ref.summary().to_text()
    assert many.summary().to_text() == ref.summary().to_text()
