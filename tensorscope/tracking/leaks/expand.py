"""Expanding one node of the leak search: the referents of a holder, per kind of object.

``_Expand`` adds to the visited set (``visited._Visited``) what each kind of object leads to:
a tensor's storage, ``__dict__``, hooks, ``.grad``, ``._base`` and graph node (those as labeled,
deferred edges), many plain tensors at once (``_tensors``), an autograd node's saved tensors,
variable and ``next_functions``, a frame's locals (a running frame's through ``f_locals``),
functions, user classes, generators, numpy bases, sparse and wrapper tensors' parts, and the
children of many plain containers side by side in one pass (``_enqueue_run``).
"""
from __future__ import annotations

import gc
import types
from collections.abc import Sequence
from itertools import chain, compress, repeat
from operator import attrgetter, is_
from typing import Any

from .classify import (
    _CLASS,
    _FRAME,
    _FUNC,
    _GEN,
    _NDARRAY,
    _NODES,
    _PYNODE,
    _STORAGE,
    _T,
    _TB,
    _TENSOR,
    _classify,
    _is_user_class,
    _live_frame_locals,
    _node_name,
    _saved_names,
    _types,
)
from .visited import _Visited


class _Expand(_Visited):
    """What the search follows from each kind of node (``_special``, the tensor and graph edges)."""

    def _special(self, o, h, i):
        if h == _TENSOR:
            return self._tensor(o, i)
        if h in _NODES:
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

    def _tensor_refs(self, t, i):
        """The objects a tensor refers to (``__dict__``, hooks, subclass state: njt._values reads better
        than njt._base): a graph node goes on the labeled, deferred edge (a tensor Python owns alone
        traverses its grad_fn), anything else the gc tracks is enqueued."""
        for k in gc.get_referents(t):
            h = _types.get(type(k))
            if h is None:
                h = _classify(type(k))
            if h in _NODES:
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
        parts: list[tuple[str, Any]] = []
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
