"""The traces this process remembers: ``tensorscope.last()`` and ``tensorscope.history()``.

``history()`` (filled by ``%tensorscope on`` and ``%%tensorscope``) is bounded twice:
at most ``max_traces`` traces (64) and at most ``max_bytes`` of their tables (1 GiB;
``TENSORSCOPE_HISTORY_BYTES`` or ``set_history_limits``), since one long traced cell can
hold gigabytes. The oldest trace falls out first, never the newest, and says so in one
line on stderr, with the ``tensorscope.load(...)`` call that reads it back when it was
saved. Nothing here holds a tensor: a Trace is tables and metadata.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

from .._common import fmt_bytes

# Traces are typed Any here: the recording layer sits below the Trace class (tensorscope._trace)
_last: Any = None
_history: list[Any] = []
_sizes: list[int] = []
_HISTORY_MAX = 64


def _env_bytes() -> int:
    try:
        return int(os.environ.get("TENSORSCOPE_HISTORY_BYTES", ""))
    except ValueError:
        return 1 << 30


_HISTORY_MAX_BYTES = _env_bytes()


def last() -> Any:
    """The most recent Trace of this process (``%%tensorscope`` and ``trace()`` set it)."""
    return _last


def history() -> list[Any]:
    """Traces kept by ``%tensorscope on`` and ``%%tensorscope``, oldest first (at most 64 traces and
    1 GiB of tables by default: ``set_history_limits``)."""
    return list(_history)


def set_history_limits(max_traces: Optional[int] = None, max_bytes: Optional[int] = None) -> None:
    """Bound ``history()``: at most ``max_traces`` traces and ``max_bytes`` bytes of tables (the newest
    trace is always kept). Traces beyond the new limits fall out now, oldest first."""
    global _HISTORY_MAX, _HISTORY_MAX_BYTES
    if max_traces is not None:
        if int(max_traces) < 1:
            raise ValueError("max_traces must be at least 1")
        _HISTORY_MAX = int(max_traces)
    if max_bytes is not None:
        if int(max_bytes) < 0:
            raise ValueError("max_bytes must be >= 0")
        _HISTORY_MAX_BYTES = int(max_bytes)
    _evict()


def trace_nbytes(t: Any) -> int:
    """Bytes of the tables a Trace holds (Arrow buffers; a spilled, memory-mapped ops table counts too)."""
    total = 0
    for tab in getattr(t, "_tables", {}).values():
        try:
            total += tab.get_total_buffer_size()
        except Exception:
            pass   # a deferred table (pending kernels) is small until resolved
    return total


def _remember(t: Any, keep_history: bool) -> None:
    global _last
    _last = t
    if keep_history:
        _history.append(t)
        _sizes.append(trace_nbytes(t))
        _evict()


def _evict() -> None:
    while len(_history) > 1 and (len(_history) > _HISTORY_MAX or sum(_sizes) > _HISTORY_MAX_BYTES):
        old, nb = _history.pop(0), _sizes.pop(0)
        _say_dropped(old, nb, "traces" if len(_history) >= _HISTORY_MAX else "bytes")


def _say_dropped(t: Any, nbytes: int, why: str) -> None:
    md = getattr(t, "metadata", None) or {}
    cell = md.get("cell")
    what = f"the trace of cell [{cell}]" if cell is not None else "the oldest trace"
    limit = (f"{_HISTORY_MAX} traces" if why == "traces" else f"{fmt_bytes(_HISTORY_MAX_BYTES)} of traces")
    saved = getattr(t, "saved_to", None) or md.get("saved_to")   # a Trace says where it is kept
    again = (f"it was saved: tensorscope.load({saved!r}) reads it back" if saved
             else "--save PATH keeps a trace on disk")
    print(f"tensorscope: history() keeps at most {limit}: dropped {what} ({fmt_bytes(nbytes)}); {again}",
          file=sys.stderr)
