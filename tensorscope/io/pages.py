"""Give the file pages of memory-mapped tables back once a pass has read them (Linux).

A long trace's big tables are Arrow IPC files mapped read-only (``recording/spill.py``
``write_ipc``, ``io/derived.py``, a loaded trace's ``io/parquet.py``): a pass over a column maps its
pages into the process, and they stay counted in its resident size (``RssFile``, what ``ps``,
``psutil`` and a notebook's memory indicator show) until the kernel needs the memory. They are page
cache, not memory the trace holds, but a 10 M-op trace's passes would show gigabytes. ``release``
tells the kernel the pages of the given tables are not needed now (``madvise(MADV_DONTNEED)``): the
next read maps them again from the page cache (or the file), so no value can change.

Safe by construction: only ranges inside a read-only mapping of one of tensorscope's own table
files are advised (``/proc/self/maps``: permissions ``r--s`` or ``r--p``, an ``.arrow`` or ``.npy``
(or ``.npz``) file in a ``tensorscope-*`` directory: mapped read-only and never written through, so dropping a
page loses nothing). Never anonymous memory (an in-memory table's buffers), a library's segments
(a relocated ``r--p`` page is private data) or a mapping of anyone else's; the caller's table keeps
every mapping alive while it runs. Anywhere else (not Linux, no ``madvise``) it does nothing.
"""
from __future__ import annotations

import mmap
import sys
from collections.abc import Iterable, Iterator
from typing import Any, Optional, TypeVar

T = TypeVar("T")

#: a table past this many rows is memory-mapped where it is built or loaded from a file (a derived
#: table, a loaded one: ``io/derived.py``, ``io/parquet.py``); one below is in memory unless its trace
#: spilled, and a pass over it is too short to give pages back batch by batch
MMAP_ROWS = 262144

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4   # linux/mman.h
_madvise: Optional[Any] = None
_loaded = False


def _libc_madvise() -> Optional[Any]:
    global _madvise, _loaded
    if not _loaded:
        _loaded = True
        if sys.platform.startswith("linux"):
            import ctypes  # here: a trace held in memory never needs it

            try:
                f = ctypes.CDLL(None, use_errno=True).madvise
                f.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
                f.restype = ctypes.c_int
                _madvise = f
            except (OSError, AttributeError):
                _madvise = None
    return _madvise


def _own(path: str) -> bool:
    """A table file tensorscope wrote and maps read-only (the spill, tables, derived, load folders)."""
    if path.endswith(" (deleted)"):
        path = path[:-len(" (deleted)")]
    if not path.endswith((".arrow", ".npy", ".npz")):
        return False
    return any(part.startswith(("tensorscope-", ".tensorscope-")) for part in path.split("/")[:-1])


def _table_maps() -> list[tuple[int, int]]:
    """(start, end) of this process's read-only mappings of tensorscope's table files, sorted."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.rstrip("\n").split(None, 5)
                if len(parts) < 6 or parts[1] not in ("r--s", "r--p") or not _own(parts[5].strip()):
                    continue
                lo, _, hi = parts[0].partition("-")
                out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    out.sort()
    return out


def _buffers(obj: Any) -> Iterator[Any]:
    """Every Arrow buffer of a Table, RecordBatch, ChunkedArray or Array (dictionaries included)."""
    import pyarrow as pa

    if isinstance(obj, (pa.Table, pa.RecordBatch)):
        for col in obj.columns:
            yield from _buffers(col)
    elif isinstance(obj, pa.ChunkedArray):
        for ch in obj.chunks:
            yield from _buffers(ch)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _buffers(o)
    elif isinstance(obj, pa.Array):
        for b in obj.buffers():
            if b is not None and b.size:
                yield b
        if isinstance(obj, pa.DictionaryArray):
            yield from _buffers(obj.dictionary)


def _ranges(objs: Iterable[Any]) -> list[tuple[int, int]]:
    """The address ranges the objects' buffers cover, merged."""
    spans = sorted((b.address, b.address + b.size) for o in objs if o is not None for b in _buffers(o))
    out: list[tuple[int, int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _advise(spans: list[tuple[int, int]], maps: list[tuple[int, int]]) -> int:
    """madvise(DONTNEED) the whole pages of ``spans`` (sorted, merged) inside ``maps`` (sorted)."""
    fn = _libc_madvise()
    if fn is None:
        return 0
    done = 0
    i = 0
    for lo, hi in spans:
        while i < len(maps) and maps[i][1] <= lo:
            i += 1
        j = i
        while j < len(maps) and maps[j][0] < hi:
            mlo, mhi = maps[j]
            # whole pages inside both the mapping and the buffers' span (the mapping's own bounds
            # are page-aligned; a page the span covers partly holds only this file's bytes too)
            a = max(mlo, lo - lo % _PAGE)
            b = min(mhi, hi + (-hi) % _PAGE)
            if b > a and fn(a, b - a, _MADV_DONTNEED) == 0:
                done += b - a
            j += 1
    return done


def release(*objs: Any) -> int:
    """Advise the kernel that the mapped file pages under ``objs`` (Arrow tables, batches, arrays)
    are not needed now; returns the bytes advised (0 where nothing is mapped or not on Linux)."""
    if _libc_madvise() is None:
        return 0
    spans = _ranges(objs)   # the objects stay referenced by the caller: their mappings stay mapped
    return _advise(spans, _table_maps()) if spans else 0


class Pass:
    """A pass over one table a batch at a time: ``done(batch)`` gives back the file pages of a batch
    of it once read, so a pass over a mapped table keeps one batch's pages, not the table's.

    The table's own mappings are read once, when the pass starts (a table of at least ``MMAP_ROWS``
    rows; a shorter one, or one in memory, costs nothing per batch), and the pass holds the table:
    its mappings stay, so a batch's pages are advised without reading the process's mappings again.
    """

    __slots__ = ("_table", "_maps")

    def __init__(self, table: Any) -> None:
        self._table = table
        self._maps: list[tuple[int, int]] = []
        if getattr(table, "num_rows", 0) >= MMAP_ROWS and _libc_madvise() is not None:
            spans = _ranges([table])
            self._maps = [m for m in _table_maps() if any(lo < m[1] and hi > m[0] for lo, hi in spans)]

    def done(self, *objs: Any) -> int:
        """Give back the pages of ``objs`` (batches or slices of the table); the bytes advised."""
        return _advise(_ranges(objs), self._maps) if self._maps else 0


def passing(table: Any, batches: Iterable[T]) -> Iterator[T]:
    """``batches`` (of ``table``) as they are, each one's pages given back once the next is asked for."""
    p = Pass(table)
    if not p._maps:
        yield from batches
        return
    prev: Optional[T] = None
    for b in batches:
        if prev is not None:
            p.done(prev)
        yield b
        prev = b
    if prev is not None:
        p.done(prev)
