"""The live recorder: interned integer columns, chunked, spilled to disk when large.

Why integers: appending tuples or lists per op creates gc-tracked objects, and a
process with torch imported already holds ~166k of them, so full collections
come often and dominate. Every per-op value here is an int in an
``array`` column; repeated values (op overloads, tensor metas, tuples of metas,
module paths, autograd node names, source locations) are interned once.

Columns grow until ``chunk_rows``; a full chunk is frozen into numpy arrays
(compact, not gc-tracked) and, past ``spill_rows`` rows in memory, written to an
Arrow IPC file in a spill directory. ``decode.py``
decodes the ids into the Arrow tables of ``schema``.
"""
from __future__ import annotations

import os
import shutil
from array import array
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import (
    Any,
    Callable,
    Literal,
    Optional,
    Union,
    overload,
)

import numpy as np
import numpy.typing as npt

from .._tensormeta import memory_format
from ..errors import SpillError
from ..native import abi_layout as _abi

# (re-exported: the engines, the decoder and the function modes import them from here)
from .packed_rows import CallStore as CallStore
from .packed_rows import Packed as Packed
from .packed_rows import RowBuffer as RowBuffer
from .packed_rows import _npz_bytes
from .packed_rows import pack as pack
from .packed_rows import unpack as unpack
from .spill import make_spill_dir, read_npz, spill_file, spill_note
from .storage_rows import StorageRows

# ops row flags
F_INPLACE = 1
F_VIEW = 2
F_OUT_KW = 4          # out= variant
F_BACKWARD = _abi.F_BACKWARD   # the engine's row flag (native/abi.h), the same bit here

# Row layouts: one interleaved int64 array per table, one ``extend`` per row (a
# dozen separate appends cost ~1 µs more per op).
OPS_FIELDS = ("op", "ins", "outs", "alias", "module", "call", "node", "seq_nr", "flags", "flops", "start", "dur")
#: the calls row fields in native/abi.h kCallFieldOrder (field(cid, k) / column(k) index them)
CALL_FIELDS = _abi.CALL_FIELDS
C_SRC, C_FIRST_SEQ, C_N_OPS, C_ERROR, C_START, C_DUR = (CALL_FIELDS.index(k) for k in
                                                      ("src", "first_seq", "n_ops", "error", "start", "dur"))
CALL_WIDTH = len(CALL_FIELDS)
TENSOR_COLUMNS = (
    ("meta", "i"), ("nbytes", "q"), ("alloc_seq", "q"), ("free_seq", "q"),
    ("module", "i"), ("call", "q"),
)

#: ops columns whose one value on every row is tracked (``Recorder.op_constants``): what decodes to
#: a column null on every row (spilled.null_ops), which a spilled ops file leaves out
CONSTANT_COLUMNS = ("seq_nr", "node", "module", "flops")

class Interner:
    """value -> dense int id; ``values[id]`` gives it back. Id 0 may be reserved."""

    __slots__ = ("ids", "values")

    def __init__(self, reserve_none: bool = False) -> None:
        self.ids: dict[Any, int] = {}
        self.values: list[Any] = []
        if reserve_none:
            self.ids[None] = 0
            self.values.append(None)

    def __call__(self, v: Any) -> int:
        i = self.ids.get(v)
        if i is None:
            i = self.ids[v] = len(self.values)
            self.values.append(v)
        return i

    def __len__(self) -> int:
        return len(self.values)


class TensorMetas:
    """Interned tensor metadata keyed by ``(shape, stride, dtype, device)``.

    Derived facts (format label, ambiguity, item size) are computed once per
    distinct meta, not per op.
    """

    __slots__ = ("ids", "shapes", "strides", "dtypes", "devices", "formats", "ambiguous", "nbytes", "itemsize")

    def __init__(self) -> None:
        self.ids: dict[tuple[Any, ...], int] = {}
        self.shapes: list[tuple[int, ...]] = []
        self.strides: list[Optional[tuple[int, ...]]] = []   # None: not strided
        self.dtypes: list[str] = []
        self.devices: list[str] = []
        self.formats: list[str] = []
        self.ambiguous: list[bool] = []
        self.nbytes: list[int] = []
        self.itemsize: list[int] = []

    def add(self, key: tuple[Any, ...], shape: Sequence[int], stride: Optional[Sequence[int]], dtype: Any,
            device: Any) -> int:
        i = len(self.shapes)
        self.ids[key] = i
        shape_t = tuple(shape)
        stride_t = tuple(stride) if stride is not None else None
        self.shapes.append(shape_t)
        self.strides.append(stride_t)
        self.dtypes.append(str(dtype).replace("torch.", ""))
        self.devices.append(str(device))
        if stride_t is None:
            fmt, amb = "non_strided", False
        else:
            fmt, amb = memory_format(shape_t, stride_t)
        self.formats.append(fmt)
        self.ambiguous.append(amb)
        try:
            isz = dtype.itemsize
        except Exception:
            isz = 0
        n = 1
        for s in shape_t:
            n *= s
        self.itemsize.append(isz)
        self.nbytes.append(n * isz)
        return i


