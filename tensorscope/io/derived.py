"""A derived table of a big trace (``memory``, ``memory_timeline``) built batch by batch into a
memory-mapped Arrow IPC file instead of memory.

``table_from_batches(schema, batches, rows, directory)``: past ``MAP_ROWS`` rows the batches are
written one at a time to an IPC file in ``directory`` (a spilled trace's table directory, else a new
temporary one), read back memory-mapped (zero-copy: the table's buffers are the file's pages) and
the file unlinked (the mapping keeps its pages; the disk space goes with the table, so nothing is
left behind). What it holds in memory is one batch. Where a file cannot be written, mapped or
unlinked (a full disk, Windows) the batches are built again in memory: the same table.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import Callable, Optional

import pyarrow as pa

from .pages import MMAP_ROWS

__all__ = ["MAP_ROWS", "table_from_batches"]

#: a derived table of more rows than this is built into a memory-mapped file (the row count past
#: which ``load`` maps a table)
MAP_ROWS = MMAP_ROWS


def table_from_batches(schema: pa.Schema, batches: Callable[[], Iterable[pa.RecordBatch]], rows: int,
                       directory: Optional[str] = None, name: str = "derived", map_rows: Optional[int] = None) -> pa.Table:
    """The table of ``batches()`` (``rows`` rows in all): in memory up to ``map_rows`` rows, else
    memory-mapped from an unlinked IPC file in ``directory`` (None or gone: a temporary directory);
    ``map_rows`` None: ``MAP_ROWS``."""
    if rows <= (MAP_ROWS if map_rows is None else map_rows):
        return pa.Table.from_batches(list(batches()), schema=schema).combine_chunks()
    mapped = _mapped(schema, batches, directory, name)
    if mapped is not None:
        return mapped
    return pa.Table.from_batches(list(batches()), schema=schema)


def _mapped(schema: pa.Schema, batches: Callable[[], Iterable[pa.RecordBatch]], directory: Optional[str],
            name: str) -> Optional[pa.Table]:
    own = None
    try:
        if directory is None or not os.path.isdir(directory):
            directory = own = tempfile.mkdtemp(prefix="tensorscope-derived-")
        fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".arrow", dir=directory)
    except OSError:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
        return None
    try:
        with os.fdopen(fd, "wb") as f, pa.ipc.new_file(pa.PythonFile(f, mode="w"), schema) as writer:
            for b in batches():
                writer.write_batch(b)
        with pa.memory_map(path) as src:
            table = pa.ipc.open_file(src).read_all()
        os.unlink(path)
        return table
    except OSError:
        return None
    finally:
        if os.path.exists(path):
            try:
                os.unlink(path)
            except OSError:
                pass
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
