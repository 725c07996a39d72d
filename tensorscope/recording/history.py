"""The traces this process remembers: ``tensorscope.last()`` and ``tensorscope.history()``."""
from __future__ import annotations

from typing import Any, List

_last = None
_history: List[Any] = []
_HISTORY_MAX = 64


def last():
    """The most recent Trace of this process (``%%tensorscope`` and ``trace()`` set it)."""
    return _last


def history() -> List[Any]:
    """Traces kept by ``%tensorscope on`` and ``%%tensorscope``, oldest first (at most 64)."""
    return list(_history)


def _remember(t, keep_history: bool):
    global _last
    _last = t
    if keep_history:
        _history.append(t)
        del _history[:-_HISTORY_MAX]
