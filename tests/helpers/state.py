"""Process-wide state a test may leave behind, read before and restored after every test.

``GlobalState.take()`` reads each piece; ``restore()`` puts back whatever changed and returns the
names of the pieces no test may change (the others, such as ``tensorscope.last()`` or the IPython
singleton, change whenever a test traces or starts a shell: they are put back silently). The
autouse fixture in tests/conftest.py fails a test whose list is not empty; tests/test_global_state.py
checks that every piece is caught and put back.
"""
from __future__ import annotations

import builtins
import gc
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.nn.modules import module as _mod
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from tensorscope.analyses import casts as _casts
from tensorscope.magics import controller as _controller
from tensorscope.recording import history as _history
from tensorscope.recording import session as _session
from tensorscope.timing.kernels import KernelCollector
from tensorscope.tracking.leaks import boundary as _boundary
from tensorscope.tracking.leaks import growth as _growth
from tensorscope.tracking.leaks import known as _known


@dataclass(frozen=True)
class Piece:
    name: str
    read: Callable[[], Any]
    put_back: Callable[[Any, Any], None]     # (saved, now)
    may_change: bool                         # False: a change is a leak the test is failed for
    excused_by: str = ""                     # ...unless this other piece changed too (its known side effect)


def _same(a: Any, b: Any) -> bool:
    """Identity, element by element for containers (a Trace or a mode compares by identity)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(x is y or _same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    return a is b or (type(a) in (int, float, bool, str, type(None)) and a == b)


# -- readers and restorers ----------------------------------------------------------------------

def _hooks() -> Tuple[Dict[Any, Any], ...]:
    return (dict(_mod._global_forward_pre_hooks), dict(_mod._global_forward_hooks),
            dict(getattr(_mod, "_global_forward_hooks_always_called", {})))


def _put_hooks(saved: Tuple[Dict[Any, Any], ...], now: Any) -> None:
    for d, s in zip((_mod._global_forward_pre_hooks, _mod._global_forward_hooks,
                     getattr(_mod, "_global_forward_hooks_always_called", {})), saved):
        d.clear()
        d.update(s)


def _pop_modes(stack: Callable[[], List[Any]]) -> Callable[[Any, Any], None]:
    def put(saved: List[Any], now: Any) -> None:
        while len(stack()) > len(saved):
            stack()[-1].__exit__(None, None, None)
    return put


def _end_session(saved: Any, now: Any) -> None:
    if now is not None:
        now._restore()


def _put_filters(saved: List[Any], now: Any) -> None:
    warnings.filters[:] = saved
    mutated = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
    if mutated is not None:
        mutated()


def _attr(obj: Any, name: str) -> Piece:
    """A module or class attribute, put back by assignment."""
    return Piece(f"{getattr(obj, '__name__', obj)}.{name}", lambda: getattr(obj, name, None),
                 lambda saved, now: setattr(obj, name, saved), may_change=False)


def _contents(label: str, d: Any) -> Piece:
    """A registry (dict or list) whose contents tests change on purpose: its contents are put back."""
    def put(saved: Any, now: Any) -> None:
        d.clear()
        if isinstance(d, dict):
            d.update(saved)
        else:
            d.extend(saved)
    return Piece(label, lambda: d.copy(), put, may_change=True)


def _unfreeze(saved: int, now: Any) -> None:
    if saved == 0:
        gc.unfreeze()


def _put_gc_enabled(saved: bool, now: Any) -> None:
    (gc.enable if saved else gc.disable)()


def _put_gc_callbacks(saved: List[Any], now: Any) -> None:
    gc.callbacks[:] = saved


def _put_discovery(saved: Any, now: Any) -> None:
    if now is not None:
        _boundary.disable_discovery()
    _boundary._DISCOVERY = saved


def _put_collector(saved: Any, now: Any) -> None:
    if now is not None and now is not saved:
        now.close()
    KernelCollector._shared = saved


def _ipython_instance() -> Any:
    mod = sys.modules.get("IPython.core.interactiveshell")   # never import IPython only to look
    return None if mod is None else mod.InteractiveShell._instance


def _put_ipython(saved: Any, now: Any) -> None:
    import atexit

    from IPython.core.interactiveshell import InteractiveShell

    if now is not None:
        # what IPython does at exit, now: atexit keeps every shell alive, and with it its namespace
        # (the tensors of its cells, which the next test's leak report would list)
        try:
            now.atexit_operations()      # resets the namespace, closes the history database
        finally:
            atexit.unregister(now.atexit_operations)
            now.cleanup()                # sys.modules["__main__"] and the sys attributes it replaced
            type(now).clear_instance()
    InteractiveShell._instance = saved


def _main_module() -> Any:
    return sys.modules.get("__main__")


def _put_main_module(saved: Any, now: Any) -> None:
    sys.modules["__main__"] = saved


_SYS_LAST = ("last_type", "last_value", "last_traceback", "last_exc")


def _sys_last() -> Tuple[Any, ...]:
    return tuple(getattr(sys, k, None) for k in _SYS_LAST)


def _put_sys_last(saved: Tuple[Any, ...], now: Any) -> None:
    for k, v in zip(_SYS_LAST, saved):
        if v is None:
            if hasattr(sys, k):
                delattr(sys, k)
        else:
            setattr(sys, k, v)


def _builtins() -> Dict[str, Any]:
    return dict(vars(builtins))


def _put_builtins(saved: Dict[str, Any], now: Any) -> None:
    b = vars(builtins)
    for k in set(b) - set(saved):
        del b[k]
    b.update(saved)


def _put_grad(saved: bool, now: Any) -> None:
    torch.set_grad_enabled(saved)


def _put_dtype(saved: torch.dtype, now: Any) -> None:
    torch.set_default_dtype(saved)


_IPYTHON = "IPython singleton"


def pieces() -> List[Piece]:
    return [
        # never changed by a test that passes: tracing restores them (the project's first rule)
        Piece("an active tensorscope session", _session.active_session, _end_session, False),
        Piece("dispatch modes", lambda: list(_get_current_dispatch_mode_stack()),
              _pop_modes(_get_current_dispatch_mode_stack), False),
        Piece("function modes", lambda: list(_get_current_function_mode_stack()),
              _pop_modes(_get_current_function_mode_stack), False),
        Piece("global module hooks", _hooks, _put_hooks, False),
        # a new IPython shell adds its own DeprecationWarning filter
        Piece("warning filters", lambda: list(warnings.filters), _put_filters, False, excused_by=_IPYTHON),
        _attr(warnings, "showwarning"),
        _attr(warnings, "_showwarnmsg"),
        _attr(sys, "displayhook"),
        _attr(sys, "excepthook"),
        Piece("gc freeze (objects left frozen)", gc.get_freeze_count, _unfreeze, False),
        Piece("gc enabled", gc.isenabled, _put_gc_enabled, False),
        Piece("gc callbacks", lambda: list(gc.callbacks), _put_gc_callbacks, False),
        Piece("leak discovery (cell-boundary hooks)", _boundary.discovery, _put_discovery, False),
        Piece("torch grad mode", torch.is_grad_enabled, _put_grad, False),
        Piece("torch default dtype", torch.get_default_dtype, _put_dtype, False),
        # changed on purpose by tests that trace, find leaks or start a shell: put back silently
        Piece("tensorscope.last()", lambda: _history._last, lambda s, n: setattr(_history, "_last", s), True),
        _contents("tensorscope.history()", _history._history),
        _contents("history sizes", _history._sizes),
        Piece("history limits", lambda: (_history._HISTORY_MAX, _history._HISTORY_MAX_BYTES),
              lambda s, n: (setattr(_history, "_HISTORY_MAX", s[0]), setattr(_history, "_HISTORY_MAX_BYTES", s[1])),
              True),
        # an error shown by a shell: its traceback's frames hold the cell's tensors
        Piece("sys.last_traceback and friends", _sys_last, _put_sys_last, True),
        Piece("casts cache", lambda: _casts._last, lambda s, n: setattr(_casts, "_last", s), True),
        _contents("leak registry", _known._KNOWN),
        _contents("leak growth streaks", _growth._STREAKS),
        _contents("leak growth holders", _growth._HELD),
        Piece("shared kernel collector", lambda: KernelCollector._shared, _put_collector, True),
        Piece(_IPYTHON, _ipython_instance, _put_ipython, True),
        Piece("builtins (IPython adds its own)", _builtins, _put_builtins, True),
        # a shell makes its user namespace sys.modules["__main__"]: left there, the tensors of its cells
        # stay reachable (and show up in the next test's leak report) after the shell is gone
        Piece("sys.modules['__main__']", _main_module, _put_main_module, False, excused_by=_IPYTHON),
        _contents("magic controllers", _controller._controllers),
    ]


class GlobalState:
    def __init__(self, saved: List[Tuple[Piece, Any]]):
        self.saved = saved

    @classmethod
    def take(cls, only: Optional[List[str]] = None) -> "GlobalState":
        return cls([(p, p.read()) for p in pieces() if only is None or p.name in only])

    def restore(self) -> List[str]:
        """Put back what changed; the names of the changes no test may make."""
        changed = [(p, saved, now) for p, saved, now in ((p, saved, p.read()) for p, saved in self.saved)
                   if not _same(saved, now)]
        names = {p.name for p, _, _ in changed}
        # in order: the session first, since ending it pops its modes and hooks
        for p, saved, now in changed:
            p.put_back(saved, now)
        return [p.name for p, _, _ in changed if not p.may_change and p.excused_by not in names]
