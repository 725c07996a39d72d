"""The visited set of the batched leak search: which objects were met, how, and from which root.

``_Visited`` is the bookkeeping of one multi-source breadth-first search: every node in
discovery order (``order``), its parent (``par``) and root (``own``), ``id(object) -> node``
(``idx``), the other roots that reach a node (``cross``), the label of a C++ edge that created
one (``synth``) and the storages found, each with the tensor nodes that hold it. Enqueueing
a child, alone or many with C-level passes, and recording a storage happen here; how each kind
of object is expanded is ``expand``, the search loop ``search``.
"""
from __future__ import annotations

import gc
from array import array
from itertools import compress, repeat
from operator import not_, or_
from typing import Any, Optional, cast

from .classify import _PLAIN_UNTRACKED, _other_threads_frames, _running_frames, _untracked_interest_type
from .roots import _Root


class _Visited:
    """The nodes of one multi-source BFS. Holds every visited object until ``clear()``."""

    MAX_NODES_DEFAULT = 20_000_000

    def __init__(self, root_objs: list[Any], roots: list[_Root], want: Optional[dict[int, Any]],
                 collect_all: bool, user_modnames: set[str], max_nodes: int = MAX_NODES_DEFAULT):
        self.roots = roots
        self.order: list[Any] = []
        self.par = array("q")
        self.own = array("q")
        self.idx: dict[int, int] = {}
        self.cross: dict[int, set[int]] = {}      # node -> other roots that reach it
        self.synth: dict[int, tuple[str, str]] = {}  # node -> label of a C++ edge that created it
        self.want = want                        # id(storage) -> storage (targets) or None
        self.collect_all = collect_all
        self.found: dict[int, list[int]] = {}   # id(storage) -> tensor nodes holding it (first = primary)
        self.storages: dict[int, Any] = {}      # id(storage) -> storage (kept alive during the search)
        self.user_modnames = user_modnames
        self.running: set[int] = {id(f) for f in _running_frames()} | _other_threads_frames()
        self.max_nodes = max_nodes
        self.truncated = False
        self.errors = 0
        self.n_tensors = 0                      # tensor nodes visited
        self._deferred_objs: list[int] = []
        self._deferred_edges: list[tuple[int, Any, tuple[str, str]]] = []
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

    def _enqueue(self, parent: int, child, label: Optional[tuple[str, str]]):
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

    def _add_synth(self, parent: int, child, label: tuple[str, str], defer: bool = False):
        """A C++ edge: its label is known now, so no search for it later. Graph edges wait their turn."""
        if child is None:
            return
        if defer:
            self._deferred_edges.append((parent, child, label))
        else:
            self._enqueue(parent, child, label)

    def _enqueue_many(self, i: int, kids: list[Any], pars: Optional[list[int]] = None) -> None:
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
        dup_of: dict[int, int] = {}
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
            first: dict[int, int] = {}
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
            dup_pars = {k: cast(list[int], pars)[k] for k in dup_of}
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

    def _adopt(self, i: int, kids: list[Any], pars: Optional[list[int]], own: Any) -> None:
        """Append ``kids`` as new nodes: their parent is ``i`` (or ``pars[k]`` each), their root its."""
        n = len(kids)
        self.order.extend(kids)
        if pars is None:
            self.par.extend(repeat(i, n))
            own.extend(repeat(own[i], n))
        else:
            self.par.extend(pars)
            own.extend(list(map(own.__getitem__, pars)))

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
