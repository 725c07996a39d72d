"""Edge labels: how a referrer holds its referent (``attr``, ``key``, ``index``, ``cell``, ...) and the
expression that follows one edge (``_apply_expr``). Computed lazily, only along the paths a leak report
shows; holders.py/paths.py turn a chain of them into the holder's path text and fix.
"""
from __future__ import annotations

import gc
import re
import types
from operator import itemgetter
from typing import Any, Optional, Protocol

from ..._location import format_location
from .classify import _PY313, _TENSOR, _live_frame_locals, _running_frames, _types
from .search import _Search


class _Describes(Protocol):
    """What a label needs of the path describer (paths._Describer): the path state of node ``j``."""

    def state(self, j: int) -> Any: ...


def _short_repr(k, n=40) -> str:
    try:
        r = repr(k)
    except Exception:
        r = f"<{type(k).__name__}>"
    return r if len(r) <= n else r[: n - 1] + "…"


#: objects _build does not label as an instance with a ``__dict__`` (none of the exact types can be subclassed)
_NOT_INSTANCE = (dict, list, tuple, set, frozenset, type, types.CellType, types.TracebackType, types.FrameType,
                 types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType, types.MethodType,
                 types.FunctionType)
_INSTDICT = ("instdict", "")


def _instance_dict(o):
    try:
        d = object.__getattribute__(o, "__dict__")
    except Exception:
        return None
    return d if isinstance(d, dict) else None


