"""One leak row at a time: the holders of a storage the search reached, or of one it did not.

``_row_generic`` names the main path to a storage, the other roots and holders that reach it
(so the fix releases all of them) and makes its ``_Row`` (``_make_row``: the recorded creation
site when a trace or discovery saw it made). ``_fallback_rows`` makes the rows of storages no
root reached, as ``unreached`` classifies them. The many plain tensors of one container take
``bulk`` instead.
"""
from __future__ import annotations

from typing import Any, Optional

from .classify import _TENSOR, _dev_str, _tensor_meta, _types
from .known import _KNOWN, _meta_from_known
from .paths import STATE_KINDS, _Describer, _merge_fixes, _Steps
from .rowset import _Row
from .search import _Search
from .unreached import _classify_groups


def _view_of(t, s) -> Optional[tuple[int, int]]:
    """(view bytes, storage bytes) when a tensor is a small window on a big storage."""
    if _types.get(type(t)) != _TENSOR:
        return None
    try:
        vb = t.nbytes
        sb = s.nbytes()
    except Exception:
        return None
    return (vb, sb) if vb * 2 < sb else None


def _below(search: _Search, n: int, top: int) -> bool:
    while n >= 0:
        if n == top:
            return True
        n = search.par[n]
    return False


def _holders(search: _Search, desc: _Describer, key: int) -> tuple[_Steps, str, str]:
    """(main description, holder text, complete fix) for a storage the search reached."""
    nodes = search.found[key]
    j = nodes[0]
    main = desc.describe(j, _view_of(search.order[j], search.storages[key]))
    extra_text: list[str] = []
    fixes = [main.fix]
    cross = search.cross
    if cross:
        # roots that also reach the path at or below the cut: the fix must name them too
        others: set[int] = set()
        k, pos = j, desc.state(j).pos
        while k >= 0 and pos >= main.cut:
            c = cross.get(k)
            if c:
                others |= c
            k = search.par[k]
            pos -= 1
        for r in sorted(others):
            root = search.roots[r]
            if root.label != main.root_label:
                extra_text.append(root.label)
                fixes.append(root.fix)
    for n in nodes[1:]:
        if _below(search, n, nodes[0]):
            continue  # reached through the main holder (a view's ._base): the main fix covers it
        st = desc.describe(n)
        if st.text not in extra_text and st.text != main.text:
            extra_text.append(st.text)
            fixes.append(st.fix)
    text = main.text
    if extra_text:
        shown = extra_text[:3]
        more = f" (+{len(extra_text) - 3} more)" if len(extra_text) > 3 else ""
        text += "; also " + "; ".join(shown) + more
    if main.kind in STATE_KINDS:
        # model/optimizer state stays alive with its owner whatever else also reaches it (a graph that saved
        # a weight): releasing the others frees nothing, so their fixes are not this row's
        return main, text, main.fix
    return main, text, (_merge_fixes(fixes) if len(fixes) > 1 else main.fix)


def _row_generic(search: _Search, desc: _Describer, key: int, key_meta: dict[int, dict]) -> _Row:
    s = search.storages[key]
    try:
        main, text, fix = _holders(search, desc, key)
        kind, root_label, root_fix = main.kind, main.root_label, main.root_fix
    except Exception as e:  # a path we cannot render must not hide the storage
        text, kind, fix = f"(path unavailable: {type(e).__name__}: {e})", "unknown", ""
        root_label, root_fix = text, ""
    return _make_row(search, key, s, key_meta.get(key), text, kind, fix, root_label, root_fix)


def _make_row(search, key, s, meta, text, kind, fix, root_label, root_fix) -> _Row:
    if meta is None:
        first = search.order[search.found[key][0]]
        dev, dt, shape = _tensor_meta(first) if _types.get(type(first)) == _TENSOR else (_dev_str(s), None, None)
        k = _KNOWN.get(key)
        if k is not None and k.ref() is s:
            meta = _meta_from_known(k, s, dev, dt, shape)
        else:
            return _Row.plain(text, kind, fix, root_label, root_fix, s.nbytes(), s.data_ptr(), dev, dt, shape)
    row = _Row(text, kind, fix, root_label, root_fix, meta)
    _own_shape(row, search.order[search.found[key][0]])
    return row


def _own_shape(row: _Row, t) -> None:
    """The storage's own shape: the holding tensor's when it spans the whole storage. The recorded
    shape is the allocating op's output, which can be another view of it (a bias ``.grad`` made
    as ``[1, 256]`` and kept as ``(256,)``)."""
    if _types.get(type(t)) != _TENSOR:
        return
    try:
        if t.nbytes == row.nbytes and t.storage_offset() == 0:
            row.shape = tuple(t.shape)
    except Exception:
        pass


def _fallback_rows(storages: dict[int, Any], tensors: dict[int, list[Any]], key_meta: dict[int, dict],
                   ours: set[int]) -> list[_Row]:
    """Rows for storages no root reached; ``storages``/``tensors`` (from ``_heap_tensors``) are consumed."""
    rows: list[_Row] = []
    if not storages:
        return rows
    keys = list(storages)
    metas = []
    groups: list[list[Any]] = []
    for key in keys:
        ts = tensors.pop(key, None) or []
        s = storages[key]
        meta = key_meta.get(key)
        if meta is None:
            dev, dt, shape = _tensor_meta(ts[0]) if ts else (str(s.device), None, None)
            meta = _meta_from_known(_KNOWN.get(key), s, dev, dt, shape)
        metas.append(meta)
        ts.append(s)
        groups.append(ts)
        del ts, s
    storages.clear()
    tensors.clear()
    fbs = _classify_groups(groups, ours | {id(storages), id(tensors), id(keys)})
    for meta, fb in zip(metas, fbs):
        rows.append(_Row(fb.text, fb.kind, fb.fix, fb.text, fb.fix, meta))
    return rows
