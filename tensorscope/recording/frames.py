"""Tracebacks and warnings as they are untraced: drop the entries the tracer introduced.

``clean_traceback(exc)`` relinks ``tb_next`` past the tracer's entries (error path only,
idempotent); ``clean_when_caught(depth)`` does it for an exception caught inside the traced
block; ``register_tracer_code`` marks the modes' handlers. The trampoline (``call_as_caller``,
``call_from``) makes warnings land on the user's line; ``exc_key`` / ``exc_mark`` / ``seen_exc``
identify an exception without holding it.

Rules and details: docs/development/architecture.md ("Tracebacks, warnings and module paths as untraced")
and docs/development/recording.md#tracebacks-recordingframespy
"""
from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping, Sequence
from types import CodeType, FrameType, FunctionType, TracebackType
from typing import Any, Callable, Optional

import torch

_TRACER_CODES: set[CodeType] = set()
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_WRAPPER_FILES = (os.path.join(_TORCH_DIR, "_compile.py"), os.path.join(_TORCH_DIR, "_dynamo", "eval_frame.py"))
_OPS_FILE = os.path.join(_TORCH_DIR, "_ops.py")
_HTF_CODE = getattr(getattr(torch.overrides, "handle_torch_function", None), "__code__", None)


def register_tracer_code(*fns: object) -> None:
    """Mark functions whose frames exist only because tensorscope is tracing."""
    for fn in fns:
        fn = getattr(fn, "__func__", fn)
        fn = getattr(fn, "__wrapped__", fn)   # the raw function behind torch's dynamo-disable wrapper
        code = getattr(fn, "__code__", None)
        if code is not None:
            _TRACER_CODES.add(code)


# ---------------------------------------------------------------------------
# the trampoline: the frame that calls a torch function looks like the user's
# ---------------------------------------------------------------------------
# ``warnings.warn(stacklevel=N)`` in torch's Python code and C++ warnings turned into Python ones
# (stacklevel 1) are attributed to the frame that called the torch function, and their filters
# and "once"/"default" registries key on that frame's filename, line and globals (its module name,
# its ``__warningregistry__``). Under a mode that frame is the mode's. So the mode calls ``func``
# through a one-line function whose code carries the user's filename and line and which runs with
# the user's globals: the frame a stacklevel lands on is then indistinguishable from the untraced one.
_TRAMPOLINE_NAME = "_tensorscope_call"
_TEMPLATE: CodeType = compile(f"def {_TRAMPOLINE_NAME}(func, args, kwargs): return func(*args, **kwargs)",
                    "<tensorscope>", "exec").co_consts[0]
_TEMPLATE_BYTES = _TEMPLATE.co_code
_trampolines: dict[tuple[CodeType, int, int], FunctionType] = {}
_getframe = sys._getframe


def trampoline_for(caller: FrameType) -> FunctionType:
    """``f(func, args, kwargs)`` whose frame has ``caller``'s filename, current line and globals."""
    g = caller.f_globals
    key = (caller.f_code, caller.f_lasti, id(g))   # the instruction, not the line: no line-table lookup
    fn = _trampolines.get(key)
    if fn is None:
        line = caller.f_lineno
        if line is None or line < 1:
            line = caller.f_code.co_firstlineno
        code = _TEMPLATE.replace(co_filename=caller.f_code.co_filename, co_firstlineno=line)
        fn = FunctionType(code, g)
        # Cached only for a module's own globals (a module, IPython's __main__ included, outlives the
        # cache anyway): a trampoline keeps its globals alive, so a namespace of exec'd code (a test's,
        # a script runner's) would otherwise stay alive, with every tensor in it, after the trace.
        name = g.get("__name__")
        mod = sys.modules.get(name) if type(name) is str else None
        if mod is not None and getattr(mod, "__dict__", None) is g:
            if len(_trampolines) >= 4096:   # bounded: one entry per distinct call site
                _trampolines.clear()
            _trampolines[key] = fn
    return fn


def caller_frame(depth: int) -> Optional[FrameType]:
    """The frame that called the torch function whose mode handler is ``depth`` frames above the
    caller of this function (past handle_torch_function and the function that called it)."""
    caller: Optional[FrameType] = _getframe(depth + 1)
    if caller is not None and caller.f_code is _HTF_CODE:   # a Python-level torch function handed itself to the mode
        back = caller.f_back
        caller = back.f_back if back is not None else None
    return caller


