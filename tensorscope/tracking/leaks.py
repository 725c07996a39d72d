"""Leak finding: which tensor storages are alive, who holds them, and how to let go.

One batched breadth-first search from the *roots* a notebook user can name
(their globals, IPython's output cache, the last exception, user modules, live
caller frames) over ``gc.get_referents`` plus the edges only C++ knows about
(``grad_fn``, ``.grad``, ``._base``, autograd saved tensors via ``_raw_saved_*``
whose ``.data`` never runs unpack hooks, ``next_functions``, ``AccumulateGrad``
variables, sparse components, numpy ``.base``). Every storage met is charged to
the first (shortest) path that reaches it; other roots that reach the same
object are remembered so the suggested fix is complete.

The search prunes what a user cannot act on: module objects (except as roots),
function ``__globals__``/``__code__``, frames' ``f_back``/globals, library
classes, and instances of IPython/kernel machinery. Storages that no root
reaches are classified by a second, rarer pass: a scan of ``gc.get_objects()``
for Python tensors over them, a batched ``gc.get_referrers`` walk upwards, and
a reference-count balance that tells an unreachable reference cycle (``cycle``:
``gc.collect()`` frees it) from an owner gc cannot see (``hidden_cpp_owner``).

Nothing here keeps a tensor, a storage or a frame after a call returns: every
container that held one is cleared in ``finally`` blocks (an exception here
must not leave a traceback whose frames pin the user's memory), and reports
carry strings and integers only.

Always-on discovery (tracing off) lives here too: ``BoundaryDiscovery`` freezes
the gc heap before a cell and lists only the objects the cell created after it
(``gc.get_objects()`` skips the permanent generation), so its cost follows what
the cell made, not the heap. It never unfreezes what a user froze.
"""
from __future__ import annotations

import gc
import html
import os
import re
import sys
import time
import types
import weakref
from array import array
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import pyarrow as pa

from .. import schema as S

__all__ = [
    "find_leaks", "leak_table", "LeakReport", "LeakGroup", "remember", "known_storages", "fix_code",
    "BoundaryDiscovery", "enable_discovery", "disable_discovery", "discovery",
]

_PY313 = sys.version_info >= (3, 13)

# -- type classification -------------------------------------------------------------------------
# Handlers, cached per type: never call isinstance() on arbitrary heap objects (a module-level
# __getattr__ or a __class__ property can run code and warn: torch.distributed does).
_GENERIC, _SKIP, _TENSOR, _NODE, _PYNODE, _FRAME, _TB, _FUNC, _CLASS, _NDARRAY, _STORAGE, _GEN, _DEFER = range(13)

#: Packages whose *instances* are machinery, not user data: entering them walks the whole kernel.
#: (Queues, futures and threads stay in: user data flows through them.)
_MACHINERY = frozenset((
    "IPython", "ipykernel", "traitlets", "zmq", "tornado", "jupyter_client", "jupyter_core", "prompt_toolkit",
    "jedi", "parso", "asyncio", "logging", "selectors", "socket", "ssl", "comm", "debugpy", "pydevd",
    "_pydevd_bundle", "pygments", "matplotlib_inline", "importlib", "_frozen_importlib",
    "_frozen_importlib_external", "zipimport", "codecs", "io", "_io", "encodings", "site", "sysconfig",
    "ipywidgets", "nbclient", "nbformat", "pytest", "_pytest", "pluggy", "pdb", "bdb", "cmd", "inspect",
    "signal", "atexit", "typing", "abc",
))

#: Per-type caches. They hold classes strongly, and a notebook class can own tensors (class
#: attributes): every public entry point clears them when it is done (``_clear_type_caches``).
_types: Dict[type, int] = {}
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
                             types.MemberDescriptorType, weakref.ref)):
            h = _SKIP
        elif _root_pkg(getattr(tp, "__module__", "")) in _MACHINERY:
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
def _untracked_interest(obj) -> bool:
    h = _types.get(type(obj))
    if h is None:
        h = _classify(type(obj))
    return h == _NDARRAY


# -- library vs user code ------------------------------------------------------------------------
def _library_prefixes() -> Tuple[str, ...]:
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
    paths.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tensorscope itself
    return tuple(os.path.abspath(p) + os.sep for p in paths if p)


_LIB: Optional[Tuple[str, ...]] = None


def _is_library_file(path) -> bool:
    global _LIB
    if _LIB is None:
        _LIB = _library_prefixes()
    if not path or path.startswith("<"):
        return True
    return os.path.abspath(path).startswith(_LIB)


def _user_modules() -> List[Tuple[str, types.ModuleType]]:
    """Imported modules that are the user's own code (not stdlib, not site-packages, not ours)."""
    out = []
    for name, mod in list(sys.modules.items()):
        if mod is None or name in ("__main__", "__mp_main__") or name.startswith("_"):
            continue
        f = getattr(mod, "__file__", None)
        if isinstance(f, str) and not _is_library_file(f):
            out.append((name, mod))
    return out


def _is_user_class(cls, user_modnames) -> bool:
    m = cls.__dict__.get("__module__") if hasattr(cls, "__dict__") else None
    return isinstance(m, str) and (m in ("__main__", "__mp_main__") or m in user_modnames)


# -- roots ---------------------------------------------------------------------------------------
@dataclass
class _Root:
    label: str          # how the path text starts: "global x", "Out[3]", "sys.last_traceback"
    group: str          # global / local / out_cache / traceback
    expr: Optional[str]  # a Python expression naming it, when one exists
    fix: str            # what releases this root's reference


_OUT_NAME = re.compile(r"^_\d+$")
_GC_COLLECT = "import gc; gc.collect()"
_HIDDEN_SKIP = frozenset(("In", "Out", "_ih", "_oh", "_dh", "get_ipython", "exit", "quit", "_i", "_ii", "_iii",
                          "__builtins__", "__builtin__", "__name__", "__doc__", "__package__", "__loader__",
                          "__spec__", "__file__", "__cached__"))


def _get_shell(shell):
    if shell is not None:
        return shell
    ip_mod = sys.modules.get("IPython")
    if ip_mod is None:
        return None
    try:
        return ip_mod.get_ipython()
    except Exception:
        return None


def _user_namespace(shell, user_ns):
    if user_ns is not None:
        return user_ns
    if shell is not None and getattr(shell, "user_ns", None) is not None:
        return shell.user_ns
    main = sys.modules.get("__main__")
    return getattr(main, "__dict__", {})


_INTERNAL_FILE_HINTS = (os.sep + "IPython" + os.sep, os.sep + "ipykernel" + os.sep, os.sep + "tornado" + os.sep,
                        os.sep + "asyncio" + os.sep, os.sep + "traitlets" + os.sep)


def _stack_frames() -> List[types.FrameType]:
    """Running user frames above us (function frames only: a module frame's locals are globals)."""
    out = []
    try:
        f = sys._getframe(1)
    except ValueError:
        return out
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    while f is not None:
        code = f.f_code
        fn = code.co_filename
        if (code.co_name != "<module>" and not fn.startswith(ours) and not _is_library_file(fn)
                and not any(h in fn for h in _INTERNAL_FILE_HINTS)):
            out.append(f)
        f = f.f_back
    return out


