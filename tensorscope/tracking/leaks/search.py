"""The batched search: one multi-source breadth-first search from every root at once.

Every storage met is charged to the first (shortest) path that reaches it; other
roots that reach the same object are remembered (``cross``) so the fix is complete.
Plain containment is explored first; optimizer internals and autograd-graph edges
(C++ edges: ``grad_fn``, saved tensors, ``next_functions``) wait until the queue is
empty, so a parameter reads as ``model.w`` rather than through a graph or ``opt.state``.
With targets only (a trace's leak table) the search stops once each has a holder.
"""
from __future__ import annotations

import gc
import types
from array import array
from itertools import chain, compress, repeat
from operator import attrgetter, is_, not_, or_
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, cast

from .classify import (
    _CLASS,
    _DEFER,
    _FRAME,
    _FUNC,
    _GEN,
    _GENERIC,
    _NDARRAY,
    _NODE,
    _PLAIN_UNTRACKED,
    _PYNODE,
    _SKIP,
    _STORAGE,
    _T,
    _TB,
    _TENSOR,
    _classify,
    _is_user_class,
    _live_frame_locals,
    _node_name,
    _other_threads_frames,
    _running_frames,
    _saved_names,
    _types,
    _untracked_interest,
    _untracked_interest_type,
    _user_modules,
)
from .roots import _collect_roots, _Root


