"""nn.Module path of the running code, read from the call stack (no module hooks).

Global module hooks would change the program's observable behaviour: every module call takes
``_call_impl``'s slow path (tracebacks show other lines and an extra ``inner`` frame), and
``torch.compile(module)`` warns about global hooks. So nothing is registered: when the function
mode records an outermost torch-level call it asks :meth:`ModuleTracker.at` for the module whose
``Module.__call__`` frame (``_wrapped_call_impl``) encloses the caller: a walk from the caller
to top-level code (the cell's or script's ``<module>`` frame, at most 64 frames) that reads
``self`` of the innermost and the outermost module call only (cached per (root, module)).
Names come from a cached ``root.named_modules()`` of the outermost module on the stack, so
modules in ModuleList/ModuleDict get their qualified names; a module not under the root gets the
enclosing module's path plus ``<ClassName>``. A ``torch.compile``'d root (``OptimizedModule``) is
named through the module it wraps: paths are the user's (no ``_orig_mod``).

Frames are read while they execute and never kept (they hold the user's tensors).
"""
from __future__ import annotations

import weakref
from types import FrameType
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from .recorder import Recorder

_Module = torch.nn.Module
_WRAPPED_CODE = getattr(getattr(_Module, "_wrapped_call_impl", None), "__code__", None)
_IMPL_CODE = getattr(getattr(_Module, "_call_impl", None), "__code__", None)
#: how far out to look for a module call (compiled regions sit under ~30 frames of torch.compile);
#: top-level code (a cell, a script: ``<module>``) ends the walk at once
_NEAR = 64


def _module_of(frame: FrameType) -> Optional[_Module]:
    try:
        m = frame.f_locals.get("self")
    except Exception:
        return None
    return m if isinstance(m, _Module) else None


def _unwrap(m: _Module) -> _Module:
    """The user's module behind a torch.compile wrapper (OptimizedModule keeps it as _orig_mod)."""
    orig = getattr(m, "_orig_mod", None) if type(m).__name__ == "OptimizedModule" else None
    return orig if isinstance(orig, _Module) else m


def _is_artifact(m: _Module) -> bool:
    return isinstance(m, _GraphModule) if _GraphModule is not None else False


#: torch.fx's GraphModule (the compiled graphs' modules), None on a torch without torch.fx
_GraphModule: Optional[type[_Module]]
try:
    from torch.fx import GraphModule as _GraphModule
except Exception:  # pragma: no cover
    _GraphModule = None


_MOD_CODE = _WRAPPED_CODE or _IMPL_CODE   # one frame per module call (Module.__call__)


class ModuleTracker:
    """The nn.Module path of the running code, read from the call stack (no module hooks): interns each
    (root, module) pair's path once and gives the recorder its id."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.stack: list[int] = []       # kept for callers that look at it; always empty now
        self.current = 0                 # module id of the innermost running module (0: none)
        # (id(root), id(module)) -> (weakref(module), weakref(root), module path id)
        self._ids: dict[tuple[int, int], tuple[weakref.ref[_Module], weakref.ref[_Module], int]] = {}
        # id(root) -> (weakref(root), {id(module): qualified name})
        self._trees: dict[int, tuple[weakref.ref[_Module], dict[int, str]]] = {}
        # id(root) -> weakref(root): every root module the trace saw (kept past remove() for the build)
        self.roots_seen: dict[int, weakref.ref[_Module]] = {}
        #: the class name of each root module seen, in order (module paths are relative to their root)
        self.root_classes: list[str] = []

    def install(self) -> None:
        """Nothing to install: modules are read from the stack (see the module docstring)."""

    def roots(self) -> list[_Module]:
        """The root modules (outermost on the stack) the trace saw that are still alive."""
        out: list[_Module] = []
        for ref in list(self.roots_seen.values()):
            m = ref()
            if m is not None:
                out.append(m)
        return out

    def remove(self) -> None:
        self.current = 0
        self._ids = {}
        self._trees = {}

    def at(self, frame: Optional[FrameType]) -> int:
        """Module path id for code running at ``frame`` (0 outside any module). Sets ``current``."""
        try:
            mid = self._at(frame)
        except Exception as e:  # never reach user code
            self.rec.tracer_error("module path", e)
            mid = 0
        self.current = mid
        return mid

    def _at(self, frame: Optional[FrameType]) -> int:
        # the Module.__call__ frames between the caller and top-level code (a cell, a script)
        calls: list[FrameType] = []
        f = frame
        n = _NEAR
        while f is not None and n:
            code = f.f_code
            if code is _MOD_CODE:
                calls.append(f)
            elif code.co_name == "<module>":
                break
            f = f.f_back
            n -= 1
        if not calls:
            return 0
        mod: Optional[_Module] = None
        inner = 0
        for i, fr in enumerate(calls):   # innermost user module (compiled graphs are no module of the user's)
            m = _module_of(fr)
            if m is not None and not _is_artifact(m):
                mod, inner = _unwrap(m), i
                break
        if mod is None:
            return 0
        root = mod   # calls[inner] is the last the walk below reads: the root is found there at the latest
        for fr in reversed(calls[inner:]):   # outermost: the root whose names are the paths
            m = _module_of(fr)
            if m is not None and not _is_artifact(m):
                root = _unwrap(m)
                break
        key = (id(root), id(mod))
        ent = self._ids.get(key)
        if ent is not None and ent[0]() is mod and ent[1]() is root:
            return ent[2]
        names = self._tree(root)
        name = names.get(id(mod))
        if name is None:   # not under the root: the enclosing module's path plus <ClassName>
            parent = ""
            for fr in calls[inner + 1:]:
                m = _module_of(fr)
                if m is not None and not _is_artifact(m):
                    m = _unwrap(m)
                    pn = names.get(id(m))
                    if pn is not None:
                        parent = pn or f"<{type(m).__name__}>"
                        break
            name = f"{parent}.<{type(mod).__name__}>" if parent else f"<{type(mod).__name__}>"
        elif name == "":
            name = f"<{type(mod).__name__}>"   # the root itself
        mid = self.rec.modules(name)
        if len(self._ids) >= 65536:
            self._ids.clear()
        self._ids[key] = (weakref.ref(mod), weakref.ref(root), mid)
        return mid

    def _tree(self, root: _Module) -> dict[int, str]:
        ent = self._trees.get(id(root))
        if ent is not None and ent[0]() is root:
            return ent[1]
        # ids are valid while the root (and so its children) is alive: checked through the weakref
        names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        if len(self.roots_seen) < 256:
            if id(root) not in self.roots_seen:
                self.root_classes.append(type(root).__name__)
            self.roots_seen[id(root)] = weakref.ref(root)
        if len(self._trees) >= 16:
            self._trees.clear()
        self._trees[id(root)] = (weakref.ref(root), names)
        return names