def _collect_roots(shell, user_ns, frames: bool = True) -> Tuple[List[Any], List[_Root]]:
    """(objects, descriptions) in search priority order. The caller must clear ``objects``."""
    objs: List[Any] = []
    roots: List[_Root] = []

    def add(obj, label, group, expr, fix):
        if obj is None:
            return
        objs.append(obj)
        roots.append(_Root(label, group, expr, fix))

    hidden = getattr(shell, "user_ns_hidden", None) or {}
    out_cache = user_ns.get("_oh") if shell is not None else None
    ns_items = list(user_ns.items())
    under_names = ("_", "__", "___")
    # 1. the user's own names
    for name, val in ns_items:
        if not isinstance(name, str) or name in _HIDDEN_SKIP or name in under_names or _OUT_NAME.match(name):
            continue
        if name in hidden and hidden[name] is val:
            continue  # IPython's own machinery (exit, quit, get_ipython ...)
        if name.startswith("_i") and isinstance(val, str):
            continue
        add(val, f"global {name}", "global", name, f"del {name}")
    # 2. the user's own modules (a notebook's helper .py files)
    for modname, mod in _user_modules():
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for name, val in list(d.items()):
            if isinstance(name, str) and not name.startswith("__"):
                add(val, f"global {modname}.{name}", "global", f"{modname}.{name}", f"del {modname}.{name}")
    # 3. IPython's output cache: Out[n], _n, _, __, ___ in user_ns, user_ns_hidden and the displayhook
    if isinstance(out_cache, dict):
        for n, val in list(out_cache.items()):
            add(val, f"Out[{n}]", "out_cache", f"Out[{n}]", "%reset -f out")
    for name, val in ns_items:
        if isinstance(name, str) and _OUT_NAME.match(name):
            add(val, name, "out_cache", name, "%reset -f out")
    for name in under_names:
        if name in user_ns:
            add(user_ns[name], name, "out_cache", name, "%reset -f out")
    for name, val in list(hidden.items()):
        if isinstance(name, str) and (name in under_names or _OUT_NAME.match(name)):
            fix = (_HIDDEN_UNDERS if name in under_names else "%reset -f out")
            add(val, f"user_ns_hidden[{name!r}]", "out_cache", None, fix)
    dh = getattr(shell, "displayhook", None)
    if dh is not None:
        for name in under_names:
            add(getattr(dh, name, None), f"displayhook.{name}", "out_cache", None, "%reset -f out")
    ler = getattr(shell, "last_execution_result", None)
    if ler is not None:
        add(getattr(ler, "result", None), "last_execution_result.result", "out_cache", None,
            "(released when the next cell runs)")
    # 4. the last exception: its traceback's frames keep every local alive
    # A stored exception sits in a reference cycle (IPython's run_code frame → its ExecutionResult →
    # the exception → its traceback → that frame): dropping the roots leaves garbage for gc to free.
    for attr in ("last_traceback", "last_value", "last_exc"):
        add(getattr(sys, attr, None), f"sys.{attr}", "traceback", None,
            f"import sys; sys.{attr} = None; {_GC_COLLECT}")
    for tb_owner in ("InteractiveTB", "SyntaxTB"):
        h = getattr(shell, tb_owner, None)
        if h is not None:
            add(getattr(h, "tb", None), f"{tb_owner}.tb", "traceback", None,
                f"get_ipython().{tb_owner}.tb = None; {_GC_COLLECT}")
    if ler is not None:
        add(getattr(ler, "error_in_exec", None), "last_execution_result.error_in_exec", "traceback", None,
            "(released when the next cell runs)")
    # 5. live frames of the user's functions calling us
    for f in (_stack_frames() if frames else ()):
        code = f.f_code
        add(f, f"local in {code.co_name}() ({os.path.basename(code.co_filename)}:{f.f_lineno})", "local", None,
            f"del the local in {code.co_name}() or return from it")
    return objs, roots


_saved_attrs: Dict[type, Tuple[str, ...]] = {}


def _node_name(node) -> str:
    n = node.name()
    return n[len("torch::autograd::"):] if n.startswith("torch::autograd::") else n


def _saved_names(node) -> Tuple[str, ...]:
    """The ``_raw_saved_*`` attributes of an autograd node type (dir() is slow: once per type)."""
    tp = type(node)
    names = _saved_attrs.get(tp)
    if names is None:
        names = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
        _saved_attrs[tp] = names
    return names


# -- the batched search --------------------------------------------------------------------------
class _Search:
    """One multi-source BFS. Holds every visited object until ``clear()``."""

    MAX_NODES_DEFAULT = 20_000_000
    BIG_CONTAINER = 1000

    def __init__(self, root_objs: List[Any], roots: List[_Root], want: Optional[Dict[int, Any]],
                 collect_all: bool, user_modnames: Set[str], max_nodes: int = MAX_NODES_DEFAULT):
        self.roots = roots
        self.order: List[Any] = []
        self.par = array("q")
        self.own = array("q")
        self.idx: Dict[int, int] = {}
        self.cross: Dict[int, Set[int]] = {}      # node -> other roots that reach it
        self.synth: Dict[int, Tuple[str, str]] = {}  # node -> label of a C++ edge that created it
        self.want = want                        # id(storage) -> storage (targets) or None
        self.collect_all = collect_all
        self.found: Dict[int, List[int]] = {}   # id(storage) -> tensor nodes holding it (first = primary)
        self.storages: Dict[int, Any] = {}      # id(storage) -> storage (kept alive during the search)
        self.user_modnames = user_modnames
        self.max_nodes = max_nodes
        self.truncated = False
        self.errors = 0
        self._deferred_objs: List[int] = []
        self._deferred_edges: List[Tuple[int, Any, Tuple[str, str]]] = []
        # with targets only (a trace's leak table), stop once each has a holder
        self.n_want = len(want) if (want and not collect_all) else 0
        self.complete = False
        order, par, own, idx = self.order, self.par, self.own, self.idx
        for r, obj in enumerate(root_objs):
            j = idx.get(id(obj))
            if j is None:
                idx[id(obj)] = len(order)
                order.append(obj)
                par.append(-1)
                own.append(r)
            elif own[j] != r:
                self.cross.setdefault(j, set()).add(r)

    # the hot loop: keep attribute lookups out of it
    def run(self):
        order, par, own, idx, cross = self.order, self.par, self.own, self.idx, self.cross
        get_referents, is_tracked = gc.get_referents, gc.is_tracked
        tcache = _types
        classify = _classify
        special = self._special
        max_nodes = self.max_nodes
        big = self.BIG_CONTAINER if self.n_want else 0
        expanded: Set[int] = set()
        i = 0
        while True:
            while i < len(order):
                o = order[i]
                tp = type(o)
                h = tcache.get(tp)
                if h is None:
                    h = classify(tp)
                if h == _GENERIC:
                    kids = get_referents(o)
                    if big and len(kids) > big and i not in expanded:
                        # targets only: look into small containers first, big ones (a dataset's
                        # million items) only if some target is still missing afterwards
                        self._deferred_objs.append(i)
                        i += 1
                        continue
                elif h == _SKIP:
                    i += 1
                    continue
                elif h == _DEFER:
                    self._deferred_objs.append(i)
                    i += 1
                    continue
                else:
                    try:
                        kids = special(o, h, i)
                    except Exception:
                        self.errors += 1
                        kids = ()
                    if self.n_want and len(self.found) >= self.n_want:
                        # every target has its (shortest) path: the rest of the heap cannot shorten it
                        self.complete = True
                        return
                oi = own[i]
                for k in kids:
                    kid = id(k)
                    j = idx.get(kid)
                    if j is None:
                        if not is_tracked(k) and not _untracked_interest(k):
                            continue
                        idx[kid] = len(order)
                        order.append(k)
                        par.append(i)
                        own.append(oi)
                    elif own[j] != oi and j != i:
                        s = cross.get(j)
                        if s is None:
                            cross[j] = {oi}
                        else:
                            s.add(oi)
                if len(order) > max_nodes:
                    self.truncated = True
                    return
                i += 1
            # the queue is empty: now the lower-priority edges (optimizers, autograd graphs)
            if not self._deferred_objs and not self._deferred_edges:
                return
            objs, self._deferred_objs = self._deferred_objs, []
            for d in objs:
                expanded.add(d)
                for k in get_referents(order[d]):
                    if is_tracked(k) or _untracked_interest(k):
                        self._enqueue(d, k, None)
            edges, self._deferred_edges = self._deferred_edges, []
            for parent, child, label in edges:
                self._enqueue(parent, child, label)
            edges.clear()

    def _enqueue(self, parent: int, child, label: Optional[Tuple[str, str]]):
        kid = id(child)
        j = self.idx.get(kid)
        if j is not None:
            if self.own[j] != self.own[parent] and j != parent:
                self.cross.setdefault(j, set()).add(self.own[parent])
            return
        j = len(self.order)
        self.idx[kid] = j
        self.order.append(child)
        self.par.append(parent)
        self.own.append(self.own[parent])
        if label is not None:
            self.synth[j] = label

    def _add_synth(self, parent: int, child, label: Tuple[str, str], defer: bool = False):
        """A C++ edge: its label is known now, so no search for it later. Graph edges wait their turn."""
        if child is None:
            return
        if defer:
            self._deferred_edges.append((parent, child, label))
        else:
            self._enqueue(parent, child, label)

    def _special(self, o, h, i):
        if h == _TENSOR:
            return self._tensor(o, i)
        if h == _NODE or h == _PYNODE:
            self._node(o, i)
            return gc.get_referents(o) if h == _PYNODE else ()
        if h == _STORAGE:
            self._storage_seen(o, i, None)
            return ()
        if h == _FRAME:
            return [k for k in gc.get_referents(o) if type(k) is not types.FrameType and k is not o.f_globals
                    and k is not o.f_builtins and type(k) is not types.CodeType]
        if h == _TB:
            return (o.tb_frame, o.tb_next)
        if h == _FUNC:
            out = []
            if o.__closure__:
                out.append(o.__closure__)
            if o.__defaults__:
                out.append(o.__defaults__)
            if o.__kwdefaults__:
                out.append(o.__kwdefaults__)
            d = getattr(o, "__dict__", None)
            if d:
                out.append(d)
            return out
        if h == _CLASS:
            if not _is_user_class(o, self.user_modnames):
                return ()
            out = [d for d in gc.get_referents(o) if type(d) is dict]
            out.extend(b for b in o.__bases__ if _is_user_class(b, self.user_modnames))
            return out
        if h == _GEN:
            return [k for k in gc.get_referents(o) if type(k) not in (types.CodeType, str, types.FunctionType)]
        if h == _NDARRAY:
            base = o.base
            if base is not None:
                self._add_synth(i, base, ("attr", "base"))
            return ()
        return gc.get_referents(o)

    def _storage_seen(self, s, node: int, t):
        key = id(s)
        lst = self.found.get(key)
        if lst is None:
            if not self.collect_all and key not in self.want:
                return
            try:
                if s.data_ptr() == 0:  # zero bytes, meta and fake storages: nothing to leak
                    return
            except Exception:
                return
            self.found[key] = [node]
            self.storages[key] = s
        elif len(lst) < 8:
            lst.append(node)

    def _tensor(self, t, i):
        # __dict__, hooks, subclass state first: njt._values reads better than njt._base
        for k in gc.get_referents(t):
            h = _types.get(type(k))
            if h is None:
                h = _classify(type(k))
            if h == _NODE or h == _PYNODE:
                # a tensor Python owns alone traverses its grad_fn: keep it on the labeled, deferred edge
                self._deferred_edges.append((i, k, ("grad_fn", _node_name(k))))
            elif gc.is_tracked(k) or h == _NDARRAY:
                self._enqueue(i, k, None)
        try:
            s = t.untyped_storage()
        except Exception:
            s = None
            self._tensor_parts(t, i)
        if s is not None:  # _storage_seen, inlined: this runs once per tensor of the heap
            key = id(s)
            lst = self.found.get(key)
            if lst is None:
                if self.collect_all or key in self.want:
                    try:
                        ptr = s.data_ptr()
                    except Exception:
                        ptr = 0
                    if ptr:  # zero bytes, meta and fake storages have none: nothing to leak
                        self.found[key] = [i]
                        self.storages[key] = s
            elif len(lst) < 8:
                lst.append(i)
            del s
        try:
            if t.requires_grad:
                gf = t.grad_fn
                if gf is not None:
                    self._deferred_edges.append((i, gf, ("grad_fn", _node_name(gf))))
                    if t.retains_grad:
                        g = t.grad
                        if g is not None:
                            self._enqueue(i, g, ("grad", "grad"))
                else:
                    g = t.grad
                    if g is not None:
                        self._enqueue(i, g, ("grad", "grad"))
            else:
                g = t.grad  # a leaf (no grad_fn without requires_grad): reading .grad never warns
                if g is not None:
                    self._enqueue(i, g, ("grad", "grad"))
            b = t._base
            if b is not None:  # same storage as the view: only its own grad_fn/.grad can add anything
                self._deferred_edges.append((i, b, ("base", "_base")))
        except Exception:
            self.errors += 1
        return ()

    def _tensor_parts(self, t, i):
        """Tensors without a plain storage: sparse layouts and wrapper subclasses."""
        torch = _T()
        lay = t.layout
        parts: List[Tuple[str, Any]] = []
        if lay is torch.sparse_coo:
            parts = [("_indices()", t._indices()), ("_values()", t._values())]
        elif lay in (torch.sparse_csr, torch.sparse_bsr):
            parts = [("crow_indices()", t.crow_indices()), ("col_indices()", t.col_indices()), ("values()", t.values())]
        elif lay in (torch.sparse_csc, torch.sparse_bsc):
            parts = [("ccol_indices()", t.ccol_indices()), ("row_indices()", t.row_indices()), ("values()", t.values())]
        else:
            flat = getattr(type(t), "__tensor_flatten__", None)
            if flat is not None:
                names, _ctx = t.__tensor_flatten__()
                parts = [(n, getattr(t, n, None)) for n in names]
        for name, p in parts:
            self._add_synth(i, p, ("attr", name))

    def _node(self, node, i):
        for name in _saved_names(node):
            try:
                raw = getattr(node, name)
            except Exception:  # freed by a backward pass without retain_graph
                continue
            label = name[len("_raw_saved_"):]
            items = raw if isinstance(raw, (list, tuple)) else (raw,)
            for k, sv in enumerate(items):
                if sv is None:
                    continue
                try:
                    data = sv.data  # the saved (packed) value: never runs an unpack hook
                except Exception:
                    continue
                self._add_synth(i, data, ("saved", label if len(items) == 1 else f"{label}[{k}]"), defer=True)
        try:
            var = node.variable  # AccumulateGrad: the leaf itself
        except Exception:
            var = None
        if var is not None:
            self._add_synth(i, var, ("variable", "variable"), defer=True)
        try:
            nxt = node.next_functions
        except Exception:
            nxt = ()
        for nf, _k in nxt:
            if nf is not None:
                self._add_synth(i, nf, ("node", _node_name(nf)), defer=True)

    def clear(self):
        self.order.clear()
        self.idx.clear()
        self.cross.clear()
        self.found.clear()
        self.storages.clear()
        self.synth.clear()
        self._deferred_edges.clear()
        self._deferred_objs.clear()
        self.want = None


