"""Per-type handlers and shared helpers of the leak finder.

Types are classified once per type (``_classify``), never with ``isinstance`` on
arbitrary heap objects (a module-level ``__getattr__`` or a ``__class__`` property can
run code and warn). Also here: which files are library code and which modules are the
user's, autograd-graph helpers (``_saved_names``), frame helpers, tensor metadata, and
``_GcPaused`` (automatic collections off while the finder allocates; type caches dropped
on the way out, since they hold classes strongly).
"""
from __future__ import annotations

import gc
import os
import sys
import types
import weakref
from operator import itemgetter
from typing import Any, Optional

from ...native import dict_identity

_PY313 = sys.version_info >= (3, 13)


# -- type classification -------------------------------------------------------------------------
# Handlers, cached per type: never call isinstance() on arbitrary heap objects (a module-level
# __getattr__ or a __class__ property can run code and warn: torch.distributed does).
_GENERIC, _SKIP, _TENSOR, _NODE, _PYNODE, _FRAME, _TB, _FUNC, _CLASS, _NDARRAY, _STORAGE, _GEN, _DEFER = range(13)
#: the autograd graph's node kinds (a C++ node, a Python custom Function's node)
_NODES = frozenset((_NODE, _PYNODE))


#: Packages whose *instances* are machinery, not user data: entering them walks the whole kernel.
#: (Queues, futures and threads stay in: user data flows through them.)
_MACHINERY = frozenset((
    "IPython", "ipykernel", "traitlets", "zmq", "tornado", "jupyter_client", "jupyter_core", "prompt_toolkit",
    "jedi", "parso", "asyncio", "logging", "selectors", "socket", "ssl", "comm", "debugpy", "pydevd",
    "_pydevd_bundle", "pygments", "matplotlib_inline", "importlib", "_frozen_importlib",
    "_frozen_importlib_external", "zipimport", "codecs", "io", "_io", "encodings", "site", "sysconfig",
    "ipywidgets", "nbclient", "nbformat", "pytest", "_pytest", "pluggy", "pdb", "bdb", "cmd", "inspect",
    "signal", "atexit", "typing", "abc",
    # tensorscope's own objects hold no tensor (weak references only): `t` of a running
    # `with tensorscope.trace() as t` is the session, whose walk was most of a trace's search
    "tensorscope",
))


#: Per-type caches. They hold classes strongly, and a notebook class can own tensors (class
#: attributes): every public entry point clears them when it is done (``_clear_type_caches``).
_types: dict[type, int] = {}


_torch = None


def _T():
    """torch, imported on first use (``import tensorscope`` stays cheap)."""
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    return _torch


def _root_pkg(modname) -> str:
    return modname.partition(".")[0] if isinstance(modname, str) else ""


def _classify(tp: type) -> int:
    torch = _T()
    h = _GENERIC
    try:
        if issubclass(tp, torch.Tensor):
            h = _TENSOR
        elif issubclass(tp, torch.autograd.graph.Node):
            # Python custom-Function nodes (BackwardCFunction) also carry a __dict__ (ctx attributes).
            h = _PYNODE if issubclass(tp, torch._C._FunctionBase) else _NODE
        elif issubclass(tp, torch.UntypedStorage):
            h = _STORAGE
        elif issubclass(tp, torch.optim.Optimizer):
            # explored after plain containment: a parameter reads better as model.w than opt.state key
            h = _DEFER
        elif tp is types.FrameType:
            h = _FRAME
        elif tp is types.TracebackType:
            h = _TB
        elif tp is types.FunctionType:
            h = _FUNC
        elif issubclass(tp, type):
            h = _CLASS
        elif tp in (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType):
            h = _GEN
        elif issubclass(tp, (types.ModuleType, types.CodeType, types.BuiltinFunctionType, types.MethodWrapperType,
                             types.WrapperDescriptorType, types.MethodDescriptorType, types.GetSetDescriptorType,
                             types.MemberDescriptorType, weakref.ref)) \
                or _root_pkg(getattr(tp, "__module__", "")) in _MACHINERY:
            h = _SKIP
        else:
            np = sys.modules.get("numpy")
            if np is not None and issubclass(tp, np.ndarray):
                h = _NDARRAY
    except Exception:  # an exotic metaclass: walk it generically
        h = _GENERIC
    _types[tp] = h
    return h


