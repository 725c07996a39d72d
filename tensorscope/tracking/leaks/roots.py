"""The roots of the search: the names a notebook user can act on, and what releases each.

In priority order: the user's globals, their own imported modules, IPython's output
cache (``Out``, ``_N``, ``_``, ``user_ns_hidden``, the displayhook), the last exception
(``sys.last_*``, ``InteractiveTB.tb``), and the live frames of the user's functions
calling us (a ``with tensorscope.trace()`` inside ``def f()``).
"""
from __future__ import annotations

import os
import re
import sys
import types
from dataclasses import dataclass
from typing import Any, Optional

from ..._common import ipython_shell
from .classify import _is_library_file, _live_frame_locals, _user_modules


# -- roots ---------------------------------------------------------------------------------------
@dataclass
class _Root:
    label: str          # how the path text starts: "global x", "Out[3]", "sys.last_traceback"
    group: str          # global / local / out_cache / traceback
    expr: Optional[str]  # a Python expression naming it, when one exists
    fix: str            # what releases this root's reference


_OUT_NAME = re.compile(r"^_\d+$")


_GC_COLLECT = "import gc; gc.collect()"


_HIDDEN_SKIP = frozenset(("In", "Out", "_ih", "_oh", "_dh", "get_ipython", "exit", "quit", "_i", "_ii", "_iii",
                          "__builtins__", "__builtin__", "__name__", "__doc__", "__package__", "__loader__",
                          "__spec__", "__file__", "__cached__"))


def _get_shell(shell):
    return shell if shell is not None else ipython_shell()


def _user_namespace(shell, user_ns):
    if user_ns is not None:
        return user_ns
    if shell is not None and getattr(shell, "user_ns", None) is not None:
        return shell.user_ns
    main = sys.modules.get("__main__")
    return getattr(main, "__dict__", {})


_INTERNAL_FILE_HINTS = (os.sep + "IPython" + os.sep, os.sep + "ipykernel" + os.sep, os.sep + "tornado" + os.sep,
                        os.sep + "asyncio" + os.sep, os.sep + "traitlets" + os.sep)


#: code with no file that is the user's: terminal IPython / in-process shells, exec'd strings, a REPL
_USER_PSEUDO_FILES = ("<ipython-input-", "<string>", "<stdin>", "<console>")


def _stack_frames() -> list[types.FrameType]:
    """Running user frames above us (function frames only: a module frame's locals are globals)."""
    out: list[types.FrameType] = []
    try:
        f: Optional[types.FrameType] = sys._getframe(1)
    except ValueError:
        return out
    ours = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
    while f is not None:
        code = f.f_code
        fn = code.co_filename
        if code.co_name != "<module>" and (fn.startswith(_USER_PSEUDO_FILES) or (
                not fn.startswith(ours) and not _is_library_file(fn)
                and not any(h in fn for h in _INTERNAL_FILE_HINTS))):
            out.append(f)
        f = f.f_back
    return out


def user_objects(shell=None) -> list[Any]:
    """The values of the user's names: the notebook's (or ``__main__``'s) globals and the locals of
    the running user functions above the caller (read without keeping a frame's locals alive).
    The caller must clear the list."""
    shell = _get_shell(shell)
    out = [v for k, v in list(_user_namespace(shell, None).items()) if isinstance(k, str) and not k.startswith("_")]
    for f in _stack_frames():
        out.extend(v for _name, v in _live_frame_locals(f))
        del f
    return out


