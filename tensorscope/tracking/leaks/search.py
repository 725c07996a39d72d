"""The batched search: one multi-source breadth-first search from every root at once.

Every storage met is charged to the first (shortest) path that reaches it; other
roots that reach the same object are remembered (``cross``) so the fix is complete.
Plain containment is explored first; optimizer internals and autograd-graph edges
(C++ edges: ``grad_fn``, saved tensors, ``next_functions``) wait until the queue is
empty, so a parameter reads as ``model.w`` rather than through a graph or ``opt.state``.
With targets only (a trace's leak table) the search stops once each has a holder.

This module is the search loop (``_Search.run``) and its driver (``_run_search``); the visited
set is ``visited``, the expansion of each kind of node ``expand``.
"""
from __future__ import annotations

import gc
from collections import OrderedDict
from typing import Any, Optional

from .classify import (
    _DEFER,
    _GENERIC,
    _PLAIN_UNTRACKED,
    _SKIP,
    _T,
    _TENSOR,
    _classify,
    _types,
    _untracked_interest,
    _user_modules,
)
from .expand import _Expand
from .roots import _collect_roots

#: exact container types whose emptiness is read without running user code (``not k``)
_EMPTY_KINDS = frozenset((dict, list, tuple, set, frozenset, OrderedDict))


class _Search(_Expand):
    """One multi-source BFS. Holds every visited object until ``clear()``."""

    BIG_CONTAINER = 1000
    BULK = 64   # containers with more children than this are enqueued with C-level passes (map/compress)
    RUN = 32    # this many plain containers side by side in the queue are expanded in one pass
    TENSOR_RUN = 16   # this many plain tensors side by side are visited in one pass

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
        empty_kinds = _EMPTY_KINDS
        expanded: set[int] = set()
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
                    if type(k) in empty_kinds and not k:
                        continue   # an empty container holds nothing: never on a path (modules' hook dicts)
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


def _run_search(shell, user_ns, want: Optional[dict[int, Any]], collect_all: bool,
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
