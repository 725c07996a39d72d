"""The known-storage registry: storages traces and cell-boundary discovery saw being made.

Tensor-free: each entry is plain metadata and a weak reference to the storage, dropped
by the weak reference's callback, so ``find_leaks`` can name the op, cell and line of a
storage without keeping it alive.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional


# -- the known-storage registry (tensor-free) ----------------------------------------------------
@dataclass
class _Known:
    ref: Any
    data_ptr: int
    nbytes: int
    device: str
    dtype: Optional[str]
    shape: Optional[tuple[int, ...]]
    alloc_seq: Optional[int]
    alloc_op: Optional[str]
    cell: Optional[int]
    source_file: Optional[str]
    source_line: Optional[int]
    storage_id: Optional[int]
    traced: bool


_KNOWN: dict[int, _Known] = {}


def _forget(key: int, entry: _Known):
    def cb(_r, key=key, entry=entry):
        # only drop our own entry: the id may already belong to a newer storage
        if _KNOWN.get(key) is entry:
            del _KNOWN[key]
    return cb


def _register(s, entry_fields: dict, *, traced: bool) -> bool:
    key = id(s)
    old = _KNOWN.get(key)
    if old is not None and (old.traced or not traced) and old.ref() is s:
        return False
    entry = _Known(ref=None, traced=traced, **entry_fields)
    try:
        entry.ref = weakref.ref(s, _forget(key, entry))
    except TypeError:
        return False
    _KNOWN[key] = entry
    return True


def remember(live: Sequence[Any]) -> int:
    """Keep (weakly) the storages a trace saw alive at its end, so ``find_leaks`` can name their op/line.

    ``live`` is the storage tracker's list of ``LiveStorage`` records. Returns how many were added.
    """
    n = 0
    for rec in live:
        try:
            s = rec.ref()
        except Exception:
            s = None
        if s is None:
            continue
        n += _register(s, dict(
            data_ptr=rec.data_ptr, nbytes=rec.nbytes, device=rec.device, dtype=rec.dtype,
            shape=tuple(rec.shape) if rec.shape is not None else None, alloc_seq=rec.alloc_seq,
            alloc_op=rec.alloc_op, cell=rec.cell, source_file=rec.source_file, source_line=rec.source_line,
            storage_id=rec.storage_id), traced=True)
        del s
    return n


def known_storages() -> int:
    """How many storages the registry watches (alive ones)."""
    return sum(1 for e in list(_KNOWN.values()) if e.ref() is not None)


def _meta_from_known(k: Optional[_Known], s, dev, dt, shape) -> dict:
    try:
        nb = int(s.nbytes())
        ptr = int(s.data_ptr())
    except Exception:
        nb, ptr = 0, 0
    if k is not None and k.ref() is s:
        return dict(storage_id=k.storage_id, nbytes=nb, device=k.device or dev, dtype=k.dtype or dt,
                    shape=k.shape or shape, alloc_seq=k.alloc_seq, alloc_op=k.alloc_op, cell=k.cell,
                    source_file=k.source_file, source_line=k.source_line, data_ptr=ptr)
    return dict(storage_id=None, nbytes=nb, device=dev, dtype=dt, shape=shape, alloc_seq=None, alloc_op=None,
                cell=None, source_file=None, source_line=None, data_ptr=ptr)
