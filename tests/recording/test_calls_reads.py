"""Reading spilled calls chunks: the open files and fields a calls store keeps while the decoder reads
a range of every field at a time (``CallStore.spilled_field``)."""
from __future__ import annotations

import numpy as np

from tensorscope.recording import columns
from tensorscope.recording.recorder import CALL_FIELDS, OPEN_CHUNKS, CallStore


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


def test_close_reads_closes_the_open_chunks(tmp_path):
    store, rows = _spilled_store(tmp_path, 3, 4)
    columns.call_rows(store, "func", 0, 12)
    open_files = [z for z, _b, _f in store._reading.values()]
    assert len(open_files) == 3
    store.close_reads()
    assert not store._reading
    assert all(z.fid is None or z.fid.closed for z in open_files)
    # read again after closing: the files are opened anew
    assert columns.call_rows(store, "func", 2, 10).tolist() == rows[2:10, CALL_FIELDS.index("func")].tolist()
    store.close_reads()