# -- edge labels (computed lazily, only along reported paths) ------------------------------------
def _short_repr(k, n=40) -> str:
    try:
        r = repr(k)
    except Exception:
        r = f"<{type(k).__name__}>"
    return r if len(r) <= n else r[: n - 1] + "…"


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
        self.cache: Dict[int, Dict[int, Tuple[str, str]]] = {}
        self.describer = None
        self._keying: Set[int] = set()

    def label(self, j: int) -> Tuple[str, str]:
        s = self.s
        lab = s.synth.get(j)
        if lab is not None:
            return lab
        p = s.par[j]
        m = self.cache.get(p)
        if m is None:
            self.cache[p] = {}  # re-entry (a tensor key's own path) sees no labels rather than recursing
            m = self._build(p)
            self.cache[p] = m
        lab = m.get(id(s.order[j]))
        return lab if lab is not None else ("obj", type(s.order[j]).__name__)

    def _build(self, p: int) -> Dict[int, Tuple[str, str]]:
        s = self.s
        o = s.order[p]
        gp = s.order[s.par[p]] if s.par[p] >= 0 else None
        m: Dict[int, Tuple[str, str]] = {}
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
                        names = gp.__code__.co_freevars
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
                m[id(o.tb_frame)] = ("frame", f"{co.co_name}() ({os.path.basename(co.co_filename)}:{o.tb_lineno})")
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
            # alive after the function deletes them: only read it on finished frames.
            if suspended or fr in _running_frames():
                return []
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


def _other_threads_frames() -> Set[int]:
    """ids of frames executing on other threads (their locals are live holders)."""
    out: Set[int] = set()
    me = None
    try:
        import threading

        me = threading.get_ident()
        for tid, f in sys._current_frames().items():
            if tid == me:
                continue
            while f is not None:
                out.add(id(f))
                f = f.f_back
    except Exception:
        pass
    return out


def _running_frames() -> Set[Any]:
    out = set()
    f = sys._getframe(0)
    while f is not None:
        out.add(f)
        f = f.f_back
    return out


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


# -- path → holder text, kind, fix ---------------------------------------------------------------
# Descriptions are built incrementally and memoized per node: a list of 100k tensors costs one
# description of the list plus one small extension per element, not 100k walks from the root.
_MODULE_DICTS = {"_parameters": "param", "_buffers": "buffer", "_modules": "submodule"}
_GRAPH_KINDS = frozenset(("grad_fn", "node", "saved", "variable"))
_isa_cache: Dict[Tuple[type, str], bool] = {}


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


