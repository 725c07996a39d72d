"""Storages no root reaches: unreachable cycles, library globals, owners gc cannot see.

One ``gc.get_objects()`` pass finds the Python tensors over them; a batched
``gc.get_referrers`` walk upwards (union-find over groups whose referrers touch)
finds a library module's globals or a frame executing elsewhere; a reference-count
balance tells an unreachable cycle (``gc.collect()`` frees it) from an owner gc cannot
see (``hidden_cpp_owner``).
"""
from __future__ import annotations

import gc
import sys
import types
from array import array
from dataclasses import dataclass
from typing import Any, Optional

from ..._location import format_location
from .classify import _T, _other_threads_frames, _running_frames


# -- the unreached: cycles and owners gc cannot see ----------------------------------------------
def _tensor_types() -> set[type]:
    todo = [_T().Tensor]
    out: set[type] = set()
    while todo:
        tp = todo.pop()
        if tp in out:
            continue
        out.add(tp)
        try:
            todo.extend(tp.__subclasses__())
        except Exception:
            pass
    return out


def _heap_tensors(keep, skip_ids: Optional[dict[int, int]] = None,
                  n_skip: Optional[int] = None) -> tuple[dict[int, Any], dict[int, list[Any]]]:
    """Storages and Python tensors in the whole gc heap, by ``id(storage)``, for keys ``keep(key)`` accepts.

    One ``gc.get_objects()`` pass, filtered at C speed (``compress``/``map``): the tensor types are
    ``torch.Tensor`` and its live subclasses (every class keeps its subclasses), not a type scan.
    Tensors in ``skip_ids`` (the search's nodes) are left out; ``n_skip``, the number of tensors
    among them, spares that filter when the heap has no other tensor.
    """
    from itertools import compress

    tset = _tensor_types()
    objs = gc.get_objects()
    try:
        ts = list(compress(objs, map(tset.__contains__, map(type, objs))))
        if n_skip is not None and n_skip == len(ts):
            ts = []   # the search saw every tensor of the heap (its tensors are distinct heap objects)
        elif skip_ids and ts:   # the search saw those (set arithmetic: usually all of them)
            unseen = set(map(id, ts)).difference(skip_ids)
            ts = list(compress(ts, map(unseen.__contains__, map(id, ts)))) if unseen else []
    finally:
        objs.clear()
        del objs
    storages: dict[int, Any] = {}
    tensors: dict[int, list[Any]] = {}
    try:
        for t in ts:
            try:
                s = t.untyped_storage()
                # device first: a fake tensor's (meta) storage warns when asked for its pointer
                if s.device.type == "meta" or s.data_ptr() == 0:
                    continue
            except Exception:
                continue
            k = id(s)
            if not keep(k):
                continue
            lst = tensors.get(k)
            if lst is None:
                storages[k] = s
                tensors[k] = [t]
            else:
                lst.append(t)
        del s
    except NameError:
        pass
    finally:
        ts.clear()
    return storages, tensors


@dataclass
class _Fallback:
    text: str
    kind: str
    fix: str


_CYCLE_FIX = ("import gc; gc.collect()  (a reference cycle keeps it until the next full collection; break the "
              "cycle, e.g. with weakref, to free it at once)")


_HIDDEN_FIX = ("release the C++ owner (an autograd graph or hook no Python object reaches, torch.jit/extension "
               "state, or a C extension holding the tensor)")


def _module_dicts() -> dict[int, str]:
    out = {}
    for name, mod in list(sys.modules.items()):
        d = getattr(mod, "__dict__", None) if mod is not None else None
        if isinstance(d, dict) and (id(d) not in out or name == "__main__"):
            out[id(d)] = name   # __main__ over its __mp_main__ alias
    return out


def _find(uf: list[int], a: int) -> int:
    while uf[a] != a:
        uf[a] = uf[uf[a]]
        a = uf[a]
    return a


def _internal_counts(members: list[Any], midx: dict[int, int]) -> dict[int, int]:
    internal: dict[int, int] = {}
    for p in members:
        for c in gc.get_referents(p):
            n = midx.get(id(c))
            if n is not None:
                internal[n] = internal.get(n, 0) + 1
    return internal


def _unexplained(members: list[Any], internal: dict[int, int], n: int) -> int:
    # getrefcount's argument and the members list each add one reference; nothing else of ours holds it
    return sys.getrefcount(members[n]) - 2 - internal.get(n, 0)


