"""Always-on discovery at cell boundaries (tracing off): which cell made which storage.

``BoundaryDiscovery`` freezes the gc heap before a cell and lists only the objects the
cell created after it (``gc.get_objects()`` skips the permanent generation), so its cost
follows what the cell made, not the heap. It never unfreezes what a user froze.
"""
from __future__ import annotations

import gc
import time
from typing import Any, Optional

from .classify import _TENSOR, _classify, _clear_type_caches, _saved_names, _tensor_meta, _types
from .known import _KNOWN, _register
from .roots import _get_shell


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
        #: the cell discovery was enabled in (its post_run_cell comes without our freeze): what exists by
        #: then was made before discovery, at an unknown cell
        self.enabled_in: Optional[int] = None
        self.undated_cells = 0

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
            if self._froze:
                sentinel_seen = self._scan(cell)
            else:
                # no freeze before this cell (discovery enabled inside it, or the user's own freeze): the
                # heap holds tensors of earlier cells too, and dating them with this cell would be wrong
                self.undated_cells += 1
                if self.cells == 0:
                    self.enabled_in = cell
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
        new_tensors: list[Any] = []
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
            seen_nodes: set[int] = set()
            nodes: list[Any] = []
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

    def _walk_graph(self, nodes: list[Any], seen: set[int], cell):
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
            if s.device.type == "meta" or s.data_ptr() == 0 or id(s) in _KNOWN:   # device first: fakes warn
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