class _PathState:
    """The description of the path from a root to one node (immutable once built)."""

    __slots__ = ("root", "pos", "expr", "flags", "marks", "first_kind", "last_kind", "nsteps", "text", "run",
                 "inst", "moddict")

    def __init__(self, root: _Root):
        self.root = root
        self.pos = 0
        self.expr = root.expr
        self.flags: frozenset = frozenset()
        self.marks: Dict[str, tuple] = {}
        self.first_kind = None
        self.last_kind = None
        self.nsteps = 0
        self.text = root.label
        self.run: Tuple[str, ...] = ()
        self.inst = False          # the last raw step entered an instance's __dict__
        self.moddict = None        # (what, expr, pos, parent) while a Module's _parameters/_buffers/_modules waits for its key

    def copy(self) -> "_PathState":
        n = _PathState.__new__(_PathState)
        n.root, n.pos, n.expr, n.flags, n.marks = self.root, self.pos, self.expr, self.flags, self.marks
        n.first_kind, n.last_kind, n.nsteps, n.text, n.run = (self.first_kind, self.last_kind, self.nsteps,
                                                             self.text, self.run)
        n.inst, n.moddict = self.inst, self.moddict
        return n

    def full_text(self) -> str:
        return self.text + _render_run(self.run)

    def extend(self, kind: str, text: str, parent, grandparent) -> "_PathState":
        n = self.copy()
        n.pos = self.pos + 1
        if (kind == "index" or kind == "key") and self.moddict is None and not self.inst:
            # the parent is a list/tuple/dict: never a module or an optimizer; the common case
            e = self.expr
            n.expr = f"{e}[{text}]" if e is not None else None
            if n.first_kind is None:
                n.first_kind = kind
            n.last_kind = kind
            n.nsteps += 1
            n.text = (self.text + _render_run(self.run) if self.run else self.text) + f"[{text}]"
            n.run = ()
            return n
        owner = grandparent if self.inst else parent   # attributes of an instance sit in its __dict__
        n.inst = False
        if kind == "instdict":
            n.inst = True
            return n
        if kind in ("cell", "tbnext"):
            return n
        if kind == "fnpart":
            if text == "__closure__":
                n.flags = self.flags | {"closure"}
            return n
        if self.moddict is not None:
            what, mexpr, mpos = self.moddict
            n.moddict = None
            if kind == "key":
                name = text[1:-1] if len(text) >= 2 and text[0] in "'\"" else text
                if what != "submodule":
                    n.flags = n.flags | {what}
                    if "module" not in n.marks:
                        n.marks = dict(n.marks, module=(mpos, mexpr))
                step = ("index", name) if name.isdigit() else ("attr", name)
                n._append(step[0], step[1], mexpr)
                return n
            n._append("attr", text, mexpr)  # not the shape we expected: render both steps plainly
        if kind == "attr" and text in _MODULE_DICTS and _isa(owner, "module"):
            mpos = self.pos - (1 if self.inst else 0)
            n.moddict = (_MODULE_DICTS[text], self.expr, mpos)
            if "topmodule" not in n.marks:
                n.marks = dict(n.marks, topmodule=(mpos, self.expr))
            return n
        if "optimizer" not in n.marks and _isa(owner, "optimizer"):
            n.flags = n.flags | {"optimizer"}
            n.marks = dict(n.marks, optimizer=(self.pos - (1 if self.inst else 0), self.expr))
        if kind in _GRAPH_KINDS and "graph" not in n.marks:
            n.flags = n.flags | {"autograd"}
            n.marks = dict(n.marks, graph=(n.pos, self.expr, self.nsteps == 1, self.first_kind))
        elif kind == "closure":
            n.flags = n.flags | {"closure"}
        elif kind == "genlocal" and "gen" not in n.marks:
            n.marks = dict(n.marks, gen=(self.pos, self.expr))
        elif kind == "grad" and "grad" not in n.marks:
            n.marks = dict(n.marks, grad=(n.pos, self.expr))
        n._append(kind, text, self.expr)
        return n

    def _append(self, kind: str, text: str, base_expr):
        self.expr = _apply_expr(base_expr, kind, text) if base_expr is not None else None
        if self.first_kind is None:
            self.first_kind = kind
        self.last_kind = kind
        self.nsteps += 1
        if kind == "node":
            self.run = self.run + (text,)
            return
        if self.run:
            self.text = self.text + _render_run(self.run)
            self.run = ()
        self.text = self.text + _render_step(kind, text)


def _render_run(run: Tuple[str, ...]) -> str:
    if not run:
        return ""
    if len(run) > 3:
        return f" → {run[0]} → … ({len(run) - 2} nodes) → {run[-1]}"
    return "".join(f" → {n}" for n in run)


def _render_step(kind: str, text: str) -> str:
    if kind == "attr":
        return f".{text}" if _IDENT.match(text) else f".{text!r}"
    if kind in ("key", "index"):
        return f"[{text}]"
    if kind == "dictkey":
        return f" (key {text})"
    if kind == "grad":
        return ".grad"
    if kind == "base":
        return "._base"
    if kind == "grad_fn":
        return f" → grad_fn {text}"
    if kind == "saved":
        return f" → saved {text}"
    if kind == "variable":
        return " → variable"
    if kind == "closure":
        return f" → closure {text}"
    if kind == "local":
        return f" → local {text}"
    if kind == "genlocal":
        return f" → local {text} of the suspended generator" if text else " → local of the suspended generator"
    if kind in ("frame", "obj"):
        return f" → {text}"
    return ""


@dataclass
class _Steps:
    text: str
    kind: str
    fix: str
    cut: int            # chain position whose incoming references the fix removes
    root_label: str
    root_fix: str


class _Describer:
    """Memoized path states per node, and the holder text / kind / fix of a node."""

    def __init__(self, search: _Search):
        self.s = search
        self.lab = _Labeler(search)
        self.lab.describer = self
        self.memo: Dict[int, _PathState] = {}

    def state(self, j: int) -> _PathState:
        memo = self.memo
        st = memo.get(j)
        if st is not None:
            return st
        s = self.s
        p = s.par[j]
        if p >= 0:
            ps = memo.get(p)
            if ps is not None:  # the common case: a sibling of a node already described
                kind, text = self.lab.label(j)
                gp = s.par[p]
                st = memo[j] = ps.extend(kind, text, s.order[p], s.order[gp] if gp >= 0 else None)
                return st
        up = []
        k = j
        while k >= 0 and k not in memo:
            up.append(k)
            k = s.par[k]
        if k < 0:
            r = up.pop()  # the root node itself
            st = _PathState(s.roots[s.own[r]])
            memo[r] = st
        else:
            st = memo[k]
        order, par = s.order, s.par
        for n in reversed(up):
            p = par[n]
            gp = par[p]
            kind, text = self.lab.label(n)
            st = st.extend(kind, text, order[p], order[gp] if gp >= 0 else None)
            memo[n] = st
        return st

    def describe(self, j: int, view=None) -> _Steps:
        st = self.state(j)
        root = st.root
        kind = _kind(root.group, st.flags)
        fix, cut = _fix(st, kind, view)
        return _Steps(st.full_text(), kind, fix, cut, root.label, root.fix)

    def clear(self):
        self.memo.clear()
        self.lab.cache.clear()
        self.lab.describer = None


def _kind(group: str, flags) -> str:
    if group in ("out_cache", "traceback", "local"):
        return group
    if "autograd" in flags:
        return "autograd_graph"
    if "optimizer" in flags:
        return "optimizer"
    if "param" in flags or "buffer" in flags:
        return "module"
    if "closure" in flags:
        return "closure"
    return group if group == "global" else "unknown"


def _fix(st: _PathState, kind: str, view) -> Tuple[str, int]:
    """(fix, cut): a concrete statement, and the chain position whose references it removes."""
    root = st.root
    if root.group in ("out_cache", "traceback", "local"):
        return root.fix, 0
    full = st.expr
    last = st.pos
    marks = st.marks
    if kind == "autograd_graph":
        gpos, owner, owner_is_elem, first_kind = marks["graph"]
        if owner is None:
            return f"{root.fix}  (or store .detach()/.item() instead of the tensor)", 0
        if owner_is_elem and first_kind == "index":
            return (f"{root.expr} = [v.detach() for v in {root.expr}]  (append loss.item() or loss.detach(), "
                    f"not loss: each element keeps its autograd graph)"), gpos
        if owner_is_elem and first_kind == "key":
            return (f"{root.expr} = {{k: v.detach() for k, v in {root.expr}.items()}}  "
                    f"(store .detach()/.item(), not the tensor with its graph)"), gpos
        return f"{owner} = {owner}.detach()  (or .item(): keep the value, not its autograd graph)", gpos
    if kind == "optimizer":
        p, e = marks["optimizer"]
        if e is not None:
            return f"del {e}  (or {e}.state.clear(): its state is as big as the parameters)", p
        return root.fix, 0
    if kind == "module":
        top_pos, top_e = marks.get("topmodule", (0, None))
        if "grad" in marks:
            g, tensor_e = marks["grad"]
            if top_e is not None:
                return f"{top_e}.zero_grad(set_to_none=True)", g
            return (f"{tensor_e}.grad = None", g) if tensor_e else (root.fix, 0)
        if "buffer" in st.flags and full is not None:
            return f"del {full}", last
        if top_e is not None:
            return f"del {top_e}  (parameters live as long as their module)", top_pos
        return root.fix, 0
    if kind == "closure":
        return root.fix + "  (the function's closure keeps it)", 0
    if "gen" in marks:
        gp, e = marks["gen"]
        if e is not None:
            return f"{e}.close()  (a suspended generator keeps its locals)", gp
    if view is not None and full is not None:
        vb, sb = view
        return (f"{full} = {full}.clone()  (a {_fmt_bytes(vb)} view pins the whole {_fmt_bytes(sb)} storage; "
                f"or del {full})"), last
    if full is not None and last > 0:
        if st.last_kind in ("key", "index", "attr"):
            return f"del {full}", last
        if st.last_kind == "grad":
            g, tensor_e = marks["grad"]
            return f"{tensor_e}.grad = None", last
    return root.fix, 0


def _fmt_bytes(n) -> str:
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_NEXT_CELL = "(released when the next cell runs)"
_HIDDEN_UNDERS = "get_ipython().user_ns_hidden.update(_='', __='', ___='')"


