"""A spilled trace's big tables as memory-mapped Arrow IPC files (see docs/development/architecture.md,
"Finishing a spilled trace").

``SpillFiles`` is the directory they live in (the Trace removes it): it writes record batches to a
file through the spill seam (``spill.py``) and reads it back memory-mapped, or, once a write failed
(a full disk), builds the table in memory; ``mapped_table`` builds a finished table from its
decoded (mapped) columns and what probes contributed; ``null_ops`` names the ops columns null on every
row of a trace; ``null_column`` is an all-null column of shared chunks; ``release_memory`` gives freed
memory back to the OS between the stages of a spilled finish; ``call_facts`` keeps the per-call
facts the ops decode reads in a mapped file of the spill directory.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Callable, Optional, Union

import numpy as np
import pyarrow as pa

from ..errors import SpillError
from .columns import CALL_RANGE
from .opfacts import FLOP_AT_BUILD
from .recorder import CONSTANT_COLUMNS
from .spill import make_spill_dir, write_ipc, write_npy

if TYPE_CHECKING:
    from .columns import _Dict
    from .recorder import Recorder

Column = Union[pa.Array, pa.ChunkedArray]


class SpillFiles:
    """The directory a spilled trace's big tables live in, as memory-mapped Arrow IPC files.

    Each table is written batch by batch (never whole in RAM) and read back memory-mapped: its
    pages are file-backed, so the kernel drops them under pressure instead of the process growing.
    The Trace removes the directory when it goes (``Trace(_spill_file=...)``: any file in it).
    A file that cannot be written (a full disk: ``SpillError``) is kept in ``rec.spill_failed``
    for the end of the trace to report; that table and every later one are built in memory."""

    def __init__(self, parent: Optional[str], rec: Recorder) -> None:
        self.rec = rec
        self.dir = make_spill_dir(parent, "tensorscope-tables-", 0, "the decoded tables")

    @property
    def used(self) -> bool:
        """Whether any table lives in the directory (the Trace then owns it)."""
        return os.path.isdir(self.dir)

    def path(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.arrow")

    def write(self, name: str, schema: pa.Schema, batches: Callable[[], Iterable[pa.RecordBatch]],
              rows: Optional[int] = None) -> pa.Table:
        """The batches ``batches()`` makes, written to ``name``'s file and read back memory-mapped
        (zero-copy); in memory when a spill file failed (``batches()`` is called again then)."""
        if self.rec.spill_failed is None:
            try:
                return write_ipc(self.dir, f"{name}.arrow", schema, batches(), rows)
            except SpillError as e:
                self.rec.spill_failure(e, f"the decoded {name} table was")
                try:
                    os.rmdir(self.dir)   # nothing written yet: no directory left behind
                except OSError:
                    pass
        return pa.Table.from_batches(list(batches()), schema=schema)


_TRIM: list[Callable[[int], int]] = []   # glibc's malloc_trim, once looked up (empty: none here)
_TRIM_LOOKED = False


def release_memory() -> None:
    """Give freed memory back to the OS: the Arrow pool's cached buffers, and glibc's free heap
    (numpy's buffers come from malloc; past a few large frees glibc raises its mmap threshold and
    keeps them in the heap, where RssAnon still counts them). Finishing a spilled trace calls it
    between its stages so one stage's temporaries do not add to the next one's peak; tens of ms."""
    global _TRIM_LOOKED
    try:
        pa.default_memory_pool().release_unused()
    except Exception:
        pass
    if not _TRIM_LOOKED:
        _TRIM_LOOKED = True
        try:
            import ctypes

            _TRIM.append(ctypes.CDLL("libc.so.6").malloc_trim)
        except Exception:   # not glibc (macOS, musl): nothing to trim
            pass
    for trim in _TRIM:
        trim(0)


def null_ops(rec: Recorder, *, cell: Optional[int], screened: bool, nodes: _Dict, modules: _Dict) -> frozenset[str]:
    """The decoded ops columns null on every row of the trace, known before any chunk is decoded:
    what no probe of this trace recorded, and what the raw columns' one value on every row
    (``rec.op_constants``) decodes to null: ``seq_nr`` < 0 (no autograd), no backward row
    (``node`` 0) or no sequence number for ``fwd_seq``, the none id of ``node`` / ``module``
    (a backward row's module is a forward row's), ``flops`` < 0 but not left for the decode."""
    c = rec.op_constants
    seq_nr, node, module, flops = (c.get(k) for k in CONSTANT_COLUMNS)
    no_seq = seq_nr is not None and seq_nr < 0
    fp_none = not rec.fingerprints
    return frozenset(name for name, none in (
        ("cell", cell is None), ("cuda_ns", not rec.cuda_ns), ("error_id", not rec.op_errors),
        ("nonfinite", not screened), ("nonfinite_produced", not screened or not rec.nonfinite),
        ("num_rel_err", not rec.numerics), ("num_max_abs_err", not rec.numerics),
        ("probe_ns", not rec.probe_ns), ("fp_hash", fp_none), ("fp_nonfinite", fp_none), ("fp_sum", fp_none),
        ("fp_abs_sum", fp_none), ("fp_max_abs", fp_none),
        ("seq_nr", no_seq), ("fwd_seq", no_seq or node == 0),
        ("autograd_node", node is not None and 0 <= node < len(nodes.codes) and nodes.codes[node] < 0),
        ("module", module is not None and 0 <= module < len(modules.codes) and modules.codes[module] < 0),
        ("flops", flops is not None and flops < 0 and flops != FLOP_AT_BUILD)) if none)


class SharedNulls:
    """What the null columns of a table share (``null_column``): one all-null array per (length, type),
    and one zero-filled buffer under the integer and float ones (``_null_array``)."""

    __slots__ = ("arrays", "zeros")

    def __init__(self) -> None:
        self.arrays: dict[tuple[int, pa.DataType], pa.Array] = {}
        self.zeros: Optional[pa.Buffer] = None


def null_column(n: int, typ: pa.DataType, lengths: Optional[Sequence[int]] = None,
                shared: Optional[SharedNulls] = None) -> pa.ChunkedArray:
    """An all-null column of ``n`` rows as chunks (of ``lengths``, else of at most 65536 rows) that
    share one all-null array per length: a long trace's null column holds next to no memory.
    ``shared``: what the caller keeps across the null columns of its tables: they share their arrays
    per (length, type), and the integer and float ones (a dictionary's indices too) one zero-filled
    buffer (``_null_array``)."""
    if lengths is None:
        lengths = [hi - lo for lo, hi in _ranges(n, 65536)]
    shared = SharedNulls() if shared is None else shared
    arrays = shared.arrays
    for m in lengths:
        if (m, typ) not in arrays:   # (not setdefault: its argument, a new array, would be made for every chunk)
            arrays[(m, typ)] = _null_array(m, typ, shared)
    return pa.chunked_array([arrays[(m, typ)] for m in lengths], typ)


def _null_array(m: int, typ: pa.DataType, shared: SharedNulls) -> pa.Array:
    """``pa.nulls(m, typ)``; an integer or float type's (and a dictionary's indices) over the one
    zero-filled buffer in ``shared`` (validity and values alike; ``np.zeros`` maps the kernel's zero
    page: nothing is written or faulted in, where ``pa.nulls`` filled a new buffer per array and type,
    ~0.2 ms each once finishing gave its memory back)."""
    if pa.types.is_dictionary(typ):
        indices = _null_array(m, typ.index_type, shared)
        return pa.DictionaryArray.from_arrays(indices, pa.array([], typ.value_type))
    if not (pa.types.is_integer(typ) or pa.types.is_floating(typ)):
        return pa.nulls(m, typ)
    size = max(m * typ.bit_width // 8, 1)
    if shared.zeros is None or shared.zeros.size < size:
        shared.zeros = pa.py_buffer(np.zeros(max(size, 65536 * 8), np.uint8))
    return pa.Array.from_buffers(typ, m, [shared.zeros, shared.zeros], null_count=m)


def _ranges(n: int, step: int) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` row ranges of at most ``step`` rows covering ``n`` rows."""
    step = max(int(step), 1)
    for lo in range(0, n, step):
        yield lo, min(lo + step, n)


