"""User source line of a torch-level call: a cheap frame walk, cached per code object.

Walk ``sys._getframe()`` outwards and stop at the first frame whose file is not
inside torch, tensorscope or the standard library's wrappers: that is the
user's code (an IPython cell file, an earlier cell's function, a script).
Never ``inspect.stack()`` (milliseconds) and never keep the frame objects.
"""
from __future__ import annotations

import os
import sys
from types import CodeType, FrameType, TracebackType
from typing import Optional

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OUR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_WRAPPERS = tuple(os.path.join(os.path.dirname(os.__file__), m) for m in ("contextlib.py", "functools.py"))

#: verdicts per code object, keyed by ``id(code)`` with the code kept in the entry (so its id is
#: never reused while cached): a dict keyed by the code object itself hashes it on every lookup
#: (name, consts recursively, names...: ~0.5 µs for ``Module._call_impl``), and two code objects
#: with the same body in different files compare equal
_internal: dict[int, tuple[object, bool]] = {}


def is_internal_file(f: str) -> bool:
    """Whether ``f`` is a file whose frames are never the user's line: torch, tensorscope,
    contextlib/functools wrappers, frozen modules and fx-generated code."""
    # fx-generated code (``<eval_with_key>``: GraphModules of non-Inductor backends) is not the user's:
    # its ops belong to the line that called the compiled function. Inductor's generated modules
    # are kept as the call's file on purpose: recording/compiled_link.link links those calls to their
    # graph by it, then shows the compiled function's own file and line instead.
    return (f.startswith(_TORCH_DIR) or f.startswith(_OUR_DIR) or f.startswith(_STDLIB_WRAPPERS)
            or f.startswith("<frozen") or f.startswith("<eval_with_key"))


def _is_internal(code: CodeType) -> bool:
    e = _internal.get(id(code))
    if e is not None and e[0] is code:
        return e[1]
    r = is_internal_file(code.co_filename)
    _internal[id(code)] = (code, r)
    return r


def user_frame_location(depth: int = 2) -> tuple[Optional[str], Optional[int]]:
    """(filename, line) of the innermost user frame above the caller."""
    try:
        f = sys._getframe(depth)
    except ValueError:
        return None, None
    return user_location_from(f)


def user_location_from(f: Optional[FrameType]) -> tuple[Optional[str], Optional[int]]:
    """(filename, line) of the innermost user frame at or above frame ``f``."""
    while f is not None:
        code = f.f_code
        if not _is_internal(code):
            return code.co_filename, f.f_lineno
        f = f.f_back
    return None, None


# ---------------------------------------------------------------------------
# did compiled code call this op?
# ---------------------------------------------------------------------------
_COMPILED_DIRS = tuple(os.path.join(_TORCH_DIR, d) + os.sep for d in ("_inductor", "_functorch", "_higher_order_ops", "fx"))
_DISABLE_WRAPPERS = (os.path.join(_TORCH_DIR, "_compile.py"), os.path.join(_TORCH_DIR, "_dynamo", "eval_frame.py"))
_compiled: dict[int, tuple[object, Optional[bool]]] = {}   # keyed by id(code), as _internal


def _compiled_verdict(code: CodeType) -> Optional[bool]:
    e = _compiled.get(id(code))
    if e is not None and e[0] is code:
        return e[1]   # a cached None or False is a hit too
    f = code.co_filename
    r: Optional[bool]
    if f.startswith(_DISABLE_WRAPPERS) or f.startswith(_OUR_DIR):
        r = None                      # the modes and torch's wrappers around them: look further out
    elif f.startswith(_COMPILED_DIRS) or "torchinductor" in f or f.startswith("<eval_with_key"):
        r = True                      # a compiled graph (inductor, AOT autograd, an fx GraphModule)
    elif not _is_internal(code):
        r = False                     # user code reached first: called directly (torch.ops, C++)
    else:
        r = None
    _compiled[id(code)] = (code, r)
    return r


def called_from_compiled_code(depth: int = 2, limit: int = 24) -> bool:
    """Whether an op that ran outside any torch-level call was dispatched by torch.compile'd code
    (the innermost classifying frame is a compiled graph's), not by user code calling ops directly."""
    try:
        f: Optional[FrameType] = sys._getframe(depth)
    except ValueError:
        return False
    while f is not None and limit > 0:
        r = _compiled_verdict(f.f_code)
        if r is not None:
            return r
        f = f.f_back
        limit -= 1
    return False


def user_traceback_location(tb: Optional[TracebackType]) -> tuple[Optional[str], Optional[int]]:
    """(filename, line) of the innermost traceback entry outside torch and tensorscope: where the
    user's code raised; (None, None) when every entry is internal."""
    file = line = None
    while tb is not None:
        if not _is_internal(tb.tb_frame.f_code):
            file, line = tb.tb_frame.f_code.co_filename, tb.tb_lineno
        tb = tb.tb_next
    return file, line