def _split_fix(fix: str) -> List[str]:
    """``a; b  (advice; more); c`` → the ``; ``-separated parts outside parentheses and quotes."""
    if "; " not in fix:
        return [fix] if fix else []
    parts, depth, quote, cur = [], 0, None, []
    i, n = 0, len(fix)
    while i < n:
        ch = fix[i]
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == ";" and depth == 0 and fix.startswith("; ", i):
            parts.append("".join(cur))
            cur = []
            i += 2
            continue
        cur.append(ch)
        i += 1
    parts.append("".join(cur))
    return [p for p in parts if p]


def _merge_fixes(fixes: Iterable[str]) -> str:
    """One statement list that releases every holder, in an order that runs: ``a; b; c``."""
    out: List[str] = []
    for f in fixes:
        for part in _split_fix(f) if f else ():
            if part and part not in out:
                out.append(part)
    if len(out) > 1 and _NEXT_CELL in out:
        out.remove(_NEXT_CELL)  # another holder needs a real fix; this one goes away by itself
    # %reset -f out first: it leaves user_ns_hidden's _, __, ___ behind, which the next part clears
    if _HIDDEN_UNDERS in out and "%reset -f out" in out:
        out.remove("%reset -f out")
        out.insert(out.index(_HIDDEN_UNDERS), "%reset -f out")
    # imports first, the collection last (after every reference was dropped)
    for mod in ("gc", "sys"):
        if any(p.startswith(mod + ".") for p in out):
            if f"import {mod}" in out:
                out.remove(f"import {mod}")
            out.insert(0, f"import {mod}")
    coll = [p for p in out if p.startswith("gc.collect()")]
    for p in coll:
        out.remove(p)
    out.extend(coll[:1])
    return "; ".join(out)


def fix_code(fix: str) -> str:
    """The runnable cell for a ``fix`` text: one statement per line, advice in parentheses dropped."""
    lines = []
    for part in _split_fix(fix):
        code = part.split("  (", 1)[0].strip()
        if code and not code.startswith("("):
            lines.append(code)
    return "\n".join(lines)


# -- the unreached: cycles and owners gc cannot see ----------------------------------------------
def _heap_tensors(keep, skip_ids: Optional[Dict[int, int]] = None) -> Tuple[Dict[int, Any], Dict[int, List[Any]]]:
    """Storages and Python tensors in the whole gc heap, by ``id(storage)``, for keys ``keep(key)`` accepts.

    One ``gc.get_objects()`` pass; types are classified once per type at C speed (``map(type, …)``).
    """
    objs = gc.get_objects()
    try:
        tset = set()
        for tp in set(map(type, objs)):
            h = _types.get(tp)
            if h is None:
                h = _classify(tp)
            if h == _TENSOR:
                tset.add(tp)
        if not tset:
            ts = []
        elif skip_ids:
            ts = [o for o in objs if type(o) in tset and id(o) not in skip_ids]  # the search saw those
        else:
            ts = [o for o in objs if type(o) in tset]
    finally:
        objs.clear()
        del objs
    storages: Dict[int, Any] = {}
    tensors: Dict[int, List[Any]] = {}
    try:
        for t in ts:
            try:
                s = t.untyped_storage()
                if s.data_ptr() == 0 or s.device.type == "meta":
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


def _module_dicts() -> Dict[int, str]:
    out = {}
    for name, mod in list(sys.modules.items()):
        d = getattr(mod, "__dict__", None) if mod is not None else None
        if isinstance(d, dict) and (id(d) not in out or name == "__main__"):
            out[id(d)] = name   # __main__ over its __mp_main__ alias
    return out


def _find(uf: List[int], a: int) -> int:
    while uf[a] != a:
        uf[a] = uf[uf[a]]
        a = uf[a]
    return a


def _internal_counts(members: List[Any], midx: Dict[int, int]) -> Dict[int, int]:
    internal: Dict[int, int] = {}
    for p in members:
        for c in gc.get_referents(p):
            n = midx.get(id(c))
            if n is not None:
                internal[n] = internal.get(n, 0) + 1
    return internal


def _unexplained(members: List[Any], internal: Dict[int, int], n: int) -> int:
    # getrefcount's argument and the members list each add one reference; nothing else of ours holds it
    return sys.getrefcount(members[n]) - 2 - internal.get(n, 0)


def _classify_groups(groups: List[List[Any]], ours: Set[int], max_levels: int = 6) -> List[_Fallback]:
    """Classify groups of unreached objects (the Python tensors and storage object of one storage each).

    One batched ``gc.get_referrers`` per level for all groups; groups whose referrer closures touch
    are merged (union-find). A closure that reaches a module's globals is a library global, one that
    reaches a frame is a live local, one whose reference counts are all explained by its own edges
    is an unreachable cycle, and anything else has an owner gc cannot see. ``groups`` is consumed.
    """
    G = len(groups)
    uf = list(range(G))
    members: List[Any] = []
    label = array("q")
    is_storage: Set[int] = set()
    child: Dict[int, int] = {}
    midx: Dict[int, int] = {}
    hits: Dict[int, Tuple[int, str]] = {}
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
        growing: Set[int] = set()
        for _level in range(max_levels):
            if not frontier:
                break
            fobjs = [members[n] for n in frontier]
            ours.add(id(fobjs))
            fids = {id(members[n]): n for n in frontier}
            refs = gc.get_referrers(*fobjs)
            fobjs.clear()
            ours.add(id(refs))
            new: List[int] = []
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
        cls_hits: Dict[int, Tuple[int, str]] = {}
        for g, h in hits.items():
            cls_hits.setdefault(_find(uf, g), h)
        cls_growing = {_find(uf, g) for g in growing}
        internal = _internal_counts(members, midx)
        cls_external: Dict[int, bool] = {}
        cls_size: Dict[int, int] = {}
        for n in range(len(members)):
            c = _find(uf, label[n])
            cls_size[c] = cls_size.get(c, 0) + 1
            if n in is_storage:
                continue  # torch preserves a storage's Python object from C++: its count is not ours to balance
            if _unexplained(members, internal, n) > 0:
                cls_external[c] = True
        out: List[_Fallback] = []
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
    return _Fallback(f"local in {co.co_name}() ({os.path.basename(co.co_filename)}:{r.f_lineno})", "local",
                     f"del the local in {co.co_name}() or return from it")


def _type_label(o) -> str:
    tp = type(o)
    mod = getattr(tp, "__module__", "")
    name = getattr(tp, "__qualname__", tp.__name__)
    return name if mod in ("builtins", "__main__") else f"{mod}.{name}"


# -- the known-storage registry (tensor-free) ----------------------------------------------------
@dataclass
class _Known:
    ref: Any
    data_ptr: int
    nbytes: int
    device: str
    dtype: Optional[str]
    shape: Optional[Tuple[int, ...]]
    alloc_seq: Optional[int]
    alloc_op: Optional[str]
    cell: Optional[int]
    source_file: Optional[str]
    source_line: Optional[int]
    storage_id: Optional[int]
    traced: bool


_KNOWN: Dict[int, _Known] = {}


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


# -- results -------------------------------------------------------------------------------------
class _Row:
    """One storage of a report: plain values only."""

    __slots__ = ("storage_id", "nbytes", "device", "dtype", "shape", "alloc_seq", "alloc_op", "cell", "source_file",
                 "source_line", "holder", "holder_kind", "fix", "root_label", "root_fix", "data_ptr")

    def __init__(self, holder: str, holder_kind: str, fix: str, root_label: str, root_fix: str, meta: dict):
        self.holder = holder
        self.holder_kind = holder_kind
        self.fix = fix
        self.root_label = root_label
        self.root_fix = root_fix
        g = meta.get
        self.storage_id = g("storage_id")
        self.nbytes = g("nbytes", 0)
        self.device = g("device")
        self.dtype = g("dtype")
        self.shape = g("shape")
        self.alloc_seq = g("alloc_seq")
        self.alloc_op = g("alloc_op")
        self.cell = g("cell")
        self.source_file = g("source_file")
        self.source_line = g("source_line")
        self.data_ptr = g("data_ptr", 0)

    @classmethod
    def plain(cls, holder, holder_kind, fix, root_label, root_fix, nbytes, data_ptr, device, dtype, shape) -> "_Row":
        """A row for a storage no trace or discovery recorded: no creation site."""
        r = cls.__new__(cls)
        r.holder, r.holder_kind, r.fix, r.root_label, r.root_fix = holder, holder_kind, fix, root_label, root_fix
        r.nbytes, r.data_ptr, r.device, r.dtype, r.shape = nbytes, data_ptr, device, dtype, shape
        r.storage_id = r.alloc_seq = r.alloc_op = r.cell = r.source_file = r.source_line = None
        return r


_DTYPE_STR: Dict[Any, str] = {}
_DEV_STR: Dict[Any, str] = {}


def _dev_str(x) -> str:
    d = x.device
    r = _DEV_STR.get(d)
    if r is None:
        r = _DEV_STR[d] = str(d)
    return r