def mapped_table(name: str, schema: pa.Schema, n: int, cols: dict[str, Column], decoded: dict[str, Column],
                  files: SpillFiles) -> pa.Table:
    """Table ``name`` of a spilled trace in ``schema``'s order: its ``decoded`` (memory-mapped)
    columns as they are, the ones probes contributed (``cols`` less ``decoded``) written into a file
    of their own (batches of the decoded chunks' lengths) and memory-mapped, the missing ones null."""
    first = next(iter(decoded.values()), None)
    lengths = [len(c) for c in first.chunks] if isinstance(first, pa.ChunkedArray) and first.num_chunks else [n]
    # a contributed column that is all null is no column: null chunk by chunk below, nothing written
    final: dict[str, Column] = {f.name: cols[f.name] for f in schema
                                if f.name in cols and (cols[f.name].null_count < n or n == 0)}
    contributed = [f for f in schema if f.name in final and final[f.name] is not decoded.get(f.name)]
    if contributed:
        sub = pa.schema(contributed)

        def batches() -> Iterator[pa.RecordBatch]:
            pos = 0
            for m in lengths:
                arrs = []
                for f in contributed:
                    part = cols[f.name].slice(pos, m)
                    if isinstance(part, pa.ChunkedArray):
                        part = part.combine_chunks() if part.num_chunks != 1 else part.chunk(0)
                    arrs.append(part.cast(f.type) if part.type != f.type else part)
                pos += m
                yield pa.RecordBatch.from_arrays(arrs, schema=sub)
        written = files.write(f"{name}-contributed", sub, batches)
        for f in contributed:
            final[f.name] = written.column(f.name)
    shared = SharedNulls()
    return pa.Table.from_arrays([final[f.name] if f.name in final else null_column(n, f.type, lengths, shared)
                                 for f in schema], schema=schema)