def _collect_roots(shell, user_ns, frames: bool = True, user_modules=None) -> tuple[list[Any], list[_Root]]:
    """(objects, descriptions) in search priority order. The caller must clear ``objects``."""
    objs: list[Any] = []
    roots: list[_Root] = []

    def add(obj, label, group, expr, fix):
        if obj is None:
            return
        objs.append(obj)
        roots.append(_Root(label, group, expr, fix))

    hidden = getattr(shell, "user_ns_hidden", None) or {}
    out_cache = user_ns.get("_oh") if shell is not None else None
    ns_items = list(user_ns.items())
    under_names = ("_", "__", "___")
    # 1. the user's own names
    for name, val in ns_items:
        if not isinstance(name, str) or name in _HIDDEN_SKIP or name in under_names or _OUT_NAME.match(name):
            continue
        if name in hidden and hidden[name] is val:
            continue  # IPython's own machinery (exit, quit, get_ipython ...)
        if name.startswith("_i") and isinstance(val, str):
            continue
        add(val, f"global {name}", "global", name, f"del {name}")
    # 2. the user's own modules (a notebook's helper .py files)
    for modname, mod in (_user_modules() if user_modules is None else user_modules):
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for name, val in list(d.items()):
            if isinstance(name, str) and not name.startswith("__"):
                add(val, f"global {modname}.{name}", "global", f"{modname}.{name}", f"del {modname}.{name}")
    # 3. IPython's output cache: Out[n], _n, _, __, ___ in user_ns, user_ns_hidden and the displayhook
    if isinstance(out_cache, dict):
        for n, val in list(out_cache.items()):
            add(val, f"Out[{n}]", "out_cache", f"Out[{n}]", "%reset -f out")
    for name, val in ns_items:
        if isinstance(name, str) and _OUT_NAME.match(name):
            add(val, name, "out_cache", name, "%reset -f out")
    for name in under_names:
        if name in user_ns:
            add(user_ns[name], name, "out_cache", name, "%reset -f out")
    for name, val in list(hidden.items()):
        if isinstance(name, str) and (name in under_names or _OUT_NAME.match(name)):
            fix = (_HIDDEN_UNDERS if name in under_names else "%reset -f out")
            add(val, f"user_ns_hidden[{name!r}]", "out_cache", None, fix)
    dh = getattr(shell, "displayhook", None)
    if dh is not None:
        for name in under_names:
            add(getattr(dh, name, None), f"displayhook.{name}", "out_cache", None, "%reset -f out")
    ler = getattr(shell, "last_execution_result", None)
    if ler is not None:
        add(getattr(ler, "result", None), "last_execution_result.result", "out_cache", None,
            "(released when the next cell runs)")
    # 4. the last exception: its traceback's frames keep every local alive
    # A stored exception sits in a reference cycle (IPython's run_code frame → its ExecutionResult →
    # the exception → its traceback → that frame): dropping the roots leaves garbage for gc to free.
    for attr in ("last_traceback", "last_value", "last_exc"):
        add(getattr(sys, attr, None), f"sys.{attr}", "traceback", None,
            f"import sys; sys.{attr} = None; {_GC_COLLECT}")
    for tb_owner in ("InteractiveTB", "SyntaxTB"):
        h = getattr(shell, tb_owner, None)
        if h is not None:
            add(getattr(h, "tb", None), f"{tb_owner}.tb", "traceback", None,
                f"get_ipython().{tb_owner}.tb = None; {_GC_COLLECT}")
    if ler is not None:
        add(getattr(ler, "error_in_exec", None), "last_execution_result.error_in_exec", "traceback", None,
            "(released when the next cell runs)")
    # 5. the locals of the user's functions calling us (`def f(): with tensorscope.trace(): ...`), each
    # a root of its own: `f() local y`, and a storage both y and loss's graph keep names both
    for f in (_stack_frames() if frames else ()):
        fn = f"{f.f_code.co_name}()"
        for name, val in _live_frame_locals(f):
            add(val, f"{fn} local {name}", "local", name if name.isidentifier() else None,
                f"del {name}  (in {fn}, or return from it)")
        del f
    return objs, roots


_NEXT_CELL = "(released when the next cell runs)"


_HIDDEN_UNDERS = "get_ipython().user_ns_hidden.update(_='', __='', ___='')"
