"""Growth: a holder that keeps more memory cell after cell (or step after step within one cell).

The canonical case is ``losses.append(loss)`` in a training loop: each cell (with
``%tensorscope on``) or each step of a loop in one cell leaves one more autograd graph
in ``losses``. A single trace sees only the storages it created, so growth across
cells is remembered here, tensor-free: per holder root (``global losses``) weak
references to the storages charged to it, and the streak of consecutive traces in
which it gained bytes *while keeping what it held before* (``loss = …`` rebinding a
global each cell gains bytes too, but frees the old ones: that is not growth). A
holder is ``growing`` once that happened in two traces in a row (bytes per cell: the
mean gain over the streak). Within
one trace, an autograd-graph holder whose container gained three or more elements is
growing too (however it was before), and its ``growth_bytes_per_cell`` is then per loop
step (its bytes over the elements).
"""
from __future__ import annotations

import re
import weakref
from typing import Any, Callable, Optional

#: root label -> (consecutive traces that gained bytes and kept the old, bytes gained over them)
_STREAKS: dict[str, tuple[int, int]] = {}
#: root label -> weak references to the storages charged to it (they never keep memory alive)
_HELD: dict[str, list[Any]] = {}
_MAX_ROOTS = 10_000
_MAX_REFS = 100_000
MIN_STREAK = 2
MIN_STEPS = 3

_INDEX = re.compile(r"\[(\d+)\]")


def observe(rows, storage_of: Callable[[int], Any] = lambda ptr: None) -> None:
    """Mark ``rows`` (one trace's leak rows, a ``rowset._RowSet``) growing where their holder grows, and
    remember this trace's storages (weakly) for the next one. ``storage_of(data_ptr)`` is the row's
    live storage. State (``expected``) rows never grow."""
    c = rows.cols
    expected, roots, nbytes, kinds, holders, ptrs = (c["expected"], c["root_label"], c["nbytes"], c["holder_kind"],
                                                     c["holder"], c["data_ptr"])
    gained: dict[str, int] = {}
    elements: dict[str, set] = {}
    new_refs: dict[str, list[Any]] = {}
    for i in range(len(rows)):
        root = roots[i]
        if expected[i] or not root:
            continue
        gained[root] = gained.get(root, 0) + (nbytes[i] or 0)
        s = storage_of(ptrs[i])
        if s is not None:
            try:
                new_refs.setdefault(root, []).append(weakref.ref(s))
            except TypeError:
                pass
        del s
        if kinds[i] == "autograd_graph":
            k = _element(holders[i], root)
            if k is not None:
                elements.setdefault(root, set()).add(k)
    old_streaks, old_held = dict(_STREAKS), dict(_HELD)
    _STREAKS.clear()
    _HELD.clear()
    for root, nb in gained.items():
        if len(_STREAKS) >= _MAX_ROOTS:
            break
        kept = [w for w in old_held.get(root, ()) if w() is not None]
        n, total = old_streaks.get(root, (0, 0)) if kept else (0, 0)
        _STREAKS[root] = (n + 1, total + nb)
        _HELD[root] = (kept + new_refs.get(root, []))[-_MAX_REFS:]
    growing, per_row = c["growing"], c["growth_bytes_per_cell"]
    for i in range(len(rows)):
        root = roots[i]
        if expected[i] or not root:
            continue
        items = elements.get(root)
        # a loop in this cell: bytes per step; else per cell
        per: Optional[int] = gained[root] // len(items) if items is not None and len(items) >= MIN_STEPS \
            else per_cell(root)
        if per is not None:
            growing[i], per_row[i] = True, int(per)


def per_cell(root_label: str) -> Optional[int]:
    """Mean bytes per cell a holder gained over its current streak, if it is growing across cells."""
    st = _STREAKS.get(root_label)
    if st is None or st[0] < MIN_STREAK:
        return None
    return st[1] // st[0]


def reset() -> None:
    _STREAKS.clear()
    _HELD.clear()


def _element(holder: str, root_label: str) -> Optional[int]:
    """``global losses[3] → grad_fn …`` under root ``global losses`` → 3."""
    if not holder.startswith(root_label):
        return None
    m = _INDEX.match(holder, len(root_label))
    return int(m.group(1)) if m else None