# -- the batched search --------------------------------------------------------------------------
class _Search:
    """One multi-source BFS. Holds every visited object until ``clear()``."""

    MAX_NODES_DEFAULT = 20_000_000
    BIG_CONTAINER = 1000
    BULK = 64   # containers with more children than this are enqueued with C-level passes (map/compress)
    RUN = 32    # this many plain containers side by side in the queue are expanded in one pass
    TENSOR_RUN = 16   # this many plain tensors side by side are visited in one pass

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
        self.running: Set[int] = {id(f) for f in _running_frames()} | _other_threads_frames()
        self.max_nodes = max_nodes
        self.truncated = False
        self.errors = 0
        self.n_tensors = 0                      # tensor nodes visited
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
        plain = _PLAIN_UNTRACKED
        expanded: Set[int] = set()
        bulk = self.BULK
        tensor = _T().Tensor
        no_run = 0
        run_min, tensor_run_min = self.RUN, self.TENSOR_RUN
        i = 0
        while True:
            while i < len(order):
                o = order[i]
                tp = type(o)
                h = tcache.get(tp)
                if h is None:
                    h = classify(tp)
                if h == _GENERIC and not big and i >= no_run:
                    # plain containers side by side (the 50k tuples of a dataset): one pass for all
                    end = i + 1
                    n_order = len(order)
                    while end < n_order and tcache.get(type(order[end])) == _GENERIC:
                        end += 1
                    if end - i >= run_min:
                        self._enqueue_run(i, end)
                        if len(order) > max_nodes:
                            self.truncated = True
                            return
                        i = end
                        continue
                    no_run = end   # a short run: its other members need not look ahead again
                if h == _GENERIC:
                    kids = get_referents(o)
                    if big and len(kids) > big and i not in expanded:
                        # targets only: look into small containers first, big ones (a dataset's
                        # million items) only if some target is still missing afterwards
                        self._deferred_objs.append(i)
                        i += 1
                        continue
                    if len(kids) > bulk:
                        self._enqueue_many(i, kids)
                        if len(order) > max_nodes:
                            self.truncated = True
                            return
                        i += 1
                        continue
                elif h == _TENSOR and tp is tensor:
                    # plain tensors side by side in the queue (a list of 100k tensors, the items of
                    # 50k (x, y) pairs): one C-level pass per attribute instead of a call per tensor
                    end = i + 1
                    n_order = len(order)
                    while end < n_order and type(order[end]) is tensor:
                        end += 1
                    if end - i < tensor_run_min:
                        for k in range(i, end):
                            self._tensor_guarded(order[k], k)
                    else:
                        self._tensors(i, end)
                    if self.n_want and not self.complete and len(self.found) >= self.n_want:
                        self.complete = True
                    if len(order) > max_nodes:
                        self.truncated = True
                        return
                    i = end
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
                    if self.n_want and not self.complete and len(self.found) >= self.n_want:
                        # every target has its (shortest) path: the rest of the heap cannot shorten it,
                        # but the user's other holders (an autograd graph that also saved it) must still
                        # be named, or the fix frees nothing: finish the queue and the graph edges, and
                        # leave only the big containers and optimizers deferred so far
                        self.complete = True
                oi = own[i]
                for k in kids:
                    if not is_tracked(k):
                        # ints and strings of the user's data: never a holder (numpy arrays are, untracked)
                        tk = type(k)
                        if tk in plain:
                            continue
                        if not _untracked_interest(k):
                            plain.add(tk)
                            continue
                    kid = id(k)
                    j = idx.get(kid)
                    if j is None:
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
            if self.complete:
                self._deferred_objs.clear()
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

    def _enqueue_many(self, i: int, kids: List[Any], pars: Optional[List[int]] = None) -> None:
        """Enqueue children with C-level passes, as the per-child loop would: a child met before (or
        listed twice) only notes this root as another holder. ``kids`` are node ``i`` 's children, or,
        with ``pars`` (the parent of each), those of several nodes."""
        tracked = list(map(gc.is_tracked, kids))
        if tracked.count(True) != len(kids):
            # untracked children: ints and strings are never holders; numpy arrays (untracked) are
            plain = _PLAIN_UNTRACKED
            wanted = set()
            for tp in set(map(type, compress(kids, map(not_, tracked)))):
                if tp not in plain:
                    if _untracked_interest_type(tp):
                        wanted.add(tp)
                    else:
                        plain.add(tp)
            if wanted:
                tracked = list(map(or_, tracked, map(wanted.__contains__, map(type, kids))))
            kids = list(compress(kids, tracked))
            if pars is not None:
                pars = list(compress(pars, tracked))
        del tracked
        n = len(kids)
        if not n:
            return
        idx, own = self.idx, self.own
        ids = list(map(id, kids))
        js = list(map(idx.get, ids))
        dup_of: Dict[int, int] = {}
        start = len(self.order)
        if js.count(None) == n:
            # none met before: register them all; the index grew by n unless one is listed twice
            before = len(idx)
            idx.update(zip(ids, range(start, start + n)))
            if len(idx) - before == n:
                self._adopt(i, kids, pars, own)
                return
            for x in ids:   # undo, and take the careful way below
                idx.pop(x, None)
        # some met before (another root holds them too) or listed twice (the first is the node)
        cross = self.cross
        keep = [j is None for j in js]
        for k in compress(range(n), map(not_, keep)):   # met before: another root holds it too
            j, pk = cast(int, js[k]), (i if pars is None else pars[k])
            if own[j] != own[pk] and j != pk:
                c = cross.get(j)
                if c is None:
                    cross[j] = {own[pk]}
                else:
                    c.add(own[pk])
        if len(set(ids)) != n:   # listed twice: the first is the node, a later one another holder
            first: Dict[int, int] = {}
            for k, (x, new) in enumerate(zip(ids, keep)):
                if new:
                    f = first.get(x)
                    if f is None:
                        first[x] = k
                    else:
                        keep[k] = False
                        if pars is not None:
                            dup_of[k] = f
        if dup_of:
            dup_pars = {k: cast(List[int], pars)[k] for k in dup_of}
        kids = list(compress(kids, keep))
        ids = list(compress(ids, keep))
        if pars is not None:
            kept_at = list(compress(range(n), keep))
            pars = list(compress(pars, keep))
        n = len(kids)
        if not n:
            return
        del js
        order = self.order
        start = len(order)
        idx.update(zip(ids, range(start, start + n)))
        self._adopt(i, kids, pars, own)
        if dup_of:
            node_of = {k: start + m for m, k in enumerate(kept_at)}
            for k, f in dup_of.items():
                j, pk = node_of[f], dup_pars[k]
                if own[j] != own[pk]:
                    self.cross.setdefault(j, set()).add(own[pk])

    def _enqueue_run(self, a: int, b: int) -> None:
        """The children of nodes ``a:b`` (plain containers side by side in the queue: 50k (x, y) pairs,
        45k small dicts) in one pass: ``get_referents`` per node at C level, one ``_enqueue_many``."""
        refs = list(map(gc.get_referents, self.order[a:b]))
        lens = list(map(len, refs))
        kids = list(chain.from_iterable(refs))
        del refs
        self._enqueue_many(-1, kids, list(chain.from_iterable(map(repeat, range(a, b), lens))))

    def _tensors(self, a: int, b: int) -> None:
        """``_tensor`` for the nodes ``a:b``, all plain ``torch.Tensor`` s, in bulk: a tensor with
        anything to follow (a ``__dict__``, hooks, a graph, ``.grad``, ``._base``) gets the
        per-tensor treatment in order; the rest only have their storage recorded."""
        ts = self.order[a:b]
        tensor = _T().Tensor
        try:
            if any(map(attrgetter("is_meta"), ts)):
                raise TypeError("meta tensors: per tensor")
            # one list for all referents: a tensor with nothing but its class has nothing to follow
            refs = gc.get_referents(*ts)
            # by identity: list.count and `in` compare with ==, which a tensor answers with an op
            plain_refs = all(map(is_, refs, repeat(tensor)))
            del refs
            rg = list(map(attrgetter("requires_grad"), ts))
            anyrg = True in rg
            # .grad of a tensor that requires grad may warn (a non-leaf): those are per tensor anyway
            grads = [None if r else t.grad for t, r in zip(ts, rg)] if anyrg else list(map(attrgetter("grad"), ts))
            bases = list(map(attrgetter("_base"), ts))
            if not plain_refs:
                busy: Sequence[int] = range(a, b)
            elif anyrg or not all(map(is_, grads, repeat(None))) or not all(map(is_, bases, repeat(None))):
                busy = [a + k for k, (r, g, base) in enumerate(zip(rg, grads, bases))
                        if r or g is not None or base is not None]
            else:
                busy = ()
            del grads, bases, rg
            storages: Sequence[Any] = list(map(tensor.untyped_storage, ts))
        except Exception:
            for k in range(a, b):
                self._tensor_guarded(self.order[k], k)
            return
        self.n_tensors += b - a
        found, want, collect_all, keep = self.found, self.want, self.collect_all, self.storages
        keys: Sequence[int] = list(map(id, storages))
        sel: Sequence[int] = range(a, b)
        if not collect_all:
            hit = list(map(want.__contains__, keys)) if want else [False] * len(keys)
            if True in hit:
                sel = list(compress(sel, hit))
                keys = list(compress(keys, hit))
                storages = list(compress(storages, hit))
            else:
                sel, keys, storages = (), (), ()
        if sel:
            ptrs = list(map(_T().UntypedStorage.data_ptr, storages))
            if 0 not in ptrs and not any(map(found.__contains__, keys)):
                # one tensor per storage, none met before (a list of 100k tensors): two dict updates,
                # undone when the storages were not all distinct (views: the careful loop below)
                before = len(found)
                found.update(zip(keys, map(list, zip(sel))))
                if len(found) - before == len(keys):
                    keep.update(zip(keys, storages))
                    sel = ()
                else:
                    for key in keys:
                        found.pop(key, None)
            for k, key, s, ptr in zip(sel, keys, storages, ptrs):
                lst = found.get(key)
                if lst is None:
                    if ptr:  # zero bytes: nothing to leak
                        found[key] = [k]
                        keep[key] = s
                elif len(lst) < 8:
                    lst.append(k)
        del storages
        order = self.order
        for k in busy:
            try:
                self._tensor_edges(order[k], k)
            except Exception:
                self.errors += 1

    def _tensor_guarded(self, t, i):
        try:
            self._tensor(t, i)
        except Exception:
            self.errors += 1

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
            kids = [k for k in gc.get_referents(o) if type(k) is not types.FrameType and k is not o.f_globals
                    and k is not o.f_builtins and type(k) is not types.CodeType]
            if id(o) in self.running:  # gc does not see a running frame's locals: its thread owns them
                kids.extend(v for _n, v in _live_frame_locals(o))
            return kids
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
            if not self.collect_all and key not in (self.want or ()):
                return
            try:
                # zero bytes, meta and fake storages: nothing to leak (device first: a fake
                # tensor's meta storage warns when asked for its pointer)
                if s.device.type == "meta" or s.data_ptr() == 0:
                    return
            except Exception:
                return
            self.found[key] = [node]
            self.storages[key] = s
        elif len(lst) < 8:
            lst.append(node)

    def _tensor(self, t, i):
        self.n_tensors += 1
        self._tensor_refs(t, i)
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
                    try:   # device first: a fake tensor's (meta) storage warns when asked for its pointer
                        ptr = 0 if s.device.type == "meta" else s.data_ptr()
                    except Exception:
                        ptr = 0
                    if ptr:  # zero bytes, meta and fake storages have none: nothing to leak
                        self.found[key] = [i]
                        self.storages[key] = s
            elif len(lst) < 8:
                lst.append(i)
            del s
        self._tensor_grad_edges(t, i)
        return ()

    def _adopt(self, i: int, kids: List[Any], pars: Optional[List[int]], own: Any) -> None:
        """Append ``kids`` as new nodes: their parent is ``i`` (or ``pars[k]`` each), their root its."""
        n = len(kids)
        self.order.extend(kids)
        if pars is None:
            self.par.extend(repeat(i, n))
            own.extend(repeat(own[i], n))
        else:
            self.par.extend(pars)
            own.extend(list(map(own.__getitem__, pars)))

    def _tensor_refs(self, t, i):
        """The objects a tensor refers to (``__dict__``, hooks, subclass state: njt._values reads better
        than njt._base): a graph node goes on the labeled, deferred edge (a tensor Python owns alone
        traverses its grad_fn), anything else the gc tracks is enqueued."""
        for k in gc.get_referents(t):
            h = _types.get(type(k))
            if h is None:
                h = _classify(type(k))
            if h == _NODE or h == _PYNODE:
                self._deferred_edges.append((i, k, ("grad_fn", _node_name(k))))
            elif gc.is_tracked(k) or h == _NDARRAY:
                self._enqueue(i, k, None)

    def _tensor_edges(self, t, i):
        """What ``_tensor`` follows besides the storage, in the same order."""
        self._tensor_refs(t, i)
        self._tensor_grad_edges(t, i)

    def _tensor_grad_edges(self, t, i):
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


def _run_search(shell, user_ns, want: Optional[Dict[int, Any]], collect_all: bool,
                max_nodes: int = _Search.MAX_NODES_DEFAULT, frames: bool = True):
    user_modules = _user_modules()
    root_objs, roots = _collect_roots(shell, user_ns, frames, user_modules)
    try:
        search = _Search(root_objs, roots, want, collect_all, {n for n, _m in user_modules}, max_nodes)
    finally:
        root_objs.clear()
        user_modules.clear()
    search.run()
    return search
