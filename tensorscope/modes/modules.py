"""nn.Module path of the running code, read from the call stack (no module hooks).

Global module hooks would change the program's observable behaviour: every module call takes
``_call_impl``'s slow path (tracebacks show other lines and an extra ``inner`` frame), and
``torch.compile(module)`` warns about global hooks. So nothing is registered: when the function
mode records an outermost torch-level call it asks :meth:`ModuleTracker.at` for the module whose
``Module.__call__`` frame (``_wrapped_call_impl``) encloses the caller, a walk of a few frames.
Names come from a cached ``root.named_modules()`` of the outermost module on the stack, so
modules in ModuleList/ModuleDict get their qualified names; a module not under the root gets the
enclosing module's path plus ``<ClassName>``. A ``torch.compile``'d root (``OptimizedModule``) is
named through the module it wraps: paths are the user's (no ``_orig_mod``).

Frames are read while they execute and never kept (they hold the user's tensors).
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch

_Module = torch.nn.Module
_CALL_CODES = tuple(getattr(getattr(_Module, n, None), "__code__", None) for n in ("_wrapped_call_impl", "_call_impl"))
_CALL_CODES = tuple(c for c in _CALL_CODES if c is not None)
_WRAPPED_CODE = getattr(getattr(_Module, "_wrapped_call_impl", None), "__code__", None)
_IMPL_CODE = getattr(getattr(_Module, "_call_impl", None), "__code__", None)
#: how far out to look for a module call (compiled regions sit under ~30 frames of torch.compile);
#: top-level code (a cell, a script: ``<module>``) ends the walk at once
_NEAR = 64


def _module_of(frame) -> Optional[_Module]:
    try:
        m = frame.f_locals.get("self")
    except Exception:
        return None
    return m if isinstance(m, _Module) else None


def _unwrap(m):
    """The user's module behind a torch.compile wrapper (OptimizedModule keeps it as _orig_mod)."""
    orig = getattr(m, "_orig_mod", None) if type(m).__name__ == "OptimizedModule" else None
    return orig if isinstance(orig, _Module) else m


def _is_artifact(m) -> bool:
    return isinstance(m, _GraphModule) if _GraphModule is not None else False


try:
    from torch.fx import GraphModule as _GraphModule
except Exception:  # pragma: no cover
    _GraphModule = None


class ModuleTracker:
    def __init__(self, rec):
        self.rec = rec
        self.stack: List[int] = []       # kept for callers that look at it; always empty now
        self.current = 0                 # module id of the innermost running module (0: none)
        self._names: Dict[int, str] = {}
        self._root_ref: Optional[weakref.ref] = None
        self._ids: Dict[int, int] = {}   # id(module) -> module path id, for the current root

    def install(self):
        """Nothing to install: modules are read from the stack (see the module docstring)."""

    def remove(self):
        self.current = 0
        self._ids = {}
        self._names = {}
        self._root_ref = None

    def at(self, frame) -> int:
        """Module path id for code running at ``frame`` (0 outside any module). Sets ``current``."""
        try:
            mid = self._at(frame)
        except Exception as e:  # never reach user code
            self.rec.tracer_error("module path", e)
            mid = 0
        self.current = mid
        return mid

    def _at(self, frame) -> int:
        f = frame
        n = _NEAR
        codes = _CALL_CODES
        mod = None
        while f is not None and n:
            if f.f_code.co_name == "<module>":
                break
            if f.f_code in codes:
                if f.f_code is _IMPL_CODE:
                    b = f.f_back
                    if b is not None and b.f_code is _WRAPPED_CODE:
                        f = b   # the same module; its frame has 3 locals to read, not ~15
                mod = _module_of(f)
                if mod is not None and not _is_artifact(mod):
                    break
                mod = None   # a compiled graph (fx GraphModule) is no module of the user's: look further out
            f = f.f_back
            n -= 1
        if mod is None:
            return 0
        mod = _unwrap(mod)
        mid = self._ids.get(id(mod))
        if mid is not None:
            root = self._root_ref() if self._root_ref is not None else None
            if root is not None:
                return mid
        # a module not named yet: find the outermost module on the stack (the root) and name its tree
        root = mod
        g = f.f_back
        while g is not None:
            if g.f_code in codes:
                m = _module_of(g)
                if m is not None and not _is_artifact(m):
                    root = _unwrap(m)
            g = g.f_back
        cur_root = self._root_ref() if self._root_ref is not None else None
        if cur_root is not root:
            self._root_ref = weakref.ref(root)
            # ids are only valid while the root (and so its children) is alive
            self._names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
            self._ids = {}
        name = self._names.get(id(mod))
        if name is None:
            parent = self._parent_path(f)
            name = f"{parent}.<{type(mod).__name__}>" if parent else f"<{type(mod).__name__}>"
        elif name == "":
            name = f"<{type(mod).__name__}>"   # the root itself
        mid = self.rec.modules(name)
        self._ids[id(mod)] = mid
        return mid

    def _parent_path(self, f) -> str:
        g = f.f_back
        while g is not None:
            if g.f_code in _CALL_CODES:
                m = _module_of(g)
                if m is not None:
                    m = _unwrap(m)
                    n = self._names.get(id(m))
                    if n is not None:
                        return n or f"<{type(m).__name__}>"
            g = g.f_back
        return ""
