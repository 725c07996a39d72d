"""Shared tables and formatters: each defined once, for every layer above (foundation layer).

What lives here is used by more than one package and depends on nothing of tensorscope:
the dtype table, the op sets the builder and the analyses agree on, byte and time
formatters, HTML escaping, the running IPython shell (looked up without importing
IPython), the ``gc`` pause used around bulk list building, and the mixin that gives a
result object its notebook display. Importing it is cheap (standard library only).
"""
from __future__ import annotations

import gc
import html
import sys
from typing import Any, Optional

# -- dtypes ---------------------------------------------------------------------------------------
#: every dtype a table names, by its torch name: (kind, bits per element). kind is "float",
#: "complex", "int" (signed), "uint", "bool" or "quant". Packed sub-byte dtypes are left out
#: (their size is not ``bits // 8`` per element): they read as unknown (itemsize 0).
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("float", 64), "float32": ("float", 32), "float16": ("float", 16), "bfloat16": ("float", 16),
    "float8_e4m3fn": ("float", 8), "float8_e5m2": ("float", 8), "float8_e4m3fnuz": ("float", 8),
    "float8_e5m2fnuz": ("float", 8), "float8_e8m0fnu": ("float", 8),
    "complex128": ("complex", 128), "complex64": ("complex", 64), "complex32": ("complex", 32),
    "int64": ("int", 64), "int32": ("int", 32), "int16": ("int", 16), "int8": ("int", 8),
    "uint64": ("uint", 64), "uint32": ("uint", 32), "uint16": ("uint", 16), "uint8": ("uint", 8),
    "bool": ("bool", 8),
    "qint8": ("quant", 8), "quint8": ("quant", 8), "qint32": ("quant", 32), "quint4x2": ("quant", 8),
}
#: floating dtypes -> bits
FLOAT_BITS: dict[str, int] = {n: b for n, (k, b) in DTYPES.items() if k == "float"}
#: complex dtypes -> bits (both parts)
COMPLEX_BITS: dict[str, int] = {n: b for n, (k, b) in DTYPES.items() if k == "complex"}
#: integer dtypes -> (bits, signed)
INT_BITS: dict[str, tuple[int, bool]] = {n: (b, k == "int") for n, (k, b) in DTYPES.items() if k in ("int", "uint")}
#: dtypes that can hold a non-finite value (floating and complex)
INEXACT_DTYPES = frozenset(FLOAT_BITS) | frozenset(COMPLEX_BITS)


def itemsize(dtype: Optional[str]) -> int:
    """Bytes per element of a dtype name; 0 when unknown (or None)."""
    entry = DTYPES.get(dtype or "")
    return entry[1] // 8 if entry else 0


# -- op sets (short ATen names, without overload) -------------------------------------------------
#: ops that make a fresh copy of their input: a hidden copy when a call expected to be free
#: (``reshape``, ``contiguous``, ``to`` …) ran one
COPYING_OPS = frozenset({"clone", "reshape", "flatten", "contiguous", "reshape_as", "_to_copy", "ravel"})
#: ops that copy a source into an existing destination: a cast when the two dtypes differ
COPY_INTO_OPS = frozenset({"copy_", "copy", "_copy_from", "_copy_from_and_resize"})
#: bookkeeping ops that move no data (detach, alias, lifting a constant, reading a scalar): their rows
#: are flagged ``is_noise`` and are never the subject of a finding (``torch.tensor(...)`` runs
#: ``lift_fresh`` and, seen by the native engine only, ``detach_``)
NOISE_OPS = frozenset({"detach", "detach_", "lift_fresh", "alias", "lift_fresh_copy", "_local_scalar_dense"})
#: noise ops that lift a constant the program wrote in Python (``torch.tensor([inf])``) into a tensor
LIFT_OPS = frozenset({"lift_fresh", "lift_fresh_copy"})


# -- formatters -----------------------------------------------------------------------------------
def fmt_bytes(n: Optional[float]) -> str:
    """``384.0 KiB``; ``-`` for None."""
    if n is None:
        return "-"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024:
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} TiB"


def fmt_ns(n: Optional[float]) -> str:
    """``1.50 ms``; ``-`` for None."""
    if n is None:
        return "-"
    v = float(n)
    if v < 1e3:
        return f"{v:.0f} ns"
    if v < 1e6:
        return f"{v / 1e3:.1f} µs"
    if v < 1e9:
        return f"{v / 1e6:.2f} ms"
    return f"{v / 1e9:.2f} s"


def fmt_rate(x: float) -> str:
    """A count per step: ``20``, ``35.3`` (one decimal when it is not whole), ``1,200``."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def esc(s: object) -> str:
    """HTML-escaped text of any value (None is empty): every string that reaches HTML goes through it."""
    return html.escape("" if s is None else str(s), quote=True)


# -- the running IPython shell --------------------------------------------------------------------
def ipython_shell() -> Any:
    """The running IPython shell, or None; never imports IPython (it is slow and has side effects)."""
    ip_mod = sys.modules.get("IPython")
    if ip_mod is None:
        return None
    try:
        return ip_mod.get_ipython()
    except Exception:
        return None


# -- gc pause -------------------------------------------------------------------------------------
class NoGC:
    """Collections paused while many small lists are built: torch keeps ~166k objects
    tracked, and gen-2 passes triggered by the conversion cost 3-4x the conversion."""

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.enable()


# -- display --------------------------------------------------------------------------------------
class Displayable:
    """Notebook display of a result object: ``to_text()`` and ``to_html()`` (each drawn by its
    renderer in ``render/``) as one mime bundle; ``str()`` is the text."""

    def to_text(self) -> str:
        raise NotImplementedError

    def to_html(self) -> str:
        raise NotImplementedError

    def _repr_mimebundle_(self, include: object = None, exclude: object = None) -> dict[str, str]:
        return {"text/plain": self.to_text(), "text/html": self.to_html()}

    def __str__(self) -> str:
        return self.to_text()


class CompileCallbacks:
    """``start(*a)``/``end(*a)`` called around every torch.compile (Dynamo) compilation, registered on
    torch's callback handler until :meth:`remove`; nothing (``active`` False) when this torch has no
    such handler. Registration and removal never raise."""

    __slots__ = ("_cb",)

    def __init__(self, start: Any, end: Any) -> None:
        self._cb: Optional[tuple[Any, Any, Any]] = None
        try:
            import torch._dynamo.callback as dyn

            handler = dyn.callback_handler
            handler.register_start_callback(start)
            try:
                handler.register_end_callback(end)
            except Exception:
                handler.remove_start_callback(start)
                raise
            self._cb = (handler, start, end)
        except Exception:
            self._cb = None

    @property
    def active(self) -> bool:
        return self._cb is not None

    def remove(self) -> None:
        cb, self._cb = self._cb, None
        if cb is None:
            return
        handler, start, end = cb
        for fn, cbk in ((handler.remove_start_callback, start), (handler.remove_end_callback, end)):
            try:
                fn(cbk)
            except Exception:
                pass
