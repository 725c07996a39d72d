"""Growth: a holder that keeps more memory cell after cell (or step after step within one cell).

The canonical case is ``losses.append(loss)`` in a training loop: each cell (with
``%tensorscope on``) or each step of a loop in one cell leaves one more autograd graph
in ``losses``. A single trace sees only the storages it created, so growth across
cells is remembered here, tensor-free: per holder root (``global losses``) weak
references to the storages charged to it, and the streak of consecutive traces in
which it gained bytes *while keeping what it held before* (``loss = …`` rebinding a
global each cell gains bytes too, but frees the old ones: that is not growth). What it held before
is checked, not assumed: the old storages still alive are searched for again with the
next trace's storages (``probes``), and count as kept only when the same holder still
reaches them (``loss = …`` each cell with the old loss appended to ``losses``: the old one
is alive, but ``losses`` holds it, not ``loss``). Streaks are per holder root *and* holder
kind, so a list's graphs and its scalar elements each carry their own number. A
holder is ``growing`` once that happened in two traces in a row (bytes per cell: the
mean gain over the streak). Within
one trace, a holder whose container gained three or more elements (graphs, or the
elements themselves) is growing too (however it was before), and its
``growth_bytes_per_cell`` is then per loop step (its bytes over the elements).
"""
from __future__ import annotations

import re
import weakref
from typing import Any, Callable, Optional

#: (root label, holder kind) -> (consecutive traces that gained bytes and kept the old, bytes gained over them)
_STREAKS: dict[tuple[str, str], tuple[int, int]] = {}
#: (root label, holder kind) -> weak references to the storages charged to it (they never keep memory alive)
_HELD: dict[tuple[str, str], list[Any]] = {}
_MAX_ROOTS = 10_000
_MAX_REFS = 100_000
#: old storages per holder searched for again (the newest: a holder that keeps what it held keeps these)
PROBES_PER_HOLDER = 16
#: holders whose storages a name binds itself (``global loss``): a name holds one object, so rebinding it
#: never keeps the old one (a graph it keeps is an ``autograd_graph`` holder, reached through the tensor)
_DIRECT: set[tuple[str, str]] = set()
MIN_STREAK = 2
MIN_STEPS = 3

_INDEX = re.compile(r"\[(\d+)\]")


def probes() -> dict[int, Any]:
    """id(storage) -> storage: the newest old storages of each holder still alive, to search for with the
    next trace's (the caller drops them when the search is done)."""
    out: dict[int, Any] = {}
    for key, refs in _HELD.items():
        if key in _DIRECT:
            continue   # cannot keep what it held: nothing to search for
        for w in refs[-PROBES_PER_HOLDER:]:
            s = w()
            if s is not None:
                out[id(s)] = s
            del s
    return out


def observe(rows, storage_of: Callable[[int], Any] = lambda ptr: None,
            held_by: Optional[Callable[[Any], Optional[set]]] = None) -> None:
    """Mark ``rows`` (one trace's leak rows, a ``rowset._RowSet``) growing where their holder grows, and
    remember this trace's storages (weakly) for the next one. ``storage_of(data_ptr)`` is the row's
    live storage; ``held_by(storage)`` the root labels that reach an old storage now (from the search of
    ``probes``; None: unknown, then alive counts as kept). State (``expected``) rows never grow."""
    c = rows.cols
    expected, roots, nbytes, kinds, holders, ptrs = (c["expected"], c["root_label"], c["nbytes"], c["holder_kind"],
                                                     c["holder"], c["data_ptr"])
    gained: dict[tuple[str, str], int] = {}
    elements: dict[tuple[str, str], set] = {}
    new_refs: dict[tuple[str, str], list[Any]] = {}
    direct: dict[tuple[str, str], bool] = {}
    for i in range(len(rows)):
        root = roots[i]
        if expected[i] or not root:
            continue
        key = (root, kinds[i])
        direct[key] = direct.get(key, True) and holders[i].split("; also ", 1)[0] == root
        gained[key] = gained.get(key, 0) + (nbytes[i] or 0)
        s = storage_of(ptrs[i])
        if s is not None:
            try:
                new_refs.setdefault(key, []).append(weakref.ref(s))
            except TypeError:
                pass
        del s
        if kinds[i] in ("autograd_graph", "global", "local"):
            k = _element(holders[i], root)
            if k is not None:
                elements.setdefault(key, set()).add(k)
    old_streaks, old_held, old_direct = dict(_STREAKS), dict(_HELD), set(_DIRECT)
    _STREAKS.clear()
    _HELD.clear()
    _DIRECT.clear()
    for key, nb in gained.items():
        if len(_STREAKS) >= _MAX_ROOTS:
            break
        kept = [] if key in old_direct or direct[key] else \
            [w for w in old_held.get(key, ()) if _still_held(w, key[0], held_by)]
        if direct[key]:
            _DIRECT.add(key)
        n, total = old_streaks.get(key, (0, 0)) if kept else (0, 0)
        _STREAKS[key] = (n + 1, total + nb)
        _HELD[key] = (kept + new_refs.get(key, []))[-_MAX_REFS:]
    growing, per_row = c["growing"], c["growth_bytes_per_cell"]
    for i in range(len(rows)):
        root = roots[i]
        if expected[i] or not root:
            continue
        key = (root, kinds[i])
        items = elements.get(key)
        # a loop in this cell: bytes per step; else per cell
        per: Optional[int] = gained[key] // len(items) if items is not None and len(items) >= MIN_STEPS \
            else per_cell(root, kinds[i])
        if per is not None:
            growing[i], per_row[i] = True, int(per)


def _still_held(w, root: str, held_by) -> bool:
    s = w()
    if s is None:
        return False
    if held_by is None:
        return True
    roots = held_by(s)
    return roots is None or root in roots


def per_cell(root_label: str, kind: Optional[str] = None) -> Optional[int]:
    """Mean bytes per cell a holder (root, and kind: a list's graphs and its elements are two holders)
    gained over its current streak, if it is growing across cells."""
    if kind is None:
        sts = [v for (r, _k), v in _STREAKS.items() if r == root_label and v[0] >= MIN_STREAK]
        return sum(v[1] // v[0] for v in sts) if sts else None
    st = _STREAKS.get((root_label, kind))
    if st is None or st[0] < MIN_STREAK:
        return None
    return st[1] // st[0]


def reset() -> None:
    _STREAKS.clear()
    _HELD.clear()
    _DIRECT.clear()


def _element(holder: str, root_label: str) -> Optional[int]:
    """``global losses[3] → grad_fn …`` under root ``global losses`` → 3."""
    if not holder.startswith(root_label):
        return None
    m = _INDEX.match(holder, len(root_label))
    return int(m.group(1)) if m else None
