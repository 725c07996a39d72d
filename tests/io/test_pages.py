"""Giving back the file pages of memory-mapped tables (tensorscope/io/pages.py).

A spilled trace's tables are Arrow files mapped read-only; a pass over them maps their pages into
the process. ``release`` (``Trace._release_pages``) advises the kernel they are not needed: the
process's resident file pages of those files drop (read from /proc/self/smaps), and every value
reads back the same. It must never touch anonymous memory (an in-memory table) or any mapping but
tensorscope's own table files. Linux only (madvise and /proc); run under both engines.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pyarrow as pa
import pytest
import torch

import tensorscope
from tensorscope.io import pages

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps")


def _resident(directory: str) -> int:
    """Bytes of this process's resident pages mapped from files under ``directory``."""
    total, cur = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:   # a mapping's header line
                cur = head[5].strip() if len(head) > 5 else ""
            elif line.startswith("Rss:") and cur and cur.startswith(directory):
                total += int(line.split()[1]) * 1024
    return total


def _touch(table: pa.Table) -> int:
    """Read every numeric column of ``table`` whole (its pages get mapped); a checksum."""
    s = 0
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
            s += int(np.nansum(col.to_numpy(zero_copy_only=False).astype(np.float64)) % 1_000_003)
    return s


@pytest.fixture(scope="module")
def spilled(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("spill"))
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with tensorscope.trace(spill_rows=20_000, chunk_rows=10_000, spill_dir=d) as t:
        for _ in range(60_000):
            a.add(b)
    return t.result, d


@linux_only
def test_release_gives_back_the_mapped_pages_and_values_read_the_same(spilled):
    t, d = spilled
    assert t._spill_dir is not None and t._spill_dir.startswith(d)
    ops = t.table("ops")
    before = _touch(ops)
    touched = _resident(t._spill_dir)
    assert touched > 1 << 20, touched   # the pass mapped the ops file's pages
    advised = t._release_pages()
    assert advised >= touched // 2
    assert _resident(t._spill_dir) < touched // 4
    assert _touch(ops) == before   # read again from the file: the same values
    assert ops.column("seq").to_pylist()[-3:] == [59_997, 59_998, 59_999]


@linux_only
def test_summary_and_save_leave_few_pages_behind(spilled, tmp_path):
    t, _ = spilled
    _touch(t.table("ops"))
    text = t.summary().to_text()
    assert "ops" in text
    size = sum(os.path.getsize(os.path.join(t._spill_dir, f)) for f in os.listdir(t._spill_dir))
    assert _resident(t._spill_dir) < size // 4   # each section's pages went back after it
    t.save(tmp_path / "saved")
    assert _resident(t._spill_dir) < size // 4
    assert tensorscope.load(tmp_path / "saved").ops.equals(t.ops)


def test_memory_is_never_advised():
    """An in-memory table (anonymous memory): nothing is advised, nothing changes."""
    arr = np.arange(1 << 20, dtype=np.int64)
    table = pa.table({"x": arr, "y": pa.array(["a", "b"] * (1 << 19)).dictionary_encode()})
    assert pages.release(table, table.column("x"), table.to_batches()[0]) == 0
    assert table.column("x").to_numpy()[-1] == (1 << 20) - 1 and table.column("y")[3].as_py() == "b"


def test_only_tensorscope_table_files_count_as_its_own():
    assert pages._own("/tmp/tensorscope-tables-abc/ops.arrow")
    assert pages._own("/tmp/tensorscope-spill-x/storages-000001-sid.npy (deleted)")
    assert pages._own("/data/.tensorscope-save-1/x/calls.arrow")
    # a library's relocated read-only segment is private data: never
    assert not pages._own("/root/.cache/tensorscope/native/engine-0/tensorscope_engine.so")
    assert not pages._own("/usr/lib/libarrow.so.2600")
    assert not pages._own("/home/me/data/ops.arrow")        # someone else's file
    assert not pages._own("/tmp/tensorscope-tables-abc")    # no file


def test_a_trace_in_memory_reads_no_mappings():
    a = torch.ones(3)
    with tensorscope.trace() as t:
        a + 1
    assert t.result._spill_dir is None
    assert t.result._release_pages() == 0


@linux_only
def test_a_pass_keeps_one_batch_of_pages(tmp_path):
    """A pass over a mapped table a slice at a time (``totals.row_batches``, the sections' reader):
    while it runs, the pages of the slices it finished go back, so about one slice's pages are
    resident, not the columns'."""
    from tensorscope.analyses.totals import row_batches

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with tensorscope.trace(spill_rows=100_000, spill_dir=str(tmp_path)) as h:
        for _ in range(pages.MMAP_ROWS + 40_000):
            a.add(b)
    t = h.result
    ops = t.table("ops")
    t._release_pages()
    names = ["seq", "start_ns", "cpu_ns", "call_id", "bytes_read"]
    whole = sum(ops.column(n).nbytes for n in names)
    seen, total = [], 0
    for batch in row_batches(ops, names, rows=8192):
        total += int(np.asarray(batch.column(0)).sum())
        for k in range(1, len(names)):   # every column's pages read
            batch.column(k).to_numpy(zero_copy_only=False).sum()
        seen.append(_resident(t._spill_dir))
    assert total == sum(range(ops.num_rows))   # every row read, once
    assert max(seen) < whole // 4, (max(seen), whole)


def test_passing_gives_the_batches_unchanged():
    table = pa.table({"x": np.arange(300_000, dtype=np.int64)})
    got = list(pages.passing(table, table.to_batches(max_chunksize=70_000)))
    assert [b.num_rows for b in got] == [70_000, 70_000, 70_000, 70_000, 20_000]
    assert pa.Table.from_batches(got).equals(table)