def _classify_groups(groups: list[list[Any]], ours: set[int], max_levels: int = 6) -> list[_Fallback]:
    """Classify groups of unreached objects (the Python tensors and storage object of one storage each).

    One batched ``gc.get_referrers`` per level for all groups; groups whose referrer closures touch
    are merged (union-find). A closure that reaches a module's globals is a library global, one that
    reaches a frame is a live local, one whose reference counts are all explained by its own edges
    is an unreachable cycle, and anything else has an owner gc cannot see. ``groups`` is consumed.
    """
    G = len(groups)
    uf = list(range(G))
    members: list[Any] = []
    label = array("q")
    is_storage: set[int] = set()
    child: dict[int, int] = {}
    midx: dict[int, int] = {}
    hits: dict[int, tuple[int, str]] = {}
    st_type = _T().UntypedStorage
    ours = set(ours)
    for b in (members, groups):
        ours.add(id(b))
    frames = _running_frames()
    ours.update(id(f) for f in frames)
    frames.clear()
    live_frames = _other_threads_frames()   # executing elsewhere: their locals are live, a real holder
    modd = _module_dicts()
    try:
        for g, grp in enumerate(groups):
            for o in grp:
                n0 = midx.get(id(o))
                if n0 is not None:
                    uf[_find(uf, g)] = _find(uf, label[n0])
                    continue
                midx[id(o)] = len(members)
                if type(o) is st_type or isinstance(o, st_type):
                    is_storage.add(len(members))
                members.append(o)
                label.append(g)
            grp.clear()
        del o, grp
        groups.clear()
        frontier = list(range(len(members)))
        growing: set[int] = set()
        for _level in range(max_levels):
            if not frontier:
                break
            fobjs = [members[n] for n in frontier]
            ours.add(id(fobjs))
            fids = {id(members[n]): n for n in frontier}
            refs = gc.get_referrers(*fobjs)
            fobjs.clear()
            ours.add(id(refs))
            new: list[int] = []
            for r in refs:
                rid = id(r)
                if rid in ours:
                    continue
                kids = [fids[id(c)] for c in gc.get_referents(r) if id(c) in fids]
                if not kids:
                    continue
                n = midx.get(rid)
                if n is not None:
                    for kk in kids:
                        uf[_find(uf, label[n])] = _find(uf, label[kk])
                    continue
                n = len(members)
                midx[rid] = n
                members.append(r)
                label.append(label[kids[0]])
                child[n] = kids[0]
                for kk in kids[1:]:
                    uf[_find(uf, label[n])] = _find(uf, label[kk])
                if rid in modd:
                    hits.setdefault(label[n], (n, "module:" + modd[rid]))
                elif type(r) is types.FrameType and rid in live_frames:
                    hits.setdefault(label[n], (n, "frame"))
                else:
                    new.append(n)
            refs.clear()
            del refs, r
            frontier = new
        growing = {label[n] for n in frontier}
        frontier = []
        # resolve classes
        cls_hits: dict[int, tuple[int, str]] = {}
        for g, h in hits.items():
            cls_hits.setdefault(_find(uf, g), h)
        cls_growing = {_find(uf, g) for g in growing}
        internal = _internal_counts(members, midx)
        cls_external: dict[int, bool] = {}
        cls_size: dict[int, int] = {}
        for n in range(len(members)):
            c = _find(uf, label[n])
            cls_size[c] = cls_size.get(c, 0) + 1
            if n in is_storage:
                continue  # torch preserves a storage's Python object from C++: its count is not ours to balance
            if _unexplained(members, internal, n) > 0:
                cls_external[c] = True
        out: list[_Fallback] = []
        for g in range(G):
            c = _find(uf, g)
            if c in cls_hits:
                n, what = cls_hits[c]
                out.append(_hit_text(members, child, n, what))
            elif c in cls_growing:
                out.append(_Fallback(f"held outside the searched roots (via {_type_label(members[_top(label, uf, c)])})",
                                     "unknown", "look for a library cache or a framework object holding it"))
            elif not cls_external.get(c) and cls_size.get(c, 0) > 1 and _has_python_holder(members, is_storage, uf,
                                                                                               label, c):
                top = members[_top(label, uf, c)]
                out.append(_Fallback(f"unreachable reference cycle through {_type_label(top)}", "cycle", _CYCLE_FIX))
            elif cls_size.get(c, 0) <= sum(1 for n in is_storage if _find(uf, label[n]) == c) and \
                    not cls_external.get(c):
                out.append(_Fallback("no Python path: only C++ holds it (no Python object refers to this storage)",
                                     "hidden_cpp_owner", _HIDDEN_FIX))
            else:
                top = members[_top(label, uf, c)]
                out.append(_Fallback(f"no Python path: held by an owner gc cannot see (via {_type_label(top)})",
                                     "hidden_cpp_owner", _HIDDEN_FIX))
        return out
    finally:
        members.clear()
        midx.clear()
        child.clear()


def _has_python_holder(members, is_storage, uf, label, c) -> bool:
    return any(n not in is_storage for n in range(len(members)) if _find(uf, label[n]) == c)


def _top(label, uf, c) -> int:
    last = 0
    for n in range(len(label)):
        if _find(uf, label[n]) == c:
            last = n
    return last


def _hit_text(members, child, n, what) -> _Fallback:
    r = members[n]
    c = child.get(n)
    if what.startswith("module:"):
        modname = what.split(":", 1)[1]
        nm = "?"
        if c is not None:
            for k, v in list(r.items()):
                if v is members[c]:
                    nm = str(k)
                    break
        return _Fallback(f"global {modname}.{nm} (library module)", "global", f"del {modname}.{nm}")
    co = r.f_code
    return _Fallback(f"local in {co.co_name}() ({format_location(co.co_filename, r.f_lineno)})", "local",
                     f"del the local in {co.co_name}() or return from it")


def _type_label(o) -> str:
    tp = type(o)
    mod = getattr(tp, "__module__", "")
    name = getattr(tp, "__qualname__", tp.__name__)
    return name if mod in ("builtins", "__main__") else f"{mod}.{name}"