#: Untracked (atomic-only) objects cannot hold tensors, except numpy arrays (``.base``), which gc
#: does not track.
#: types whose untracked instances hold nothing of interest (filled as met, cleared with the caches)
_PLAIN_UNTRACKED: set[type] = {int, str, float, bytes, bool, type(None), complex}
_PLAIN_BASE = frozenset(_PLAIN_UNTRACKED)


def _untracked_interest(obj) -> bool:
    return _untracked_interest_type(type(obj))


def _untracked_interest_type(tp: type) -> bool:
    h = _types.get(tp)
    if h is None:
        h = _classify(tp)
    return h == _NDARRAY


# -- library vs user code ------------------------------------------------------------------------
def _library_prefixes() -> tuple[str, ...]:
    import site
    import sysconfig

    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        try:
            paths.add(sysconfig.get_paths()[key])
        except Exception:
            pass
    try:
        paths.update(site.getsitepackages())
        paths.add(site.getusersitepackages())
    except Exception:
        pass
    paths.add(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tensorscope itself
    try:   # and its compiled libraries (tensorscope_engine, _fmode, _hooks: modules loaded from the build cache)
        from ...native import cache_root

        paths.add(cache_root())
    except Exception:
        pass
    return tuple(os.path.abspath(p) + os.sep for p in paths if p)


_LIB: Optional[tuple[str, ...]] = None


#: file path -> is it library code (paths are few and stable; thousands of modules share prefixes)
_LIBFILE: dict[str, bool] = {}


def _is_library_file(path) -> bool:
    global _LIB
    if not path or path.startswith("<"):
        return True
    r = _LIBFILE.get(path)
    if r is None:
        if _LIB is None:
            _LIB = _library_prefixes()
        if len(_LIBFILE) > 100_000:
            _LIBFILE.clear()
        r = _LIBFILE[path] = os.path.abspath(path).startswith(_LIB)
    return r


#: sys.modules as last classified: (its names, its modules' ids, the names of the user's modules
#: among them), or with the native hooks loaded (its identity, None, the names). No module is held:
#: ids and names only.
_UM_CACHE: Optional[tuple[Any, Optional[list[int]], list[str]]] = None


def _module_file(mod) -> Optional[str]:
    """``__file__`` from the module's dict (never through a lazy module's ``__getattr__``)."""
    d = getattr(mod, "__dict__", None)
    f = d.get("__file__") if type(d) is dict else None
    return f if isinstance(f, str) else None


def _user_modules() -> list[tuple[str, types.ModuleType]]:
    """Imported modules that are the user's own code (not stdlib, not site-packages, not ours).

    With a big library imported (transformers: thousands of modules) the classification costs
    ~1.5 µs a module, so it is kept from one call to the next: while ``sys.modules`` holds the same
    names bound to the same objects (one C pass with the native hooks, ``native.dict_identity``,
    else two C-level list compares), only the user's modules are read again (their ``__file__``);
    any other change classifies every module again."""
    global _UM_CACHE
    sig = dict_identity(sys.modules)
    names: Any = sig
    ids: Optional[list[int]] = None
    if sig is None:
        names = list(sys.modules)
        ids = list(map(id, sys.modules.values()))
    cached = _UM_CACHE
    if cached is not None and cached[0] == names and cached[1] == ids:
        mods = sys.modules
        out = [(name, mods[name]) for name in cached[2] if name in mods]
        if len(out) == len(cached[2]) and all(not _is_library_file(_module_file(mod)) for _n, mod in out):
            return out
    out = []
    items = list(sys.modules.items())
    if sig is None:
        names = list(map(itemgetter(0), items))
        ids = list(map(id, map(itemgetter(1), items)))
    for name, mod in items:
        if mod is None or name in ("__main__", "__mp_main__") or name.startswith("_"):
            continue
        f = _module_file(mod)
        if f is not None and not _is_library_file(f):
            out.append((name, mod))
    _UM_CACHE = (names, ids, [name for name, _m in out])
    return out


def _is_user_class(cls, user_modnames) -> bool:
    m = cls.__dict__.get("__module__") if hasattr(cls, "__dict__") else None
    return isinstance(m, str) and (m in ("__main__", "__mp_main__") or m in user_modnames)


_saved_attrs: dict[type, tuple[str, ...]] = {}


def _node_name(node) -> str:
    n = node.name()
    return n[len("torch::autograd::"):] if n.startswith("torch::autograd::") else n


def _saved_names(node) -> tuple[str, ...]:
    """The ``_raw_saved_*`` attributes of an autograd node type (dir() is slow: once per type)."""
    tp = type(node)
    names = _saved_attrs.get(tp)
    if names is None:
        names = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
        _saved_attrs[tp] = names
    return names


def _other_threads_frames() -> set[int]:
    """ids of frames executing on other threads (their locals are live holders)."""
    out: set[int] = set()
    me = None
    top: Optional[types.FrameType] = None
    f: Optional[types.FrameType] = None
    try:
        import threading

        me = threading.get_ident()
        for tid, top in sys._current_frames().items():
            if tid == me:
                continue
            f = top
            while f is not None:
                out.add(id(f))
                f = f.f_back
    except Exception:
        pass
    finally:
        top = f = None   # this thread's entry is this very frame: left in a local, a reference cycle
    return out


def _running_frames() -> set[Any]:
    """The frames executing on this thread, from the caller's out (this function's own would hold the
    set it returns: a reference cycle that kept, until the collector's next full pass, every frame of
    the stack, and with them the finished recording, alive). Callers drop the set when done."""
    out = set()
    f: Optional[types.FrameType] = sys._getframe(1)
    while f is not None:
        out.add(f)
        f = f.f_back
    return out


_isa_cache: dict[tuple[type, str], bool] = {}


def _isa(obj, what: str) -> bool:
    tp = type(obj)
    r = _isa_cache.get((tp, what))
    if r is None:
        torch = _T()
        base = torch.nn.Module if what == "module" else torch.optim.Optimizer
        try:
            r = issubclass(tp, base)
        except Exception:
            r = False
        _isa_cache[(tp, what)] = r
    return r


_DTYPE_STR: dict[Any, str] = {}


_DEV_STR: dict[Any, str] = {}


def _dev_str(x) -> str:
    d = x.device
    r = _DEV_STR.get(d)
    if r is None:
        r = _DEV_STR[d] = str(d)
    return r


def _tensor_meta(t) -> tuple[str, Optional[str], Optional[tuple[int, ...]]]:
    try:
        dt = t.dtype
        ds = _DTYPE_STR.get(dt)
        if ds is None:
            ds = _DTYPE_STR[dt] = str(dt).replace("torch.", "")
        return _dev_str(t), ds, tuple(t.shape)
    except Exception:
        return "unknown", None, None


def _clear_type_caches():
    _types.clear()
    _isa_cache.clear()
    _saved_attrs.clear()
    _PLAIN_UNTRACKED.clear()
    _PLAIN_UNTRACKED.update(_PLAIN_BASE)


class _GcPaused:
    """Pause automatic collections while we allocate (a full collection over a big heap, triggered by
    our own bookkeeping, would cost more than the search); on the way out, drop the type caches."""

    def __enter__(self):
        self.was = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, *exc):
        _clear_type_caches()
        if self.was:
            gc.enable()
        return False


_CO_OPTIMIZED = 0x1


def _live_frame_locals(fr) -> list[tuple[str, Any]]:
    """(name, value) of a running function frame's locals, leaving nothing behind.

    gc cannot see a running frame's locals (its thread owns them), so ``f_locals`` is the only
    way in. From 3.13 it is a write-through proxy (PEP 667): nothing is copied. Before, it is a
    dict cached on the frame that would keep every value alive until the next refresh, so a local
    the function deletes later would outlive its ``del``: the cache is emptied again when nothing
    but the frame holds it (the next ``locals()`` refills it, as it always does).
    """
    try:
        d = fr.f_locals
    except Exception:
        return []
    try:
        items = list(d.items())
        if (not _PY313 and type(d) is dict and fr.f_code.co_flags & _CO_OPTIMIZED
                and sys.getrefcount(d) <= 3):   # the frame's cache, ``d`` and getrefcount's argument
            d.clear()
    except Exception:
        items = []
    del d
    return items

