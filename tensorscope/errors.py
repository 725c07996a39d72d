"""The exception hierarchy: every error tensorscope raises is a TensorscopeError."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional


class TensorscopeError(Exception):
    """Base class of all tensorscope errors."""


class TraceActiveError(TensorscopeError, RuntimeError):
    """A trace was entered while another one is recording on this thread."""


class SchemaVersionError(TensorscopeError, ValueError):
    """A saved trace was written by a newer, incompatible schema version."""


class TraceFormatError(TensorscopeError, ValueError):
    """A directory is not a tensorscope trace, or a file in it is malformed."""


class ExportError(TensorscopeError, OSError):
    """A trace could not be written; the trace itself is still in memory."""


class OptionsError(TensorscopeError, ValueError):
    """An unknown or invalid trace option: raised before anything runs."""


class GuardError(TensorscopeError, AssertionError):
    """A cell guard (``expect=``, ``max_casts=``, ``baseline=``) failed.

    The block ran to completion; its trace is kept in ``.trace`` and what failed in ``.failures``.

    Examples
    --------
    >>> import torch, tensorscope
    >>> try:
    ...     with tensorscope.trace(expect="no_syncs", leaks=False):
    ...         value = torch.ones(3).sum().item()
    ... except tensorscope.errors.GuardError as err:
    ...     print(err.trace.ops.num_rows > 0)
    True
    """

    def __init__(self, message: str, trace: Any = None, failures: Iterable[Any] = ()) -> None:
        super().__init__(message)
        self.trace = trace
        self.failures = list(failures)


class NativeBuildError(TensorscopeError, RuntimeError):
    """The native extension could not be built or loaded."""


class DivergeInputError(TensorscopeError, ValueError):
    """``diverge()``/``repro()`` was given traces that cannot answer it.

    Schemas of different major versions, no fingerprints (record with ``fingerprints=True``), or a
    row that does not exist.
    """


class SpillError(TensorscopeError, OSError):
    """Spilled rows could not be written to the spill directory (a full disk, a quota, read-only).

    The same for a spill directory that is missing or not writable. Nothing recorded is lost and
    the program ran unchanged: what could not be spilled stayed in memory, so the trace is whole.
    Raised after the traced block (a warning instead when the block raised its own exception,
    which comes first); the finished trace is in ``.trace`` (and ``tensorscope.last()``). The
    message names the directory, the bytes the write needed and the free space the filesystem
    reported; ``.directory``, ``.needed`` and ``.free`` hold them. Give ``spill_dir=`` a directory
    on a disk with room, or raise ``spill_rows=``.
    """

    def __init__(self, message: str, directory: str = "", needed: int = 0, free: Optional[int] = None,
                 trace: Any = None) -> None:
        super().__init__(message)
        self.directory = directory
        self.needed = needed
        self.free = free
        self.trace = trace
