"""Recording engines: who observes the ATen ops of a trace (the seam is ``engines/base.py``).

* ``python`` (``engines/python/``) -- a TorchDispatchMode appends rows to the recorder.
* ``native`` (``engines/native/``) -- ``native/engine.cpp``'s RecordFunction observer.

``select_engine(options)`` says which one a trace records with and why; ``make_engine`` makes it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

from .base import Engine, EngineChoice, exit_mode
from .native import (
    _FLOPS,
    PACKED_COLUMNS,
    ROW_DTYPE,
    EngineBusy,
    NativeEngine,
    NativeScreen,
    NativeStorages,
    abi_mismatch,
)
from .python import PythonEngine

if TYPE_CHECKING:
    from ...options import TraceOptions

__all__ = ["Engine", "EngineChoice", "NativeEngine", "NativeScreen", "NativeStorages", "PythonEngine", "ROW_DTYPE",
           "PACKED_COLUMNS", "exit_mode", "make_engine", "select_engine", "unobserved"]

_T = TypeVar("_T")
assert _FLOPS is not None   # re-exported: the per-process FLOP formula cache (tests read it)


def _native_ext(wait: bool = True) -> tuple[Any, str]:
    from ...native import FORCE_ENV, build_pending, engine, forced_fallback

    if forced_fallback():
        return None, f"{FORCE_ENV}=1 forces the python engine"
    pending = build_pending()   # not built: a background process compiles it; this trace does not wait
    if pending is not None:
        return None, pending
    ext, reason = engine(wait=wait)
    if ext is not None:
        problem = abi_mismatch(ext)
        if problem:
            return None, f"native engine ABI mismatch (native/abi.h vs recording/engines/native/): {problem}"
    return ext, reason


def select_engine(options: TraceOptions) -> EngineChoice:
    """The engine a trace with ``options`` records with, and why (a thread-local observer works on
    any thread)."""
    want = getattr(options, "engine", "auto") or "auto"
    if want == "python":
        return EngineChoice("python", "engine='python' was asked for")
    if options.numerics:
        return EngineChoice("python", "numerics= runs its shadow computations in the python engine's dispatch mode")
    ext, reason = _native_ext(wait=True)
    if ext is None:
        return EngineChoice("python", f"native engine unavailable: {reason}")
    if ext.active():
        return EngineChoice("python", "the native engine is recording another trace in this process (another thread)")
    return EngineChoice("native", reason, ext)


def make_engine(choice: EngineChoice) -> Engine:
    """The engine of ``choice``; the python engine when the native one was chosen but another trace
    of this process claimed the observer meanwhile (the choice then says so)."""
    if choice.name == "native":
        try:
            return NativeEngine(choice)
        except EngineBusy as e:
            choice = EngineChoice("python", str(e))
    return PythonEngine(choice)


def unobserved(fn: Callable[[], _T]) -> _T:
    """``fn()`` with RecordFunction off on this thread when the native engine is loaded (so neither
    torch.profiler nor an observer sees tensorscope's own probe ops); else just ``fn()``."""
    from ...native import loaded_engine

    ext = loaded_engine()
    if ext is not None and hasattr(ext, "unobserved"):
        out: _T = ext.unobserved(fn)
        return out
    return fn()
