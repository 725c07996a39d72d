"""What of tensorscope's only a garbage collection would free (tests/recording/test_no_cycles.py, and
inside a real kernel tests/magics/test_no_cycles_kernel.py)."""
from __future__ import annotations

import contextlib
import gc
import os
import types
from collections.abc import Iterator
from typing import Any

import tensorscope

_PKG = os.path.dirname(tensorscope.__file__)


def ours(o: Any) -> bool:
    """An object of tensorscope's own: an instance of one of its classes, or one of its functions,
    bound methods or frames."""
    if isinstance(o, types.FrameType):
        return o.f_code.co_filename.startswith(_PKG)
    if isinstance(o, types.MethodType):
        o = o.__func__
    if isinstance(o, types.FunctionType):
        return o.__code__.co_filename.startswith(_PKG)
    return (type(o).__module__ or "").startswith("tensorscope")


def name(o: Any) -> str:
    if isinstance(o, types.FrameType):
        return f"frame {o.f_code.co_name} ({os.path.basename(o.f_code.co_filename)}:{o.f_lineno})"
    f = getattr(o, "__func__", o)
    if isinstance(f, types.FunctionType):
        return f"function {f.__qualname__}"
    return type(o).__qualname__


@contextlib.contextmanager
def no_collector() -> Iterator[None]:
    """The collector off (after one collection) inside the block: what is freed there is freed by
    reference counting, as eager frees a tensor at ``del``."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def start() -> None:
    """Collect what is there now, then turn the collector off with DEBUG_SAVEALL: from here on what
    only a collection frees is kept in ``gc.garbage`` by the next ``found()``."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)


def found() -> list[str]:
    """The names of tensorscope's objects only a collection freed since ``start()`` (sorted); the
    collector is back on as it is by default."""
    try:
        gc.collect()
        return sorted({name(o) for o in gc.garbage if ours(o)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
