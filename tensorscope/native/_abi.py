"""The native ABI (abi.h) as Python reads it from a loaded library: row layouts as numpy dtypes,
flags, tags, packed-column constants.

Every library that includes abi.h exports the same description (``abi()``); this module reads it
from whichever of them this process has loaded and never compiles anything. Without a loaded
library there is no C layout to read: the Python side reads ``abi_layout.py``, generated from abi.h
by tools/gen_abi.py (``make abi``; tests/native/test_abi_layout.py fails while it is stale); the
native engine refuses a loaded library whose ABI differs from it (``engines.native.abi_mismatch``),
and tests/native/test_abi.py checks that they agree field for field.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

from . import _build

#: the libraries whose abi() is read, in this order of preference
_LIBS = ("engine", "fmode", "hooks")
#: the row layouts abi_dtype() builds: kind -> (fields key, size key)
_ROWS = {"row": ("row", "row_size"), "call": ("call", "call_size")}


def abi(lib: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The ABI dict of the loaded library ``lib`` ("engine", "fmode", "hooks"), or of the first one
    loaded when ``lib`` is None; None when it is not loaded (nothing is compiled or loaded here)."""
    for kind in ((lib,) if lib is not None else _LIBS):
        mod = _build._STATES[kind].module
        if mod is not None and hasattr(mod, "abi"):
            return dict(mod.abi())
    return None


def fields_dtype(fields: list[tuple[str, int, int, str]], size: int) -> Any:
    """A numpy structured dtype laid out as the C struct: ``fields`` are (name, offset, size, kind)."""
    import numpy as np

    order = "<" if sys.byteorder == "little" else ">"
    return np.dtype({"names": [f[0] for f in fields], "formats": [f"{order}{f[3]}{f[2]}" for f in fields],
                     "offsets": [f[1] for f in fields], "itemsize": size})


def abi_dtype(kind: str, lib: Optional[str] = None) -> Any:
    """The numpy dtype of a C row, built from the loaded library's layout: ``"row"`` (the engine's
    ops row) or ``"call"`` (the function mode's calls row); None when no library is loaded."""
    if kind not in _ROWS:
        raise ValueError(f"unknown row kind {kind!r} (expected one of {sorted(_ROWS)})")
    d = abi(lib)
    if d is None:
        return None
    fields_key, size_key = _ROWS[kind]
    return fields_dtype(d[fields_key], d[size_key])


def abi_flags(lib: Optional[str] = None) -> Optional[dict[str, int]]:
    """The engine's row flags (``{"F_BACKWARD": 8, ...}``) from the loaded library; None when none is loaded."""
    d = abi(lib)
    return None if d is None else dict(d["flags"])
