"""Locations as users know them: ``Cell In[3], line 11`` for a notebook cell, ``file.py:12`` otherwise.

IPython compiles each cell under a file name of its own (ipykernel: a temp file such as
``/tmp/ipykernel_4242/3848307078.py``; plain IPython: ``<ipython-input-3-…>``) and shows it in
tracebacks as ``Cell In[3], line 11`` using its compiler's file name → execution count map. A trace
keeps the part of that map its rows need (``metadata["cell_files"]``), so a saved trace renders
the same in another process. Importing this module is cheap and never imports IPython.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Optional

from ._common import ipython_shell

_IPYTHON_INPUT = re.compile(r"^<ipython-input-(\d+)-[0-9a-f]+>$")


def live_cell_files() -> dict[str, int]:
    """The running IPython's cell file → execution count map ({} outside IPython)."""
    shell = ipython_shell()
    if shell is None:
        return {}
    try:
        m = getattr(getattr(shell, "compile", None), "_filename_map", None)
        return dict(m) if m else {}
    except Exception:
        return {}


def cell_files_for(files: Iterable[Optional[str]]) -> dict[str, int]:
    """The entries of the live map for ``files`` (what a trace stores in its metadata)."""
    live = live_cell_files()
    if not live:
        return {}
    return {f: int(live[f]) for f in set(files) if f is not None and f in live}


def cell_number(file: Optional[str], cells: Optional[Mapping[str, int]] = None) -> Optional[int]:
    """The execution count of the cell compiled as ``file``, or None for a file outside the notebook."""
    if not file:
        return None
    if cells and file in cells:
        return int(cells[file])
    m = _IPYTHON_INPUT.match(file)
    if m:
        return int(m.group(1))
    live = live_cell_files() if cells is None else {}
    n = live.get(file)
    return int(n) if n is not None else None


def format_location(file: Optional[str], line: Optional[int] = None,
                    cells: Optional[Mapping[str, int]] = None) -> str:
    """``Cell In[3], line 11`` (a notebook cell), ``model.py:12`` (a file), ``line 12``, or ''.

    ``cells`` is a trace's ``metadata["cell_files"]``; without it the running IPython is asked.
    """
    n = cell_number(file, cells)
    if n is not None:
        return f"Cell In[{n}], line {line}" if line is not None else f"Cell In[{n}]"
    if file:
        base = os.path.basename(file)
        return f"{base}:{line}" if line is not None else base
    return f"line {line}" if line is not None else ""


def trace_cells(t) -> Optional[Mapping[str, int]]:
    """The cell map a Trace carries (None when it has none: the live shell is asked)."""
    try:
        return (t.metadata or {}).get("cell_files") or None
    except Exception:
        return None
