"""Growth: a holder that keeps more memory cell after cell (or step after step within one cell).

The canonical case is ``losses.append(loss)`` in a training loop: each cell (with
``%tensorscope on``) or each step of a loop in one cell leaves one more autograd graph
in ``losses``. A single trace sees only the storages it created, so growth across
cells is remembered here, tensor-free: per holder root (``global losses``) the streak
of consecutive traces in which it gained bytes. A holder is ``growing`` once it gained
bytes in two traces in a row (bytes per cell: the mean gain over the streak). Within
one trace, an autograd-graph holder whose container gained three or more elements is
growing too, and its ``growth_bytes_per_cell`` is then per loop step (its bytes over the elements).
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

#: root label -> (consecutive traces that gained bytes, bytes gained over them)
_STREAKS: Dict[str, Tuple[int, int]] = {}
_MAX_ROOTS = 10_000
MIN_STREAK = 2
MIN_STEPS = 3

_INDEX = re.compile(r"\[(\d+)\]")


def observe(rows: List) -> None:
    """Mark ``rows`` (one trace's leak rows, ``_Row``) growing where their holder grows, and remember
    this trace's gains for the next one. State (``expected``) rows never grow."""
    gained: Dict[str, int] = {}
    elements: Dict[str, set] = {}
    for r in rows:
        if r.expected or not r.root_label:
            continue
        gained[r.root_label] = gained.get(r.root_label, 0) + (r.nbytes or 0)
        if r.holder_kind == "autograd_graph":
            i = _element(r.holder, r.root_label)
            if i is not None:
                elements.setdefault(r.root_label, set()).add(i)
    old = dict(_STREAKS)
    _STREAKS.clear()
    for root, nb in gained.items():
        n, total = old.get(root, (0, 0))
        _STREAKS[root] = (n + 1, total + nb)
        if len(_STREAKS) >= _MAX_ROOTS:
            break
    for r in rows:
        if r.expected or not r.root_label:
            continue
        items = elements.get(r.root_label)
        if items is not None and len(items) >= MIN_STEPS:   # a loop in this cell: bytes per step
            per = gained[r.root_label] // len(items)
        else:
            per = per_cell(r.root_label)
        if per is not None:
            r.growing, r.growth_bytes_per_cell = True, int(per)


def per_cell(root_label: str) -> Optional[int]:
    """Mean bytes per cell a holder gained over its current streak, if it is growing across cells."""
    st = _STREAKS.get(root_label)
    if st is None or st[0] < MIN_STREAK:
        return None
    return st[1] // st[0]


def reset() -> None:
    _STREAKS.clear()


def _element(holder: str, root_label: str) -> Optional[int]:
    """``global losses[3] → grad_fn …`` under root ``global losses`` → 3."""
    if not holder.startswith(root_label):
        return None
    m = _INDEX.match(holder, len(root_label))
    return int(m.group(1)) if m else None