def call_from(caller: Optional[FrameType], func: Callable[..., Any], args: Sequence[Any],
              kwargs: Mapping[str, Any]) -> Any:
    """``func(*args, **kwargs)``, called from a frame that looks like ``caller``."""
    if caller is None:
        return func(*args, **kwargs)
    return trampoline_for(caller)(func, args, kwargs)


def call_as_caller(depth: int, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """Call ``func(*args, **kwargs)`` from a frame that looks like the one that called the torch
    function (``depth`` frames above the caller of this function, past handle_torch_function)."""
    return call_from(caller_frame(depth + 1), func, args, kwargs)


register_tracer_code(call_as_caller, call_from)


def _is_trampoline(code: CodeType) -> bool:
    return code.co_name == _TRAMPOLINE_NAME and code.co_code == _TEMPLATE_BYTES


def _is_tracer_code(code: CodeType) -> bool:
    return code in _TRACER_CODES or _is_trampoline(code)


def _is_tracer_callable(obj: object) -> bool:
    obj = getattr(obj, "__func__", obj)
    return getattr(obj, "__code__", None) in _TRACER_CODES


def _mode_is_ours(mode: object) -> bool:
    return _is_tracer_callable(getattr(type(mode), "__torch_function__", None)) or \
        _is_tracer_callable(getattr(type(mode), "__torch_dispatch__", None))


def _locals(frame: FrameType) -> dict[str, Any]:
    try:
        return frame.f_locals
    except Exception:
        return {}


def _introduced(tb: TracebackType) -> int:
    """0: keep; 1: introduced by the tracer; 2: handle_torch_function that called one of our modes."""
    frame = tb.tb_frame
    code = frame.f_code
    if _is_tracer_code(code):
        return 1
    if code is _HTF_CODE:
        return 2 if _mode_is_ours(_locals(frame).get("mode")) else 0
    fname = code.co_filename
    if fname in _WRAPPER_FILES and code.co_name in ("inner", "_fn"):
        return 1 if _is_tracer_callable(_locals(frame).get("fn")) else 0
    if fname == _OPS_FILE and code.co_name == "__call__":
        back = frame.f_back
        return 1 if (back is not None and back.f_code in _TRACER_CODES) else 0
    return 0


class _CaughtCleaner:
    """The one-shot watch of :func:`clean_when_caught` on one user frame (see the module docstring)."""

    __slots__ = ("frame", "saved", "done")

    frame: Optional[FrameType]   # None once disarmed
    saved: tuple[Any, bool, bool]   # the frame's f_trace, f_trace_lines, f_trace_opcodes
    done: bool

    def __init__(self, frame: FrameType) -> None:
        self.frame = frame
        self.saved = (frame.f_trace, frame.f_trace_lines, frame.f_trace_opcodes)
        self.done = False

    def arm(self) -> None:
        f = self.frame
        if f is None:   # disarmed already: nothing to watch
            return
        f.f_trace = self.local
        f.f_trace_lines = True    # a line in the user's frame: the exception did not come (nothing to do)
        f.f_trace_opcodes = False
        sys.settrace(self.global_)

    def global_(self, frame: FrameType, event: str, arg: Any) -> None:
        return None   # frames called meanwhile (a context manager's __exit__) are not traced

    def local(self, frame: FrameType, event: str, arg: Any) -> None:
        if frame is not self.frame or self.done:
            return None
        if event == "exception":
            try:
                tb = arg[2]   # the user frame's own entry first, then the entries the exception unwound
                if tb is not None and tb.tb_next is not None:
                    _relink(tb.tb_next, tb)
            except Exception:   # never let cleaning replace the user's exception
                pass
        self.disarm()
        return None

    def disarm(self) -> None:
        if self.done:
            return
        self.done = True
        f = self.frame
        self.frame = None
        try:
            if sys.gettrace() == self.global_:
                sys.settrace(None)
            if f is not None:
                f.f_trace, f.f_trace_lines, f.f_trace_opcodes = self.saved
        except Exception:
            pass


_watches = threading.local()   # per thread, as sys.settrace is
try:
    _is_compiling = torch.compiler.is_compiling
except AttributeError:  # torch < 2.3
    _is_compiling = lambda: False  # noqa: E731


def clean_when_caught(depth: int) -> None:
    """Called by a mode handler (``depth`` frames above the caller of this function) while an exception
    leaves it. When ``handle_torch_function`` called the handler (``F.softmax`` handed itself to the
    mode), the exception will unwind through ``handle_torch_function`` and the first ``F.softmax``
    call, frames untraced code never has; watch the user's frame that called ``F.softmax`` and unlink
    those entries when the exception arrives there, before an ``except`` there sees them."""
    try:
        if _is_compiling():   # Dynamo tracing the handler: no frames to watch
            return
        htf = _getframe(depth + 1)
        if htf.f_code is not _HTF_CODE or sys.gettrace() is not None:
            return
        dispatch = htf.f_back
        user = dispatch.f_back if dispatch is not None else None
        if user is None:
            return
        old = getattr(_watches, "w", None)
        if old is not None:
            old.disarm()   # a watch never outlives the next error of this thread's modes
        _watches.w = w = _CaughtCleaner(user)
        w.arm()
    except Exception:
        pass


def clean_traceback(exc: BaseException) -> BaseException:
    """Remove the tracer's entries from ``exc``'s traceback (and its cause/context chain), in place."""
    seen = set()
    e: Optional[BaseException] = exc
    todo: list[Optional[BaseException]] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        try:
            _clean_one(e)
        except Exception:   # never let cleaning replace the user's exception
            pass
        todo.append(e.__cause__)
        todo.append(e.__context__)
    return exc


def _clean_one(exc: BaseException) -> None:
    head = _relink(exc.__traceback__)
    if head is not exc.__traceback__:
        exc.__traceback__ = head


def _relink(tb: Optional[TracebackType], before: Optional[TracebackType] = None) -> Optional[TracebackType]:
    """Unlink the tracer's entries from the chain starting at ``tb`` (``before``: the entry linking to
    it, relinked too); returns the new first entry."""
    entries: list[TracebackType] = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    if not entries:
        return None
    kinds = [_introduced(t) for t in entries]
    if not any(kinds):
        return entries[0]
    drop = [k != 0 for k in kinds]
    n = len(entries)
    for i, k in enumerate(kinds):
        if k != 2 or i == 0:
            continue
        # F.softmax -> handle_torch_function -> our mode -> F.softmax again: untraced only the
        # second call exists (at the line that does the work), so the first one goes
        caller = entries[i - 1]
        if drop[i - 1] or caller.tb_frame is not entries[i].tb_frame.f_back:
            continue
        j = i + 1
        while j < n and drop[j]:
            j += 1
        if j < n:
            f = entries[j].tb_frame
            back = f.f_back
            if f.f_code is caller.tb_frame.f_code and back is not None and _is_tracer_code(back.f_code):
                drop[i - 1] = True
    kept = [t for t, d in zip(entries, drop) if not d]
    for a, b in zip(kept, kept[1:]):
        a.tb_next = b
    if kept:
        kept[-1].tb_next = None
    if before is not None:
        before.tb_next = kept[0] if kept else None
    return kept[0] if kept else None


def exc_key(e: BaseException) -> tuple[int, type[BaseException], Optional[str]]:
    """Identity of an exception without a reference to it (which would keep its frames and
    tensors alive). CPython reuses the id of a freed exception, so type and message join it."""
    try:
        msg = str(e)
    except Exception:
        msg = None
    return (id(e), type(e), msg)


def exc_mark(e: BaseException, call_id: Optional[int]) -> tuple[Any, Optional[int]]:
    """What ``last_exc_key`` holds: :func:`exc_key` and the calls row that recorded ``e``."""
    return (exc_key(e), call_id)


def seen_exc(mark: Any, e: BaseException, call_id: Optional[int] = None) -> bool:
    """Whether ``e`` is the exception ``mark`` was taken of, now seen by the call ``call_id``.

    Only the recording call and the calls enclosing it (entered earlier: smaller ids) see the
    same exception again; a later call that raises an equal-looking exception whose object
    took a freed one's id (a loop raising the same error) raises a new one. ``None``: the
    session, at the block's end.
    """
    if mark is None or mark[0] != exc_key(e):
        return False
    return call_id is None or mark[1] is None or call_id <= mark[1]
