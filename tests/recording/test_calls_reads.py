"""Reading spilled calls chunks: the open files and fields a calls store keeps while the decoder reads
a range of every field at a time (``CallStore.spilled_field``)."""
from __future__ import annotations

import numpy as np
import pytest

from tensorscope.recording import columns
from tensorscope.recording.packed_rows import OPEN_CHUNKS, CallStore
from tensorscope.recording.recorder import CALL_FIELDS
from tensorscope.recording.spill import read_npz


def _spilled_store(tmp_path, chunks: int, size: int) -> tuple[CallStore, np.ndarray]:
    store = CallStore(CALL_FIELDS)
    rng = np.random.default_rng(5)
    rows = rng.integers(-3, 10 ** 9, (chunks * size + 7, len(CALL_FIELDS)))
    for k in range(1, chunks + 1):
        store.data.extend(rows[store.base + len(store):k * size].ravel().tolist())
        store.freeze_below(k * size)
        store.spill(str(tmp_path))
    store.data.extend(rows[chunks * size:].ravel().tolist())   # live rows after the spilled ones
    return store, rows


def test_ranges_over_more_chunks_than_stay_open_read_every_field_right(tmp_path):
    """Ranges spanning more spilled chunks than stay open, read field after field (the order that
    evicts the chunks a field's read needs next), and single rows between: each read equals the rows."""
    chunks, size = OPEN_CHUNKS * 2 + 3, 9
    store, rows = _spilled_store(tmp_path, chunks, size)
    n = len(rows)
    assert len(store.spilled) == chunks
    for lo, hi in ((0, n), (5, 5 + size * (OPEN_CHUNKS + 2)), (size - 1, size + 1), (n - 20, n), (0, size)):
        for name in CALL_FIELDS:
            got = columns.call_rows(store, name, lo, hi)
            assert got.tolist() == rows[lo:hi, CALL_FIELDS.index(name)].tolist(), (name, lo, hi)
            assert len(store._reading) <= OPEN_CHUNKS
        for cid in (lo, (lo + hi) // 2, hi - 1):
            k = CALL_FIELDS.index("start")
            assert store.field(cid, k) == rows[cid, k]
    for name in ("func", "src"):
        assert store.column(name).tolist() == rows[:, CALL_FIELDS.index(name)].tolist()


def test_close_reads_lets_the_mapped_chunks_go(tmp_path):
    store, rows = _spilled_store(tmp_path, 3, 4)
    columns.call_rows(store, "func", 0, 12)
    assert len(store._reading) == 3
    store.close_reads()
    assert not store._reading
    # read again after letting go: the files are mapped anew
    assert columns.call_rows(store, "func", 2, 10).tolist() == rows[2:10, CALL_FIELDS.index("func")].tolist()
    store.close_reads()


@pytest.mark.parametrize("compressed", [False, True])
def test_read_npz_equals_np_load(tmp_path, compressed):
    """Every member as ``np.load`` reads it: dtypes, shapes (C and Fortran order, 0-d, empty), and a
    compressed file (read by ``np.load``); the views are read-only file pages."""
    rng = np.random.default_rng(3)
    arrays = {"u8": rng.integers(0, 255, 1000).astype(np.uint8), "i64": rng.integers(-10**15, 10**15, 77),
              "f": np.asfortranarray(rng.random((5, 7))), "m": rng.integers(0, 9, (4, 3)).astype(np.uint16),
              "empty": np.zeros(0, np.int32), "scalar": np.array(7, np.int64), "__bases__": np.arange(3)}
    path = str(tmp_path / "x.npz")
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    got = read_npz(path)
    with np.load(path, allow_pickle=False) as z:
        assert sorted(got) == sorted(z.files)
        for k in z.files:
            assert got[k].dtype == z[k].dtype and got[k].shape == z[k].shape and np.array_equal(got[k], z[k]), k
    if not compressed:
        assert not got["i64"].flags.writeable


def test_read_npz_refuses_object_arrays(tmp_path):
    path = str(tmp_path / "o.npz")
    np.savez(path, o=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="allow_pickle"):
        read_npz(path)


def test_read_npz_files_alike_but_for_their_lengths(tmp_path):
    """The spill files of one trace repeat their headers (a header parsed once is reused): files whose
    columns differ only in length or dtype each read as written."""
    for k, (n, dt) in enumerate([(5, np.uint8), (9, np.uint8), (5, np.uint16), (5, np.uint8), (0, np.uint8)]):
        a = (np.arange(n) * (k + 1)).astype(dt)
        path = str(tmp_path / f"c{k}.npz")
        np.savez(path, op=a, __bases__=np.array([k]))
        got = read_npz(path)
        assert got["op"].dtype == dt and got["op"].tolist() == a.tolist() and got["__bases__"].tolist() == [k]


def test_read_npz_where_the_file_cannot_be_mapped(tmp_path, monkeypatch):
    """A filesystem that cannot map the file: every member read by ``np.load``, the same arrays."""
    from tensorscope.recording import spill

    path = str(tmp_path / "m.npz")
    np.savez(path, a=np.arange(10, dtype=np.uint16), __bases__=np.array([3]))

    def no_map(*a, **k):
        raise OSError(19, "No such device")

    monkeypatch.setattr(spill.mmap, "mmap", no_map)
    got = read_npz(path)
    assert got["a"].tolist() == list(range(10)) and got["a"].dtype == np.uint16 and got["__bases__"].tolist() == [3]