class _Labeler:
    """Edge labels (kind, text) between a parent and a child; caches reverse maps per parent."""

    def __init__(self, search: _Search):
        self.s = search
        self.cache: dict[int, dict[int, tuple[str, str]]] = {}
        self.describer: Optional[_Describes] = None
        self._keying: set[int] = set()
        self._peeked: set[int] = set()   # dicts whose first asked child was found without a map

    def label(self, j: int) -> tuple[str, str]:
        s = self.s
        lab = s.synth.get(j)
        if lab is not None:
            return lab
        p = s.par[j]
        m = self.cache.get(p)
        if m is None:
            o = s.order[p]
            child = s.order[j]
            if not isinstance(o, _NOT_INSTANCE) and _instance_dict(o) is child:
                # an instance (a module) is entered through its __dict__, whose label _build puts
                # first: no map of every attribute for it
                return _INSTDICT
            if isinstance(o, dict) and p not in self._peeked:
                # the first child asked of a dict (a module's __dict__, its _parameters): found by
                # identity among the values; a map only when a second child is asked
                self._peeked.add(p)
                lab = self._dict_label(p, o, child)
                if lab is not None:
                    return lab
            m = self.labels(p)
        lab = m.get(id(s.order[j]))
        return lab if lab is not None else ("obj", type(s.order[j]).__name__)

    def _dict_label(self, p: int, o: dict, child) -> Optional[tuple[str, str]]:
        """The label ``_build`` gives ``child`` of dict ``o``, found without a map: the first key
        whose value it is, when that key and every one before it is a string (never a holder, named
        without side effects: a tensor key is named by its own path). None: ask ``_build``."""
        try:
            items = list(o.items())
            n = list(map(id, map(itemgetter(1), items))).index(id(child))
        except ValueError:
            return None
        if set(map(type, map(itemgetter(0), items[:n + 1]))) != {str}:
            return None
        k = items[n][0]
        s = self.s
        gp = s.order[s.par[p]] if s.par[p] >= 0 else None
        if gp is not None and (_instance_dict(gp) is o or isinstance(gp, type)):
            return ("attr", k)
        return ("key", _short_repr(k))

    def labels(self, p: int) -> dict[int, tuple[str, str]]:
        """id(child) -> label of every child of node ``p`` (built once)."""
        m = self.cache.get(p)
        if m is None:
            self.cache[p] = {}  # re-entry (a tensor key's own path) sees no labels rather than recursing
            m = self._build(p)
            self.cache[p] = m
        return m

    def _build(self, p: int) -> dict[int, tuple[str, str]]:
        s = self.s
        o = s.order[p]
        gp = s.order[s.par[p]] if s.par[p] >= 0 else None
        m: dict[int, tuple[str, str]] = {}
        try:
            if isinstance(o, dict):
                as_attrs = gp is not None and _instance_dict(gp) is o
                cls_dict = gp is not None and isinstance(gp, type)
                for k, v in list(o.items()):
                    if as_attrs or cls_dict:
                        m.setdefault(id(v), ("attr", str(k)))
                        continue
                    kt = self._key_text(k)
                    m.setdefault(id(v), ("key", kt))
                    if gc.is_tracked(k):  # only a container or tensor key can be on a path
                        m.setdefault(id(k), ("dictkey", kt))
            elif isinstance(o, (list, tuple)):
                is_closure = gp is not None and type(gp) is types.FunctionType and gp.__closure__ is o
                for n, v in enumerate(o):
                    if is_closure:
                        names = gp.__code__.co_freevars  # type: ignore[union-attr]  # is_closure: gp is a function
                        m.setdefault(id(v), ("closure", names[n] if n < len(names) else str(n)))
                    else:
                        m.setdefault(id(v), ("index", str(n)))
            elif isinstance(o, (set, frozenset)):
                for v in o:
                    m.setdefault(id(v), ("obj", "{…}"))
            elif type(o) is types.CellType:
                try:
                    m[id(o.cell_contents)] = ("cell", "")
                except ValueError:
                    pass
            elif type(o) is types.TracebackType:
                m[id(o.tb_next)] = ("tbnext", "")
                co = o.tb_frame.f_code
                m[id(o.tb_frame)] = ("frame", f"{co.co_name}() ({format_location(co.co_filename, o.tb_lineno)})")
            elif type(o) is types.FrameType:
                for name, v in self._frame_locals(o):
                    m.setdefault(id(v), ("local", name))
            elif type(o) in (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType):
                fr = getattr(o, "gi_frame", None) or getattr(o, "cr_frame", None) or getattr(o, "ag_frame", None)
                if fr is not None:
                    for name, v in self._frame_locals(fr, suspended=True):
                        m.setdefault(id(v), ("genlocal", name))
                for v in gc.get_referents(o):
                    m.setdefault(id(v), ("genlocal", ""))
            elif isinstance(o, type):
                for d in gc.get_referents(o):
                    if type(d) is dict:
                        m[id(d)] = ("instdict", "")
            elif type(o) is types.MethodType:
                m[id(o.__self__)] = ("attr", "__self__")
                m[id(o.__func__)] = ("attr", "__func__")
            elif type(o) is types.FunctionType:
                for attr in ("__closure__", "__defaults__", "__kwdefaults__", "__dict__"):
                    v = getattr(o, attr, None)
                    if v is not None:
                        m[id(v)] = ("fnpart", attr)
            else:
                d = _instance_dict(o)
                if d is not None:
                    m[id(d)] = ("instdict", "")
                    for k, v in list(d.items()):
                        m.setdefault(id(v), ("attr", str(k)))
                for cls in type(o).__mro__:
                    for slot in cls.__dict__.get("__slots__", ()) if isinstance(cls.__dict__.get("__slots__", ()), (tuple, list)) else ():
                        try:
                            m.setdefault(id(object.__getattribute__(o, slot)), ("attr", slot))
                        except Exception:
                            pass
        except Exception:
            pass
        return m

    def _frame_locals(self, fr, suspended: bool = False):
        """(name, value) of a frame's locals, without leaving a snapshot dict on a live frame."""
        if not _PY313:
            # f_locals on a frame that will run again (3.11/3.12) caches a dict that keeps locals
            # alive after the function deletes them: a suspended generator's is never read, a
            # running frame's is read and its cache emptied again (_live_frame_locals)
            if suspended:
                return []
            if fr in _running_frames():
                return _live_frame_locals(fr)
        try:
            return list(fr.f_locals.items())
        except Exception:
            return []

    def _key_text(self, k) -> str:
        h = _types.get(type(k))
        if h == _TENSOR:
            j = self.s.idx.get(id(k))
            d = self.describer
            if j is not None and d is not None and j not in self._keying:
                self._keying.add(j)
                try:
                    e = d.state(j).expr
                finally:
                    self._keying.discard(j)
                if e:
                    return e
            return f"<tensor {tuple(k.shape)}>"
        return _short_repr(k)


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\(\))?$")   # a name, or a no-argument call: _values()


def _apply_expr(e: str, kind: str, text: str) -> Optional[str]:
    if kind == "attr":
        return f"{e}.{text}" if _IDENT.match(text) else f"getattr({e}, {text!r})"
    if kind in ("key",):
        return f"{e}[{text}]"
    if kind == "index":
        return f"{e}[{text}]"
    if kind in ("instdict", "cell"):
        return e
    if kind == "grad":
        return f"{e}.grad"
    if kind == "base":
        return f"{e}._base"
    return None
