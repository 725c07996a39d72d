"""Leak finding: which tensor storages are alive, who holds them, and how to let go.

One batched breadth-first search from the *roots* a notebook user can name (their
globals, IPython's output cache, the last exception, user modules, live caller
frames) over ``gc.get_referents`` plus the edges only C++ knows about (``grad_fn``,
``.grad``, ``._base``, autograd saved tensors via ``_raw_saved_*`` whose ``.data``
never runs unpack hooks, ``next_functions``, ``AccumulateGrad`` variables, sparse
components, numpy ``.base``). Storages no root reaches are classified by a rarer
second pass (reference cycles, owners gc cannot see).

The parts, one module each, in the order data flows through them:

``classify``   per-type handlers, library-vs-user code, graph and frame helpers, gc pausing
``roots``      the named roots of a notebook and what releases each
``visited``    the search's visited set: nodes, parents, roots, storages found
``expand``     what the search follows from each kind of object (a holder's referents)
``search``     the batched search (``_Search``) from the roots to the storages
``paths``      holder paths: edge labels, path text, holder kind and the fix
``unreached``  storages no root reaches: cycles, library globals, owners gc cannot see
``known``      the tensor-free registry of storages traces and discovery saw being made
``rowset``     the rows of a report in columns (``_RowSet``), merged and turned into the LEAKS table
``holders``    one row at a time: a storage's holders, path text and fix
``bulk``       rows in bulk for many plain tensors of one container
``rows``       the rows of a search and ``leak_table`` (end of a trace)
``report``     ``find_leaks`` → ``LeakReport`` (data; ``render.leaks`` draws it)
``boundary``   always-on cell-boundary discovery (``gc.freeze()`` diffs, tracing off)

Nothing here keeps a tensor, a storage or a frame after a call returns: every
container that held one is cleared in ``finally`` blocks, and reports carry strings
and integers only.
"""
from __future__ import annotations

from .boundary import BoundaryDiscovery, disable_discovery, discovery, enable_discovery
from .known import _KNOWN, known_storages, remember  # noqa: F401  (_KNOWN: the registry, for tests and tools)
from .paths import fix_code
from .report import LeakGroup, LeakReport, find_leaks
from .rows import leak_table

__all__ = [
    "find_leaks", "leak_table", "LeakReport", "LeakGroup", "remember", "known_storages", "fix_code",
    "BoundaryDiscovery", "enable_discovery", "disable_discovery", "discovery",
]
