"""Every file a trace writes into its spill directory goes through here.

``spill_file(directory, name, needed)`` opens ``name`` for writing under a temporary name and
renames it into place only once it is whole, so a file that could not be written (a full disk, a
quota, a read-only or missing directory) never leaves half of itself behind for a reader to trip
on. Any ``OSError`` while writing becomes a :class:`~tensorscope.errors.SpillError` naming the
directory, the bytes the write needed and the free space the filesystem reports. ``_open`` is the
one function that opens a spill file (a test injects a full disk there).

The recorder and the finishing code catch the ``SpillError`` and keep the rows in memory instead
(``Recorder.spill_failed``): the program never sees it; ``trace.__exit__`` reports it after the block.
"""
from __future__ import annotations

import errno as _errno
import io
import mmap
import os
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, BinaryIO, Optional

import numpy as np

from ..errors import SpillError

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["spill_file", "write_ipc", "read_npz", "make_spill_dir", "spill_error", "spill_note", "free_bytes", "human_bytes"]


def _open(path: str) -> BinaryIO:
    """The one place a spill file is opened for writing (exclusive create, binary)."""
    return open(path, "xb")


def free_bytes(directory: str) -> Optional[int]:
    """The bytes free to this user on ``directory``'s filesystem (``shutil.disk_usage``), or None
    where it cannot be read (the directory is gone, or the platform does not say)."""
    try:
        return int(shutil.disk_usage(directory).free)
    except (OSError, ValueError):
        return None


def human_bytes(n: int) -> str:
    x = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if x < 1024 or unit == "TB":
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"   # not reached


_ADVICE = {
    _errno.ENOSPC: "the disk is full",
    _errno.EDQUOT: "the disk quota is used up",
    _errno.EROFS: "the filesystem is read-only",
    _errno.EACCES: "the directory is not writable",
    _errno.EPERM: "the directory is not writable",
    _errno.ENOENT: "the directory does not exist",
}


def spill_error(directory: str, needed: int, e: BaseException, what: str) -> SpillError:
    """The SpillError for ``e`` (an ``OSError``) raised while writing ``what`` (``needed`` bytes)
    into ``directory``."""
    free = free_bytes(directory) if os.path.isdir(directory) else free_bytes(os.path.dirname(directory) or ".")
    code = getattr(e, "errno", None)
    why = _ADVICE.get(code, "") if isinstance(code, int) else ""
    reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
    room = f"; {human_bytes(free)} free there" if free is not None else ""
    msg = (f"tensorscope could not spill the trace to {directory!r}: {reason}"
           f"{f' ({why})' if why else ''} while writing {what}"
           f"{f', which needed {human_bytes(needed)} ({needed} bytes)' if needed else ''}{room}. Nothing recorded is lost and the program ran unchanged: what "
           "could not be written stayed in memory (the trace is whole: tensorscope.last()), so memory "
           "was not bounded from then on. Give spill_dir= a directory on a disk with room, or raise "
           "spill_rows= to keep more rows in memory before spilling.")
    # the cause says which call failed (errno); its frames are tensorscope's and numpy's, not the program's
    e.__traceback__ = None
    e.__suppress_context__ = True
    return SpillError(msg, directory=directory, needed=int(needed), free=free)


def spill_note(e: SpillError, what: str) -> str:
    """The trace's note for a failed spill (its metadata keeps it: the saved trace says so too);
    ``what``: what stayed in memory instead."""
    cause = e.__cause__
    reason = getattr(cause, "strerror", None) or (str(cause) if cause is not None else "") or "write failed"
    room = f", {human_bytes(e.free)} free" if e.free is not None else ""
    need = f"; {human_bytes(e.needed)} needed" if e.needed else ""
    return f"spilling to {e.directory} failed ({reason}{need}{room}): {what} kept in memory"


def make_spill_dir(parent: Optional[str], prefix: str, needed: int = 0, what: str = "") -> str:
    """A new private directory under ``parent`` (default: the system's temporary directory), for
    ``what`` (``needed`` bytes: the SpillError's message says so when it cannot be made)."""
    try:
        return tempfile.mkdtemp(prefix=prefix, dir=parent)
    except OSError as e:
        raise spill_error(parent or tempfile.gettempdir(), needed, e,
                          f"{what} into a new directory {prefix}*" if what else f"a new directory {prefix}*") from e


@contextmanager
def spill_file(directory: str, name: str, needed: int) -> Iterator[BinaryIO]:
    """``directory/name`` opened for writing: written under ``name + '.part'`` and renamed into
    place when the block ends; on an ``OSError`` in the block the partial file is removed and a
    :class:`SpillError` raised (``needed``: the bytes the whole file needs, for its message)."""
    path = os.path.join(directory, name)
    tmp = path + ".part"
    f: Optional[BinaryIO] = None
    try:
        f = _open(tmp)
        yield f
        f.close()
        f = None
        os.replace(tmp, path)
    except BaseException as e:   # an interrupt too: no partial file is left
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, SpillError) or not isinstance(e, OSError):
            raise
        raise spill_error(directory, needed, e, name) from e