#: one value of a :class:`SparseInts`: an int (``width`` 1) or a tuple of ``width`` ints
SparseValue = Union[int, tuple[int, ...]]


class SparseInts:
    """seq -> an int (or a tuple of ``width`` ints) for a per-op fact many rows may have: the python
    engine's ``probe_ns`` (every screened op), the non-finite screen's ``(count, produced)`` (every op
    after a NaN spreads). ``d[seq] = v`` appends to two ``array('q')`` columns (8 B a value, where a
    dict held ~100 an entry); ``freeze`` packs them (a few bytes an entry) with each op chunk, and
    ``spill`` writes the packed parts with the op chunks (one ``<name>-*.npz`` file each).

    Reads as the dicts of the other sparse facts do (``len``, truthiness, iteration over seqs,
    ``values()``, ``items()``, ``get``, ``update``), and ``rows_in(start, n)`` gives one chunk's entries
    without reading the others (decode.py). A seq written twice: the later value wins, as in a dict.
    """

    __slots__ = ("seqs", "vals", "frozen", "spilled", "n_spilled", "name", "width")

    def __init__(self, name: str = "sparse", width: int = 1) -> None:
        self.name = name
        self.width = width
        self.seqs = array("q")
        self.vals = array("q")   # ``width`` values an entry, interleaved
        self.frozen: list[tuple[int, int, Packed, Packed]] = []   # (first seq, last seq, seqs, values)
        self.spilled: list[tuple[int, int, str]] = []             # (first seq, last seq, file)
        self.n_spilled = 0                                         # entries in the spilled files

    def __setitem__(self, seq: int, value: SparseValue) -> None:
        self.seqs.append(seq)
        if isinstance(value, tuple):
            self.vals.extend(value)
        else:
            self.vals.append(value)

    def update(self, other: Mapping[int, SparseValue]) -> None:
        for seq, value in other.items():
            self[seq] = value

    def extend(self, seqs: np.ndarray, vals: np.ndarray) -> None:
        """Many entries at once: ``seqs`` and a ``(len(seqs), width)`` array of values."""
        self.seqs.frombytes(np.ascontiguousarray(seqs, dtype=np.int64).tobytes())
        self.vals.frombytes(np.ascontiguousarray(vals, dtype=np.int64).tobytes())

    def __len__(self) -> int:
        return self.n_spilled + len(self.seqs) + sum(len(f[2][1]) for f in self.frozen)

    def spill(self, directory: str) -> None:
        """Pack what is live, write the packed parts to ``directory`` and drop them from memory."""
        self.freeze()
        while self.frozen:
            lo, hi, (sb, sa), (vb, va) = self.frozen[0]
            name = f"{self.name}-{len(self.spilled):06d}.npz"
            with spill_file(directory, name, sa.nbytes + va.nbytes + 1000) as f:
                np.savez(f, seqs=sa, vals=va, bases=np.array([sb, vb], dtype=np.int64))   # no pickle
            self.spilled.append((lo, hi, os.path.join(directory, name)))
            self.n_spilled += len(sa)
            self.frozen.pop(0)

    def freeze(self) -> None:
        """Pack the entries appended since the last call."""
        if not len(self.seqs):
            return
        seqs = np.frombuffer(self.seqs, dtype=np.int64).copy()
        vals = np.frombuffer(self.vals, dtype=np.int64).copy()
        self.frozen.append((int(seqs.min()), int(seqs.max()), pack(seqs), pack(vals)))
        self.seqs = array("q")
        self.vals = array("q")

    def _parts(self, start: int = 0, stop: Optional[int] = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(seqs, ``(entries, width)`` values) of each part that may hold seqs in ``[start, stop)``."""
        w = self.width
        for lo, hi, path in self.spilled:
            if hi >= start and (stop is None or lo < stop):
                z = read_npz(path)
                sb, vb = z["bases"].tolist()
                yield unpack((sb, z["seqs"])), unpack((vb, z["vals"])).reshape(-1, w)
        for lo, hi, seqs, vals in self.frozen:
            if hi >= start and (stop is None or lo < stop):
                yield unpack(seqs), unpack(vals).reshape(-1, w)
        if len(self.seqs):
            yield np.frombuffer(self.seqs, dtype=np.int64), np.frombuffer(self.vals, dtype=np.int64).reshape(-1, w)

    def _value(self, row: list[int]) -> SparseValue:
        return row[0] if self.width == 1 else tuple(row)

    def __iter__(self) -> Iterator[int]:
        for seqs, _ in self._parts():
            yield from seqs.tolist()

    def values(self) -> list[SparseValue]:
        return [self._value(v) for _, vals in self._parts() for v in vals.tolist()]

    def items(self) -> Iterator[tuple[int, SparseValue]]:
        for seqs, vals in self._parts():
            for s, v in zip(seqs.tolist(), vals.tolist()):
                yield s, self._value(v)

    def get(self, seq: int, default: Optional[SparseValue] = None) -> Optional[SparseValue]:
        got = default
        for seqs, vals in self._parts(seq, seq + 1):
            hit = np.nonzero(seqs == seq)[0]
            if len(hit):
                got = self._value(vals[hit[-1]].tolist())
        return got

    def rows_in(self, start: int, n: int, dtype: npt.DTypeLike, width: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """The entries whose seq falls in ``[start, start + n)``: (row positions from ``start``,
        values as a ``(rows, width)`` array of ``dtype``), as ``decode._sparse_rows`` gives a dict's."""
        assert width == self.width, (width, self.width)
        rows, vals = [], []
        for seqs, v in self._parts(start, start + n):
            sel = (seqs >= start) & (seqs < start + n)
            rows.append(seqs[sel] - start)
            vals.append(v[sel])
        if not rows:
            return np.zeros(0, np.int64), np.zeros((0, width), dtype=dtype)
        return np.concatenate(rows), np.concatenate(vals).astype(dtype)


def _release_memory() -> None:
    """After a spill's parts are written: return the Arrow memory pool's cached free buffers
    (jemalloc/mimalloc keep what decoding the parts used) to the OS; a long trace would otherwise
    hold that high-water as resident memory (~40 B/op of a 1M-op ``dataset=`` trace)."""
    try:
        import pyarrow as pa

        pa.default_memory_pool().release_unused()
    except Exception:
        pass


class Recorder:
    """Holds everything one trace records. Plain values only: never a tensor."""

    def __init__(self, chunk_rows: int = 65536, spill_rows: int = 500_000, spill_dir: Optional[str] = None) -> None:
        self.chunk_rows = chunk_rows
        self.spill_rows = spill_rows
        self._spill_parent = spill_dir
        self.spill_path: Optional[str] = None
        self.n_spilled = 0
        self.spilled_chunks: list[str] = []
        self.spilled_counts: list[int] = []          # rows of each spilled chunk
        self.mem_chunks: list[dict[str, Packed]] = []   # frozen chunks: column -> pack()ed
        self.mem_rows = 0
        #: per CONSTANT_COLUMNS column, its value on every row of the chunks frozen so far, or None
        #: once two rows differ (``add_chunk``): what is null on every row is known before decoding
        self.op_constants: dict[str, Optional[int]] = {}
        self.on_spill: Optional[Callable[[], None]] = None   # called after each spill (dataset=: decode the spilled rows into parts)
        #: the first spill that failed (spill.py): from then on rows stay in memory; reported at the end
        self.spill_failed: Optional[SpillError] = None

        self.funcs = Interner()                       # OpOverload -> id
        self.metas = TensorMetas()
        self.tuples = Interner()                      # tuple of meta ids -> id
        self.aliases = Interner()                     # tuple of input indexes -> id
        self.modules = Interner(reserve_none=True)    # module path -> id (0: none)
        self.nodes = Interner(reserve_none=True)      # autograd node name -> id (0: forward)
        self.sources = Interner(reserve_none=True)    # (file, line) -> id
        self.call_funcs = Interner()                  # torch-level callable -> id
        self.autocasts = Interner(reserve_none=True)  # autocast dtype str -> id

        self.ops = RowBuffer(OPS_FIELDS)
        self.storages = array("q")                    # in storages then out storages, row after row
        self.n_ops = 0
        self.chunk_start = 0                          # seq of the first row of the live chunk

        self.calls = CallStore(CALL_FIELDS)
        self.n_calls = 0

        #: the storage records (the tensors table's rows): finished ones spill with the op chunks
        self.tensors = StorageRows()

        # sparse per-op facts: seq -> value
        self.op_errors: dict[int, int] = {}
        self.cuda_ns: dict[int, int] = {}
        #: seq -> (count, produced) of the ops whose outputs held NaN/Inf (every op once a NaN spreads)
        self.nonfinite = SparseInts("nonfinite", 2)
        self.numerics: dict[int, tuple[float, float]] = {}
        #: seq -> ns tensorscope's own probes took after the op (screen, numerics shadow, op hooks): python engine
        self.probe_ns = SparseInts("probe_ns")
        #: key hash -> seq of its first row, for the (op, shapes, dtypes, devices) keys this trace ran first in
        #: the process (decode.py): rows decoded twice (spilled parts, then the table) get the same answer
        self.first_keys: dict[int, int] = {}
        #: fingerprints=True: seq -> (hash, nonfinite, sum, abs_sum, max_abs) of the op's first float output
        self.fingerprints: dict[int, tuple[int, int, float, float, float]] = {}
        self.errors: list[dict[str, Any]] = []
        self.tracer_errors: list[str] = []     # the first messages
        self.n_tracer_errors = 0
        self.notes: list[str] = []
        #: the engine's own time per op outside the op (the gaps between ops hold it), where it times a sample
        #: of its rows and calls (native), else None; own_calls_ns: its function mode's part, for all calls
        self.own_op_ns: Optional[int] = None
        self.own_calls_ns: Optional[int] = None

    # -- ops ---------------------------------------------------------------
    def end_chunk(self) -> None:
        """Freeze the live op chunk (called every ``chunk_rows`` rows) into packed numpy columns."""
        chunk = self.ops.freeze()
        chunk["storages"] = np.frombuffer(self.storages, dtype=np.int64).copy()
        self.storages = array("q")
        rows = len(chunk["op"])
        self.chunk_start += rows
        self.probe_ns.freeze()
        self.nonfinite.freeze()
        self.tensors.freeze()
        if rows == 0:
            return
        self.add_chunk({k: pack(v) for k, v in chunk.items()})
        self.mem_rows += rows
        if self.mem_rows > self.spill_rows:
            self._spill()

    def add_chunk(self, packed: dict[str, Packed]) -> None:
        """A frozen chunk (column -> ``pack()``ed, non-empty) into ``mem_chunks``, noting in
        ``op_constants`` which CONSTANT_COLUMNS columns still hold one value on every row (a packed
        column whose narrow array is all zero holds its base)."""
        self.mem_chunks.append(packed)
        for k in CONSTANT_COLUMNS if len(packed["op"][1]) else ():   # an empty chunk says nothing
            base, a = packed[k]
            v = None if a.any() else int(base)
            self.op_constants[k] = v if self.op_constants.get(k, v) == v else None

    def _spill(self) -> None:
        """Write the frozen chunks in memory to the spill directory (then ``on_spill``). A chunk
        that cannot be written (a full disk...) stays in memory with every chunk after it, and
        nothing is written from then on: the first ``SpillError`` is kept in ``spill_failed``
        for the end of the trace to report, never raised into the program."""
        if self.spill_failed is None:
            try:
                self._write_chunks()
            except SpillError as e:
                self.spill_failure(e, f"the ops rows after the first {self.n_spilled} were" if self.n_spilled
                                    else "every ops row was")
        if self.on_spill is not None:
            try:
                self.on_spill()
            except Exception as e:   # never into user code
                self.tracer_error("on_spill", e)
            _release_memory()   # the decoded parts are written: give their buffers back

    def _write_chunks(self) -> None:
        """Each chunk of ``mem_chunks`` into one ``.npz`` file, in order; the chunks written leave
        ``mem_chunks`` as they go (spilled chunks always precede the ones in memory)."""
        if self.spill_path is None:
            self.spill_path = make_spill_dir(self._spill_parent, "tensorscope-spill-",
                                             sum(_npz_bytes(c) for c in self.mem_chunks), "the spilled rows")
        while self.mem_chunks:
            chunk = self.mem_chunks[0]
            name = f"chunk-{len(self.spilled_chunks):06d}.npz"
            # Any: mypy would match a '**' dict of arrays against savez's keyword allow_pickle: bool
            arrays: dict[str, Any] = {k: v for k, (_, v) in chunk.items()}
            arrays["__bases__"] = np.array([chunk[k][0] for k in sorted(chunk)], dtype=np.int64)
            needed = _npz_bytes(chunk)
            with spill_file(self.spill_path, name, needed) as f:
                np.savez(f, **arrays)   # numeric arrays only: no pickle is written or read
            rows = len(chunk["op"][1])
            self.spilled_chunks.append(os.path.join(self.spill_path, name))
            self.spilled_counts.append(rows)
            self.n_spilled += rows
            self.mem_chunks.pop(0)
            self.mem_rows -= rows
        self.mem_rows = 0
        self.calls.spill(self.spill_path)   # the finished calls rows go with them (python engine)
        self.probe_ns.spill(self.spill_path)
        self.nonfinite.spill(self.spill_path)
        self.tensors.spill(self.spill_path)   # the finished storage records

    def spill_failure(self, e: SpillError, what: str) -> None:
        """A spill file could not be written: nothing is written from now on (a full disk is the
        program's too); the note says what stayed in memory, the end of the trace raises ``e``."""
        # kept until the end of the trace: without their tracebacks, whose frames' f_back chain
        # reaches the user's frame the spill ran under (its tensors would outlive their scope)
        seen: set[int] = set()
        err: Optional[BaseException] = e
        while err is not None and id(err) not in seen:
            seen.add(id(err))
            err.__traceback__ = None
            err = err.__cause__ or err.__context__
        if self.spill_failed is None:
            self.spill_failed = e
            self.notes.append(spill_note(e, what))

    @overload
    def iter_op_chunks(self, columns: Optional[Collection[str]] = None, from_seq: int = 0,
                       with_start: Literal[False] = False) -> Iterator[dict[str, np.ndarray]]: ...

    @overload
    def iter_op_chunks(self, columns: Optional[Collection[str]] = None, from_seq: int = 0, *,
                       with_start: Literal[True]) -> Iterator[tuple[int, dict[str, np.ndarray]]]: ...

    def iter_op_chunks(self, columns: Optional[Collection[str]] = None, from_seq: int = 0, with_start: bool = False
                       ) -> Iterator[Union[dict[str, np.ndarray], tuple[int, dict[str, np.ndarray]]]]:
        """Every op chunk in order as int64 columns (only ``columns`` when given), spilled ones
        read back from disk; chunks that end before ``from_seq`` are skipped unread. With
        ``with_start``: ``(seq of the chunk's first row, chunk)`` pairs."""
        start = 0
        for path, n in zip(self.spilled_chunks, self.spilled_counts):
            if start + n > from_seq:
                z = read_npz(path)
                names = sorted(k for k in z if k != "__bases__")
                bases = z["__bases__"]
                chunk = {k: unpack((int(bases[i]), z[k])) for i, k in enumerate(names)
                         if columns is None or k in columns}
                del z
                yield (start, chunk) if with_start else chunk
            start += n
        for packed in self.mem_chunks:
            n = len(packed["op"][1])
            if start + n > from_seq:
                out = {k: unpack(v) for k, v in packed.items() if columns is None or k in columns}
                yield (start, out) if with_start else out
            start += n

    def close(self) -> None:
        self.calls.close_reads()
        if self.spill_path is not None:
            shutil.rmtree(self.spill_path, ignore_errors=True)
            self.spill_path = None

    # -- errors --------------------------------------------------------------
    def add_error(self, **row: Any) -> int:
        eid = len(self.errors)
        row["error_id"] = eid
        self.errors.append(row)
        return eid

    def tracer_error(self, where: str, exc: BaseException) -> None:
        """A bug inside tensorscope: counted, never raised into user code."""
        self.n_tracer_errors += 1
        if len(self.tracer_errors) < 20:
            self.tracer_errors.append(f"{where}: {type(exc).__name__}: {exc}")