def _tensor_meta(t) -> Tuple[str, Optional[str], Optional[Tuple[int, ...]]]:
    try:
        dt = t.dtype
        ds = _DTYPE_STR.get(dt)
        if ds is None:
            ds = _DTYPE_STR[dt] = str(dt).replace("torch.", "")
        return _dev_str(t), ds, tuple(t.shape)
    except Exception:
        return "unknown", None, None


def _view_of(t, s) -> Optional[Tuple[int, int]]:
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


def _holders(search: _Search, desc: "_Describer", key: int) -> Tuple[_Steps, str, str]:
    """(main description, holder text, complete fix) for a storage the search reached."""
    nodes = search.found[key]
    j = nodes[0]
    main = desc.describe(j, _view_of(search.order[j], search.storages[key]))
    extra_text: List[str] = []
    fixes = [main.fix]
    cross = search.cross
    if cross:
        # roots that also reach the path at or below the cut: the fix must name them too
        others: Set[int] = set()
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
    return main, text, (_merge_fixes(fixes) if len(fixes) > 1 else main.fix)


def _run_search(shell, user_ns, want: Optional[Dict[int, Any]], collect_all: bool,
                max_nodes: int = _Search.MAX_NODES_DEFAULT, frames: bool = True):
    root_objs, roots = _collect_roots(shell, user_ns, frames)
    try:
        search = _Search(root_objs, roots, want, collect_all, {n for n, _m in _user_modules()}, max_nodes)
    finally:
        root_objs.clear()
    search.run()
    return search


def _rows_for(search: _Search, key_meta: Dict[int, dict]) -> Tuple[List["_Row"], Set[int]]:
    """Rows for every storage the search reached; returns the reached keys."""
    desc = _Describer(search)
    rows: List[_Row] = []
    try:
        generic: List[int] = []
        by_parent: Dict[int, List[int]] = {}
        par, cross = search.par, search.cross
        for key, nodes in search.found.items():
            j = nodes[0]
            if len(nodes) == 1 and j not in cross and par[j] >= 0:
                by_parent.setdefault(par[j], []).append(key)
            else:
                generic.append(key)
        for p, keys in by_parent.items():
            if len(keys) < 16 or not _bulk_rows(search, desc, p, keys, key_meta, rows):
                generic.extend(keys)
        for key in generic:
            rows.append(_row_generic(search, desc, key, key_meta))
    finally:
        desc.clear()
    return rows, set(search.found)


def _row_generic(search: _Search, desc: "_Describer", key: int, key_meta: Dict[int, dict]) -> "_Row":
    s = search.storages[key]
    try:
        main, text, fix = _holders(search, desc, key)
        kind, root_label, root_fix = main.kind, main.root_label, main.root_fix
    except Exception as e:  # a path we cannot render must not hide the storage
        text, kind, fix = f"(path unavailable: {type(e).__name__}: {e})", "unknown", ""
        root_label, root_fix = text, ""
    return _make_row(search, key, s, key_meta.get(key), text, kind, fix, root_label, root_fix)


def _make_row(search, key, s, meta, text, kind, fix, root_label, root_fix) -> "_Row":
    if meta is None:
        first = search.order[search.found[key][0]]
        dev, dt, shape = _tensor_meta(first) if _types.get(type(first)) == _TENSOR else (_dev_str(s), None, None)
        k = _KNOWN.get(key)
        if k is not None and k.ref() is s:
            meta = _meta_from_known(k, s, dev, dt, shape)
        else:
            return _Row.plain(text, kind, fix, root_label, root_fix, s.nbytes(), s.data_ptr(), dev, dt, shape)
    return _Row(text, kind, fix, root_label, root_fix, meta)


def _bulk_rows(search: _Search, desc: "_Describer", p: int, keys: List[int], key_meta, rows) -> bool:
    """Many plain tensors directly in one global container (a list of 100k tensors): one description
    of the container, then a string per element. False when the path needs the general rules."""
    ps = desc.state(p)
    root = ps.root
    if root.group != "global" or ps.flags or ps.marks or ps.moddict is not None or ps.inst or ps.run:
        return False
    m = desc.lab.cache.get(p)
    if m is None:
        desc.lab.label(search.found[keys[0]][0])
        m = desc.lab.cache.get(p) or {}
    order, storages, found = search.order, search.storages, search.found
    base_text, base_expr = ps.text, ps.expr
    tensor_h = _TENSOR
    out = []
    for key in keys:
        t = order[found[key][0]]
        if _types.get(type(t)) != tensor_h:
            return False
        lab = m.get(id(t))
        if lab is None or (lab[0] != "index" and lab[0] != "key"):
            return False
        step = f"[{lab[1]}]"
        s = storages[key]
        expr = base_expr + step if base_expr is not None else None
        try:
            vb, sb = t.nbytes, s.nbytes()
        except Exception:
            return False
        if expr is None:
            fix = root.fix
        elif vb * 2 < sb:
            fix = (f"{expr} = {expr}.clone()  (a {_fmt_bytes(vb)} view pins the whole {_fmt_bytes(sb)} storage; "
                   f"or del {expr})")
        else:
            fix = f"del {expr}"
        out.append(_make_row(search, key, s, key_meta.get(key), base_text + step, "global", fix, root.label,
                             root.fix))
    rows.extend(out)
    return True


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


def _fallback_rows(storages: Dict[int, Any], tensors: Dict[int, List[Any]], key_meta: Dict[int, dict],
                   ours: Set[int]) -> List[_Row]:
    """Rows for storages no root reached; ``storages``/``tensors`` (from ``_heap_tensors``) are consumed."""
    rows: List[_Row] = []
    if not storages:
        return rows
    keys = list(storages)
    metas = []
    groups: List[List[Any]] = []
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


# -- public: the per-trace leak table ------------------------------------------------------------
def _rows_to_table(rows: List[_Row]) -> pa.Table:
    from operator import attrgetter

    rows = sorted(rows, key=attrgetter("nbytes"), reverse=True)  # stable: ties keep discovery order
    cols = [pa.array(list(map(attrgetter(f.name), rows)), type=f.type) for f in S.LEAKS]
    return pa.Table.from_arrays(cols, schema=S.LEAKS)


def _merge_same_buffer(rows: List[_Row]) -> List[_Row]:
    """Two storages over one buffer (two ``from_numpy`` of one array) are one row, bytes once."""
    by: Dict[Tuple[str, int, int], _Row] = {}
    out: List[_Row] = []
    for r in rows:
        if not r.data_ptr:
            out.append(r)
            continue
        k = (r.device, r.data_ptr, r.nbytes)
        first = by.get(k)
        if first is None:
            by[k] = r
            out.append(r)
        elif r.holder not in first.holder:
            first.holder += f"; also {r.holder} (same buffer)"
            first.fix = _merge_fixes([first.fix, r.fix])
    return out


def _clear_type_caches():
    _types.clear()
    _isa_cache.clear()
    _saved_attrs.clear()


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


def leak_table(live: Sequence[Any], *, shell=None, user_ns=None, frames: bool = True) -> pa.Table:
    """The LEAKS table for ``live`` (the storage tracker's ``LiveStorage`` records), largest first.

    Each storage still alive gets the shortest path from a root that holds it, its kind and a fix.
    Storages no root reaches are classified as ``cycle``, ``hidden_cpp_owner`` or a library global.
    """
    with _GcPaused():
        remember(live)  # find_leaks can then name the op, cell and line of these storages
        return _leak_table(live, shell, user_ns, frames)


def _leak_table(live, shell, user_ns, frames) -> pa.Table:
    if user_ns is None:
        shell = _get_shell(shell)
    ns = _user_namespace(shell, user_ns)
    want: Dict[int, Any] = {}
    key_meta: Dict[int, dict] = {}
    search = None
    unreached: Dict[int, Any] = {}
    tensors: Dict[int, List[Any]] = {}
    try:
        for rec in live:
            try:
                s = rec.ref()
            except Exception:
                s = None
            if s is None:
                continue
            try:
                ptr, nb = int(s.data_ptr()), int(s.nbytes())
            except Exception:
                continue
            if ptr == 0:
                continue
            key = id(s)
            want[key] = s
            key_meta[key] = dict(storage_id=rec.storage_id, nbytes=nb, device=rec.device, dtype=rec.dtype,
                                 shape=tuple(rec.shape) if rec.shape is not None else None,
                                 alloc_seq=rec.alloc_seq, alloc_op=rec.alloc_op, cell=rec.cell,
                                 source_file=rec.source_file, source_line=rec.source_line, data_ptr=ptr)
            del s
        if not want:
            return S.empty("leaks")
        search = _run_search(shell, ns, want, False, frames=frames)
        rows, reached = _rows_for(search, key_meta)
        missing = {k for k in want if k not in reached}
        if missing:
            unreached, tensors = _heap_tensors(missing.__contains__, search.idx)
        search.clear()
        if missing:
            for k in missing:
                unreached.setdefault(k, want[k])
            rows += _fallback_rows(unreached, tensors, key_meta, {id(want)})
        return _rows_to_table(_merge_same_buffer(rows))
    finally:
        # nothing of ours may outlive the call, not even in a traceback's frames
        if search is not None:
            search.clear()
        want.clear()
        unreached.clear()
        tensors.clear()


