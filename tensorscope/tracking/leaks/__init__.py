"""Leak finding: which tensor storages are alive, who holds them, and how to let go.

One batched search from the roots a notebook user can name to the live storages, then one row
per storage with its holders, path and fix. Entry points: ``leak_table`` (end of a trace, from
``rows``), ``find_leaks`` -> ``LeakReport`` (``report``; drawn by ``render.leaks``), the
always-on discovery in ``boundary``. One module per part, in the order data flows: classify,
roots, visited/expand/search, paths, unreached, known, rowset/holders/bulk/rows, growth, report.

Rules and details: docs/development/leaks.md and docs/development/architecture.md#leaks-tracking
"""
from __future__ import annotations

from .boundary import BoundaryDiscovery, disable_discovery, discovery, enable_discovery
from .known import _KNOWN, known_storages, remember  # noqa: F401  (_KNOWN: the registry, for tests and tools)
from .paths import MODEL_STATE_FIX, OPTIMIZER_STATE_FIX, fix_code  # noqa: F401  (state "fixes": advice, no code)
from .report import LeakGroup, LeakReport, find_leaks
from .rows import leak_table

__all__ = [
    "find_leaks", "leak_table", "LeakReport", "LeakGroup", "remember", "known_storages", "fix_code",
    "BoundaryDiscovery", "enable_discovery", "disable_discovery", "discovery",
]