def call_facts(rec: Recorder, ranged: Callable[[str, int, int], np.ndarray], func_free: np.ndarray,
                src_type: type, live: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per call: its source id and whether its function is expected to be free, read a range of
    calls at a time. A spilled trace writes them into its spill directory and maps them back (5 B a
    call on disk, not in memory while the ops are decoded); else, or when that file cannot be
    written, they are arrays in memory."""
    n_calls = rec.n_calls
    if live:   # still recording (a dataset= spill decodes ops now): every call so far, whole, from C
        return rec.calls.column("src").astype(src_type), func_free[rec.calls.column("func")]

    def ranges() -> Iterator[tuple[int, int]]:
        return ((lo, min(lo + CALL_RANGE, n_calls)) for lo in range(0, n_calls, CALL_RANGE))

    if rec.spill_path is not None and rec.spilled_chunks and rec.spill_failed is None and n_calls > CALL_RANGE:
        try:
            return (write_npy(rec.spill_path, "call-src.npy", np.dtype(src_type), n_calls,
                              (ranged("src", lo, hi) for lo, hi in ranges())),
                    write_npy(rec.spill_path, "call-free.npy", np.dtype(bool), n_calls,
                              (func_free[ranged("func", lo, hi)] for lo, hi in ranges())))
        except SpillError as e:
            rec.spill_failure(e, "the calls' sources were")
    src: np.ndarray = np.empty(n_calls, src_type)
    free = np.zeros(n_calls, bool)
    for lo, hi in ranges():
        src[lo:hi] = ranged("src", lo, hi)
        free[lo:hi] = func_free[ranged("func", lo, hi)]
    return src, free