def write_npy(directory: str, name: str, dtype: np.dtype, n: int, blocks: Iterable[np.ndarray]) -> np.ndarray:
    """A 1-d array of ``n`` values of ``dtype`` written block by block as the ``.npy`` file
    ``directory/name`` (through :func:`spill_file`: whole or absent; numeric, no pickle), read back
    memory-mapped: what stays in memory is one block, not the array. Raises SpillError when it cannot
    be written, or ValueError when the blocks do not hold ``n`` values."""
    dt = np.dtype(dtype)
    if n == 0:
        return np.zeros(0, dt)
    header = {"descr": np.lib.format.dtype_to_descr(dt), "fortran_order": False, "shape": (n,)}
    done = 0
    with spill_file(directory, name, n * dt.itemsize + 128) as f:
        np.lib.format.write_array_header_1_0(f, header)
        for b in blocks:
            b = np.ascontiguousarray(b, dtype=dt)
            f.write(b.tobytes())
            done += len(b)
        if done != n:
            raise ValueError(f"{name}: {done} values written, {n} expected")
    mapped: np.ndarray = np.load(os.path.join(directory, name), mmap_mode="r", allow_pickle=False)
    return mapped


def write_ipc(directory: str, name: str, schema: pa.Schema, batches: Iterable[pa.RecordBatch],
              rows: Optional[int] = None) -> pa.Table:
    """``batches`` written as the Arrow IPC file ``directory/name`` (through :func:`spill_file`:
    whole or absent), memory-mapped back: a table whose buffers are the file's pages. Raises
    SpillError when it cannot be written (``rows``: every row the batches hold, to estimate the
    bytes the whole file needed from those written so far)."""
    import pyarrow as pa

    done = size = 0
    with spill_file(directory, name, 0) as f:
        try:
            with pa.ipc.new_file(pa.PythonFile(f, mode="w"), schema) as writer:
                for b in batches:
                    done += b.num_rows
                    size += b.nbytes
                    writer.write_batch(b)
        except OSError as e:   # the whole file: the bytes per row so far, times every row
            raise spill_error(directory, size * max(rows or done, done) // max(done, 1), e, name) from e
    with pa.memory_map(os.path.join(directory, name)) as src:
        return pa.ipc.open_file(src).read_all()


#: ``.npy`` headers ``read_npz`` parsed, by their bytes: (shape, Fortran order, dtype). A spill file's
#: columns have a few distinct headers (dtype and length), the same in every chunk; parsing one (numpy
#: reads the dict with ``ast.literal_eval``) cost more than mapping the array
_NPY_HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype]] = {}


def read_npz(path: str) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` file ``path`` (as ``np.savez`` writes the spill files: members
    stored uncompressed), as read-only views of the file memory-mapped: file-backed pages, no copy.

    ``np.load`` reads a member by parsing the zip's directory on each open, copying the bytes through
    ``zipfile`` with a CRC over them and copying them again into the array: most of the time of
    reading a spilled chunk back. Here the directory is read once per file and each array is a view
    at its member's offset. A member that is not stored plainly (compressed, or an object array:
    never written here) is read by ``np.load`` (``allow_pickle=False``: no pickle is ever read)."""
    from numpy.lib import format as npformat

    out: dict[str, np.ndarray] = {}
    with open(path, "rb") as f:
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
        size = os.fstat(f.fileno()).st_size
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except (OSError, ValueError):   # a filesystem that cannot map it: every member through np.load
            mm = None
    slow: list[str] = []
    for zi in infos:
        name = zi.filename[:-4] if zi.filename.endswith(".npy") else zi.filename
        h = zi.header_offset
        if mm is None or zi.compress_type != zipfile.ZIP_STORED or mm[h:h + 4] != b"PK\x03\x04":
            slow.append(name)
            continue
        n_name, n_extra = struct.unpack_from("<HH", mm, h + 26)
        start = h + 30 + n_name + n_extra
        # the .npy header: magic, version, its length, then the dict (parsed once per distinct header)
        major = mm[start + 6] if zi.file_size >= 12 else 0
        width = 2 if major == 1 else 4 if major in (2, 3) else 0
        size_h = int.from_bytes(mm[start + 8:start + 8 + width], "little") if width else 0
        end = start + 8 + width + size_h
        header = bytes(mm[start:end]) if width and end <= start + zi.file_size else b""
        parsed = _NPY_HEADERS.get(header) if header else None
        if parsed is None and header:
            head = io.BytesIO(header)
            version = npformat.read_magic(head)
            if version == (1, 0):
                parsed = npformat.read_array_header_1_0(head)
            elif version == (2, 0):
                parsed = npformat.read_array_header_2_0(head)
            if parsed is not None and len(_NPY_HEADERS) < 4096:
                _NPY_HEADERS[header] = parsed
        if parsed is None:
            slow.append(name)
            continue
        shape, fortran, dtype = parsed
        count = 1
        for d in shape:
            count *= d
        if dtype.hasobject or end + count * dtype.itemsize > start + zi.file_size:
            slow.append(name)
            continue
        a = np.frombuffer(mm, dtype=dtype, count=count, offset=end)
        out[name] = a.reshape(shape[::-1]).T if fortran else a.reshape(shape)
    if slow:
        with np.load(path, allow_pickle=False) as z:
            out.update((k, z[k]) for k in slow)
    return out