# -- public: the whole-notebook report -----------------------------------------------------------
@dataclass
class LeakGroup:
    """Storages with one holder and one fix (a list of losses and its graphs is one group)."""

    holder: str
    holder_kind: str
    fix: str
    n_storages: int
    nbytes: int
    by_device: Dict[str, int]
    cells: List[int]
    sources: List[str]


class LeakReport:
    """The live tensor storages of the notebook, grouped by holder; tensor-free and displayable.

    ``table`` is the LEAKS-schema table (one row per storage, largest first); ``groups`` the
    holders, largest first; ``totals`` the live bytes per device (each buffer counted once).
    """

    def __init__(self, table: pa.Table, groups: List[LeakGroup], totals: Dict[str, int], elapsed_s: float,
                 visited: int, notes: List[str]):
        self.table = table
        self.groups = groups
        self.totals = totals
        self.elapsed_s = elapsed_s
        self.visited = visited
        self.notes = notes

    def __len__(self):
        return self.table.num_rows

    @property
    def nbytes(self) -> int:
        return sum(self.totals.values())

    def df(self):
        return self.table.to_pandas()

    def to_text(self, max_groups: int = 30) -> str:
        if not self.groups:
            return "tensorscope leaks: no live tensor storage found" + "".join(f"\nnote: {n}" for n in self.notes)
        tot = ", ".join(f"{d}: {_fmt_bytes(b)}" for d, b in sorted(self.totals.items()))
        lines = [f"tensorscope leaks: {len(self.table)} live storages, {tot} "
                 f"(searched {self.visited} objects in {self.elapsed_s * 1e3:.0f} ms)"]
        for g in self.groups[:max_groups]:
            devs = ", ".join(f"{d} {_fmt_bytes(b)}" for d, b in sorted(g.by_device.items()))
            where = ""
            if g.cells:
                where = " · cell " + ",".join(str(c) for c in g.cells[:5])
            if g.sources:
                where += " · " + "; ".join(g.sources[:2])
            lines.append(f"  {_fmt_bytes(g.nbytes):>10}  [{g.holder_kind}] {g.holder}  ({g.n_storages} storage"
                         f"{'s' if g.n_storages != 1 else ''}: {devs}{where})")
            lines.append(f"{'':14}fix: {g.fix}")
        if len(self.groups) > max_groups:
            lines.append(f"  … {len(self.groups) - max_groups} more holders (see .table)")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_html(self, max_groups: int = 100) -> str:
        e = lambda s: html.escape("" if s is None else str(s), quote=True)  # noqa: E731
        tot = ", ".join(f"{d}: {_fmt_bytes(b)}" for d, b in sorted(self.totals.items())) or "nothing"
        parts = ['<div class="tensorscope-leaks" style="font-family:monospace;font-size:12px">',
                 f"<b>tensorscope leaks</b>: {len(self.table)} live storages, {e(tot)} "
                 f"<span style='color:#777'>(searched {self.visited} objects in {self.elapsed_s * 1e3:.0f} ms)</span>"]
        if self.groups:
            parts.append('<table style="border-collapse:collapse"><tr>'
                         + "".join(f'<th style="text-align:left;padding:1px 8px">{h}</th>'
                                   for h in ("bytes", "kind", "holder", "storages", "created", "fix")) + "</tr>")
            for g in self.groups[:max_groups]:
                created = ""
                if g.cells:
                    created = "cell " + ",".join(str(c) for c in g.cells[:5])
                if g.sources:
                    created += (" · " if created else "") + "; ".join(g.sources[:2])
                parts.append("<tr>" + "".join(
                    f'<td style="padding:1px 8px;vertical-align:top">{e(c)}</td>'
                    for c in (_fmt_bytes(g.nbytes), g.holder_kind, g.holder, g.n_storages, created, g.fix)) + "</tr>")
            parts.append("</table>")
            if len(self.groups) > max_groups:
                parts.append(f"<div>… {len(self.groups) - max_groups} more holders (see .table)</div>")
        for n in self.notes:
            parts.append(f'<div style="color:#a15c00">note: {e(n)}</div>')
        parts.append("</div>")
        return "".join(parts)

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": self.to_text(), "text/html": self.to_html()}

    def __repr__(self):
        return self.to_text()


def _totals(rows: List[_Row]) -> Dict[str, int]:
    """Live bytes per device, each byte once: intervals of overlapping buffers are merged."""
    by_dev: Dict[str, List[Tuple[int, int]]] = {}
    nop: Dict[str, int] = {}
    for r in rows:
        if r.data_ptr:
            by_dev.setdefault(r.device, []).append((r.data_ptr, r.data_ptr + r.nbytes))
        else:
            nop[r.device] = nop.get(r.device, 0) + r.nbytes
    out = dict(nop)
    for dev, iv in by_dev.items():
        iv.sort()
        total, cur_s, cur_e = 0, None, None
        for a, b in iv:
            if cur_e is None or a > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = a, b
            else:
                cur_e = max(cur_e, b)
        if cur_e is not None:
            total += cur_e - cur_s
        out[dev] = out.get(dev, 0) + total
    return out


def _groups(rows: List[_Row]) -> List[LeakGroup]:
    """One group per (kind, root): a list of losses with all its graphs is one holder."""
    by: Dict[Tuple[str, str], List[_Row]] = {}
    for r in rows:
        by.setdefault((r.holder_kind, r.root_label), []).append(r)
    groups = []
    for (kind, root_label), rs in by.items():
        fixes = list(dict.fromkeys(r.fix for r in rs))
        if len(fixes) == 1:
            fix = fixes[0]
        elif kind == "global":
            fix = rs[0].root_fix  # del losses[0], del losses[1] ... → del losses
        elif len(fixes) <= 3:
            fix = _merge_fixes(fixes)
        else:
            fix = _merge_fixes(fixes[:3]) + f"; … ({len(fixes) - 3} more, see .table)"
        holder = root_label
        if kind == "autograd_graph":
            holder += " (autograd graphs)"
        elif len(rs) == 1:
            holder = rs[0].holder
        g = LeakGroup(holder=holder, holder_kind=kind, fix=fix, n_storages=0, nbytes=0, by_device={}, cells=[],
                      sources=[])
        cells: Dict[int, None] = {}
        sources: Dict[str, None] = {}
        for r in rs:
            g.n_storages += 1
            g.nbytes += r.nbytes
            g.by_device[r.device] = g.by_device.get(r.device, 0) + r.nbytes
            if r.cell is not None:
                cells[r.cell] = None
            if r.source_line is not None:
                sources[f"{r.alloc_op or 'created'} at {os.path.basename(r.source_file or '?')}:{r.source_line}"] = None
            elif r.alloc_op:
                sources[r.alloc_op] = None
        g.cells = sorted(cells)
        g.sources = list(sources)
        groups.append(g)
    groups.sort(key=lambda g: -g.nbytes)
    return groups


def find_leaks(*, min_bytes: int = 0, device: Optional[str] = None, shell=None, user_ns=None,
               frames: bool = True, max_nodes: int = _Search.MAX_NODES_DEFAULT) -> LeakReport:
    """Every live tensor storage the notebook holds, grouped by holder, with the fix for each.

    Reachable storages come from one search from the user's roots (globals, ``Out``, the last
    exception, user modules, live frames); storages only a trace or cell-boundary discovery saw,
    and Python tensors no root reaches, are classified as cycles or owners gc cannot see. Works
    with tracing off; with tracing on, rows carry the creating op, cell and line.
    """
    with _GcPaused():
        return _find_leaks(min_bytes, device, shell, user_ns, max_nodes, frames)


def _find_leaks(min_bytes, device, shell, user_ns, max_nodes, frames) -> LeakReport:
    t0 = time.perf_counter()
    if user_ns is None:  # an explicit namespace means: search that, not some running shell
        shell = _get_shell(shell)
    ns = _user_namespace(shell, user_ns)
    want: Dict[int, Any] = {}
    search = None
    unreached: Dict[int, Any] = {}
    tensors: Dict[int, List[Any]] = {}
    notes: List[str] = []
    try:
        for key, k in list(_KNOWN.items()):
            s = k.ref()
            if s is not None:
                want[key] = s
            del s
        search = _run_search(shell, ns, want, True, max_nodes, frames)
        visited = len(search.order)
        if search.truncated:
            notes.append(f"search stopped after {max_nodes} objects: some holders may be missing")
        if search.errors:
            notes.append(f"{search.errors} objects could not be inspected")
        rows, reached = _rows_for(search, {})
        # Python tensors no root reaches (cycles, library state), and known storages no root reaches
        unreached, tensors = _heap_tensors(lambda k: k not in reached, search.idx)
        search.clear()
        for k, s in want.items():
            if k not in reached:
                unreached.setdefault(k, s)
        s = None
        rows += _fallback_rows(unreached, tensors, {}, {id(want)})
        rows = [r for r in _merge_same_buffer(rows) if r.nbytes >= min_bytes
                and (device is None or _device_match(r.device, device))]
        table = _rows_to_table(rows)
        groups = _groups(sorted(rows, key=lambda r: -r.nbytes))
        totals = _totals(rows)
        if _DISCOVERY is None and not any(k.traced for k in _KNOWN.values()):
            notes.append("no trace or cell-boundary discovery saw these tensors being made: creating cell/op unknown "
                         "(trace cells, or turn on cell-boundary discovery: tensorscope.tracking.leaks.enable_discovery())")
        return LeakReport(table, groups, totals, time.perf_counter() - t0, visited, notes)
    finally:
        # nothing of ours may outlive the call, not even in a traceback's frames
        if search is not None:
            search.clear()
        want.clear()
        unreached.clear()
        tensors.clear()


def _device_match(dev: str, want: str) -> bool:
    want = str(want)
    return dev == want or dev.split(":")[0] == want


# -- always-on discovery at cell boundaries (tracing off) ----------------------------------------
class BoundaryDiscovery:
    """Finds the storages each cell created, at the cell's end, in time proportional to what it made.

    ``pre_run_cell`` freezes the gc heap (``gc.freeze()``: O(1)); ``post_run_cell`` lists
    ``gc.get_objects()``, which then holds only objects created since, registers the storages of
    new tensors (and of the autograd graphs they carry), and unfreezes. A user who froze the heap
    before is respected: nothing is unfrozen then, and the scan covers what was created since
    their freeze. A full collection during the cell (``gc.collect()``) would skip frozen objects;
    a gc callback unfreezes first, so the user's collection frees what it always did.
    """

    MAX_GRAPH_NODES = 200_000
    RECHECK_USER_FREEZE = 16   # cells between (O(frozen)) looks at a user's own freeze

    def __init__(self, shell=None):
        self.shell = shell
        self._froze = False
        self._sentinel = None      # young object made right after our freeze: a later freeze moves it
        self._refreeze = False
        self._cb_installed = False
        self._user_frozen_until = -1
        self.cells = 0
        self.found = 0
        self.last_cost_s = 0.0
        self.last_scanned = 0
        self.errors = 0

    # events
    def pre_run_cell(self, info=None):
        try:
            if self._froze:
                self._unfreeze(None)
            # gc.get_freeze_count() walks the permanent generation: O(1) only when it is empty, so a
            # user's own freeze is looked at again only every few cells
            if self.cells < self._user_frozen_until:
                return
            if gc.get_freeze_count() != 0:
                self._user_frozen_until = self.cells + self.RECHECK_USER_FREEZE
                return
            self._freeze()
            if not self._cb_installed:
                gc.callbacks.append(self._gc_callback)
                self._cb_installed = True
        except Exception:
            self.errors += 1

    def post_run_cell(self, result=None):
        t0 = time.perf_counter()
        cell = getattr(result, "execution_count", None)
        if cell is None and self.shell is not None:
            cell = getattr(self.shell, "execution_count", None)
        sentinel_seen = None
        try:
            sentinel_seen = self._scan(cell)
        except Exception:
            self.errors += 1
        finally:
            if self._froze:
                self._unfreeze(sentinel_seen)
            self._remove_callback()
            self.cells += 1
            self.last_cost_s = time.perf_counter() - t0

    def _freeze(self):
        gc.freeze()
        self._froze = True
        self._sentinel = [None]   # lists are gc-tracked from birth: it sits in generation 0

    def _unfreeze(self, sentinel_seen):
        # If the cell froze the heap itself, our sentinel went into the permanent generation with
        # everything else: that freeze covers ours, so leave it in place.
        if sentinel_seen is None:
            sentinel_seen = self._sentinel_alive_unfrozen()
        if sentinel_seen:
            gc.unfreeze()
        self._froze = False
        self._sentinel = None

    def _sentinel_alive_unfrozen(self) -> bool:
        s = self._sentinel
        objs = gc.get_objects()
        try:
            return any(o is s for o in objs)
        finally:
            objs.clear()

    def _remove_callback(self):
        if self._cb_installed:
            try:
                gc.callbacks.remove(self._gc_callback)
            except ValueError:
                pass
            self._cb_installed = False

    def _gc_callback(self, phase, info):
        # A full collection must see every object, as it would without us: scan what the cell made
        # so far, unfreeze, and freeze again once the collection is over.
        try:
            if info.get("generation") != 2:
                return
            if phase == "start" and self._froze:
                seen = self._scan(getattr(self.shell, "execution_count", None) if self.shell is not None else None)
                self._unfreeze(seen)
                self._refreeze = bool(seen)
            elif phase == "stop" and self._refreeze:
                self._refreeze = False
                self._freeze()
        except Exception:
            self.errors += 1

    def _scan(self, cell) -> bool:
        """Register the storages of objects created since the freeze; True if our sentinel is among them."""
        objs = gc.get_objects()
        self.last_scanned = len(objs)
        tcache = _types
        new_tensors: List[Any] = []
        sentinel = self._sentinel
        seen = False
        try:
            for o in objs:
                if o is sentinel:
                    seen = True
                    continue
                h = tcache.get(type(o))
                if h is None:
                    h = _classify(type(o))
                if h == _TENSOR:
                    new_tensors.append(o)
            objs.clear()
            seen_nodes: Set[int] = set()
            nodes: List[Any] = []
            for t in new_tensors:
                self._note(t, cell)
                try:
                    gf = t.grad_fn
                except Exception:
                    gf = None
                if gf is not None and id(gf) not in seen_nodes:
                    seen_nodes.add(id(gf))
                    nodes.append(gf)
            self._walk_graph(nodes, seen_nodes, cell)
            nodes.clear()
        finally:
            objs.clear()
            new_tensors.clear()
            _clear_type_caches()
        return seen

    def _walk_graph(self, nodes: List[Any], seen: Set[int], cell):
        # saved outputs have no Python tensor of their own: only the graph reaches their storage
        k = 0
        while k < len(nodes) and k < self.MAX_GRAPH_NODES:
            node = nodes[k]
            k += 1
            for name in _saved_names(node):
                try:
                    raw = getattr(node, name)
                except Exception:
                    continue
                for sv in (raw if isinstance(raw, (list, tuple)) else (raw,)):
                    try:
                        d = sv.data if sv is not None else None
                    except Exception:
                        d = None
                    if d is not None and (_types.get(type(d)) or _classify(type(d))) == _TENSOR:
                        self._note(d, cell)
                    del d
            try:
                nxt = node.next_functions
            except Exception:
                nxt = ()
            for nf, _i in nxt:
                if nf is not None and id(nf) not in seen:
                    seen.add(id(nf))
                    nodes.append(nf)

    def _note(self, t, cell):
        try:
            s = t.untyped_storage()
        except Exception:
            return
        try:
            if s.data_ptr() == 0 or s.device.type == "meta" or id(s) in _KNOWN:
                return
            dev, dt, shape = _tensor_meta(t)
            if _register(s, dict(data_ptr=int(s.data_ptr()), nbytes=int(s.nbytes()), device=dev, dtype=dt,
                                 shape=shape, alloc_seq=None, alloc_op=None, cell=cell, source_file=None,
                                 source_line=None, storage_id=None), traced=False):
                self.found += 1
        finally:
            del s

    def close(self):
        if self._froze:
            self._unfreeze(None)
        self._remove_callback()


_DISCOVERY: Optional[BoundaryDiscovery] = None


def discovery() -> Optional[BoundaryDiscovery]:
    """The active cell-boundary discovery, if enabled."""
    return _DISCOVERY


def enable_discovery(shell=None) -> BoundaryDiscovery:
    """Register cell-boundary discovery on ``shell``'s pre/post_run_cell events (idempotent)."""
    global _DISCOVERY
    shell = _get_shell(shell)
    if _DISCOVERY is not None:
        return _DISCOVERY
    d = BoundaryDiscovery(shell)
    if shell is not None:
        shell.events.register("pre_run_cell", d.pre_run_cell)
        shell.events.register("post_run_cell", d.post_run_cell)
    _DISCOVERY = d
    return d


def disable_discovery(shell=None) -> None:
    global _DISCOVERY
    d = _DISCOVERY
    if d is None:
        return
    shell = _get_shell(shell) or d.shell
    if shell is not None:
        for ev, fn in (("pre_run_cell", d.pre_run_cell), ("post_run_cell", d.post_run_cell)):
            try:
                shell.events.unregister(ev, fn)
            except ValueError:
                pass
    d.close()
    _DISCOVERY = None
