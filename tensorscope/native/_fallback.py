"""Pure-Python twin of the native capture, and the pieces both paths share.

Used when the native hooks cannot be built (no compiler, failed build) or are
turned off (``native=False``, ``TENSORSCOPE_FORCE_FALLBACK=1``). What it can see:

* exceptions: the Python exception only. Its message, and the C++ location
  and c10 type only when ``TORCH_SHOW_CPP_STACKTRACES=1`` was set before torch
  was imported (then torch appends "Exception raised from F at FILE:LINE").
* warnings: per torch-level call, through a tap on ``warnings._showwarnmsg``
  (the function CPython's C warning machinery calls to show a warning). C++
  warnings carry their location in "(Triggered internally at FILE:LINE.)" or,
  for verbatim ones, as the warning's filename/lineno. The tap sees warnings
  after the user's filters: an ignored warning is not seen, an "error" one
  becomes the call's exception.

The tap never changes what the user sees: it records and calls the function it
replaced. It is installed while any capture is open and collects per thread.
"""
from __future__ import annotations

import dis
import re
import threading
import warnings
from typing import Any, Optional

_TRIGGERED = " (Triggered internally at "
_CPP_SUFFIXES = (".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".hh", ".cu", ".cuh", ".mm")
_RAISED_FROM = re.compile(r"\nException raised from (?P<func>.*?) at (?P<file>[^\n]*?):(?P<line>\d+) \(most recent call first\):")


# ---------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------

def split_triggered(text: str) -> tuple[str, Optional[str], Optional[int]]:
    """``"msg (Triggered internally at f.cpp:12.)"`` -> ``("msg", "f.cpp", 12)``."""
    i = text.rfind(_TRIGGERED)
    if i < 0 or not text.endswith(".)"):
        return text, None, None
    loc = text[i + len(_TRIGGERED):-2]
    file, sep, line = loc.rpartition(":")
    if not sep or not line.isdigit():
        return text, None, None
    return text[:i], file, int(line)


def is_cpp_file(filename: Any) -> bool:
    return isinstance(filename, str) and filename.lower().endswith(_CPP_SUFFIXES)


def shown_warning_dict(text: str, category: type, filename: Any, lineno: Any) -> dict[str, Any]:
    """A warning dict (the facade's contract) from a warning Python showed."""
    msg, cpp_file, cpp_line = split_triggered(text)
    verbatim = False
    if cpp_file is None and is_cpp_file(filename):
        # Verbatim C++ warnings are raised with the C++ location as filename.
        verbatim, cpp_file, cpp_line = True, filename, int(lineno) if lineno is not None else None
    try:
        deprecation = issubclass(category, DeprecationWarning)
        cat = category.__name__
    except TypeError:
        deprecation, cat = False, str(category)
    return {
        "message": msg,
        "category": cat,
        "cpp_file": cpp_file,
        "cpp_line": cpp_line,
        "cpp_function": None,
        "deprecation": deprecation,
        "verbatim": verbatim,
        "native": False,
        "filename": filename if isinstance(filename, str) else None,
        "lineno": lineno if isinstance(lineno, int) else None,
    }


def c10_type_of(exc: BaseException) -> Optional[str]:
    """The c10 class torch maps to this Python type (for errors known to come from C++)."""
    import torch

    dist = getattr(torch, "distributed", None)
    table = []
    # subclasses before their bases (torch/csrc/Exceptions.h CATCH_CORE_ERRORS)
    for mod, name, c10 in (
        (torch, "OutOfMemoryError", "c10::OutOfMemoryError"),
        (getattr(torch, "linalg", None), "LinAlgError", "c10::LinAlgError"),
        (torch, "AcceleratorError", "c10::AcceleratorError"),
        (dist, "DistBackendError", "c10::DistBackendError"),
        (dist, "DistNetworkError", "c10::DistNetworkError"),
        (dist, "DistQueueEmptyError", "c10::DistQueueEmptyError"),
        (dist, "DistStoreError", "c10::DistStoreError"),
        (dist, "DistError", "c10::DistError"),
    ):
        cls = getattr(mod, name, None) if mod is not None else None
        if isinstance(cls, type):
            table.append((cls, c10))
    table += [(IndexError, "c10::IndexError"), (ValueError, "c10::ValueError"), (TypeError, "c10::TypeError"),
              (NotImplementedError, "c10::NotImplementedError"), (BufferError, "c10::BufferError"),
              (SyntaxError, "c10::SyntaxError"), (RuntimeError, "c10::Error")]
    for cls, c10 in table:
        if isinstance(exc, cls):
            return c10
    return None


_PY_NAMES = {"torch._C._LinAlgError": "torch.linalg.LinAlgError"}


def py_type_name(exc: BaseException) -> str:
    """``RuntimeError``, ``torch.linalg.LinAlgError``, ``torch.OutOfMemoryError``..."""
    t = type(exc)
    mod = getattr(t, "__module__", "") or ""
    qual = getattr(t, "__qualname__", t.__name__)
    if mod == "builtins":
        return qual
    full = f"{mod}.{qual}"
    return _PY_NAMES.get(full, full)


def exc_text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<unprintable {type(exc).__name__}>"


def raised_in_c(exc: BaseException) -> bool:
    """Whether the innermost traceback entry stopped at a call instruction.

    A Python callee that raised would have added its own entry, so stopping at
    a call means the exception came from a C function (torch's C++ bindings).
    """
    tb = getattr(exc, "__traceback__", None)
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    try:
        code = tb.tb_frame.f_code.co_code
        op = dis.opname[code[tb.tb_lasti]]
    except Exception:
        return False
    return op.startswith("CALL") or op == "PRECALL"


def fallback_error_info(exc: BaseException, text: Optional[str] = None) -> dict[str, Any]:
    """What the Python exception alone says (``native`` False)."""
    if text is None:
        text = exc_text(exc)
    info: dict[str, Any] = {
        "cpp_type": None, "message": text, "cpp_file": None, "cpp_line": None, "cpp_function": None,
        "native": False, "py_type": py_type_name(exc),
    }
    m = _RAISED_FROM.search(text)
    if m is not None:
        # Only c10::Error's what() has this line: the C++ type is then known
        # up to torch's one-to-one mapping of c10 classes to Python types.
        info.update(message=text[:m.start()], cpp_file=m.group("file"), cpp_line=int(m.group("line")),
                    cpp_function=m.group("func"), cpp_type=c10_type_of(exc))
    return info


# ---------------------------------------------------------------------------
# the warnings tap
# ---------------------------------------------------------------------------

class _WarningTap:
    """Wraps ``warnings._showwarnmsg`` while any capture is open; per-thread collectors."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._orig = None
        self._local = threading.local()
        self._hook_fn = self._hook  # one bound method, so `is` identifies it
        #: called (no arguments) after each warning collected: the native function mode counts them
        #: in C, so a call that saw none costs nothing here (see take_last)
        self.notify = None

    def acquire(self) -> bool:
        with self._lock:
            if self._users == 0 and getattr(warnings, "_showwarnmsg", None) is not self._hook_fn:
                orig = getattr(warnings, "_showwarnmsg", None)
                if orig is None:
                    return False
                self._orig = orig
                warnings._showwarnmsg = self._hook_fn  # type: ignore[attr-defined]  # private; see above
            self._users += 1
            return True

    def release(self) -> None:
        with self._lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users == 0:
                self.reset_thread()  # an interrupted call may have left frames
                if getattr(warnings, "_showwarnmsg", None) is self._hook_fn:
                    warnings._showwarnmsg = self._orig  # type: ignore[attr-defined]
            # If someone wrapped the hook meanwhile it stays in their chain,
            # inert (no collectors) and passing everything through.

    @property
    def installed(self) -> bool:
        return getattr(warnings, "_showwarnmsg", None) is self._hook_fn

    # Per thread: ``items`` (warnings seen while a call is open, in order) and ``depth``
    # (open calls). A token is the length of ``items`` at push: pop(token) returns and drops
    # everything after it. No allocation per call: push/pop run around every torch-level call.
    def _hook(self, msg) -> None:
        try:
            d = self._local.__dict__
            if d.get("depth"):
                d["items"].append((exc_text(msg.message) if isinstance(msg.message, BaseException) else str(msg.message),
                                   msg.category, msg.filename, msg.lineno))
                notify = self.notify
                if notify is not None:
                    notify()
        except Exception:
            pass  # a tracer bug must never swallow the user's warning
        orig = self._orig
        if orig is None:
            orig = warnings._showwarnmsg_impl  # type: ignore[attr-defined]
        return orig(msg)

    def push(self) -> int:
        d = self._local.__dict__
        items = d.get("items")
        if items is None:
            items = d["items"] = []
            d["depth"] = 0
        d["depth"] += 1
        return len(items)

    def pop(self, token: Any) -> list[tuple]:
        d = self._local.__dict__
        items = d.get("items")
        if items is None or not d.get("depth"):
            return []
        d["depth"] -= 1
        if not isinstance(token, int) or token < 0 or len(items) <= token:
            if not d["depth"]:
                items.clear()
            return []
        out = items[token:]
        del items[token:]
        return out

    def take_last(self, n: int) -> list[tuple]:
        """Remove and return the last ``n`` warnings collected on this thread (the native function
        mode's per-call share: it counted them through ``notify``)."""
        items = self._local.__dict__.get("items")
        if not items or n <= 0:
            return []
        out = items[-n:]
        del items[-n:]
        return out

    def reset_thread(self) -> None:
        self._local.__dict__.pop("items", None)
        self._local.__dict__.pop("depth", None)


TAP = _WarningTap()


def _none() -> None:
    return None


class FallbackCapture:
    """The pure-Python capture (same interface as the native one)."""

    native = False

    def __init__(self, reason: str = "", cpp_errors: bool = False) -> None:
        self.reason = reason
        self.cpp_errors = False
        if cpp_errors:
            self.reason = (reason + "; " if reason else "") + "cpp_errors needs the native hooks"
        self._closed = False
        self._tapped = TAP.acquire()
        # No per-op work in this path: the tracer may call these around every op.
        self.op_begin = _none
        self.op_end = _none

    @property
    def description(self) -> str:
        return "pure-Python fallback" + (f" ({self.reason})" if self.reason else "")

    def call_begin(self, func: Any = None) -> Optional[int]:
        if not self._tapped:
            return None
        return TAP.push()

    def call_end(self, token: Any) -> Optional[list[dict[str, Any]]]:
        if token is None:
            return None
        items = TAP.pop(token)
        if not items:
            return None
        return [shown_warning_dict(*it) for it in items]

    def count_call_warnings(self, fn: Any) -> None:
        count_call_warnings(fn)

    def take_call_warnings(self, n_tap: int, engine: Any = None) -> list[dict[str, Any]]:
        return take_call_warnings(n_tap, engine)

    def error_info(self, exc: Optional[BaseException]) -> Optional[dict[str, Any]]:
        if not isinstance(exc, BaseException):
            return None
        try:
            return fallback_error_info(exc)
        except Exception:
            return None

    def swallowed_count(self) -> Optional[int]:
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tapped:
            TAP.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def merge_call_warnings(out: list[dict[str, Any]], items, *seen_fns) -> list[dict[str, Any]]:
    """A call's warnings: the ones ops recorded natively (``out``) plus the ones the Python tap saw
    (``items``), minus the tap's copies of C++ warnings an op already reported natively
    (``seen_fns``: message -> bool, None skipped)."""
    seen = [f for f in seen_fns if f is not None]
    for it in items:
        w = shown_warning_dict(*it)
        if w["cpp_file"] is not None and any(f(w["message"]) for f in seen):
            continue  # the op that raised it already reported it, natively
        out.append(w)
    return out


def count_call_warnings(fn: Any) -> None:
    """Have the warning tap call ``fn()`` after each warning it collects (None: stop, if still ``fn``'s)."""
    if fn is not None:
        TAP.notify = fn
    elif TAP.notify is not None:
        TAP.notify = None


def take_call_warnings(n_tap: int, engine: Any = None, native_seen: Any = None) -> list[dict[str, Any]]:
    """The warnings of a call that just returned: the recording engine's pending per-op ones plus
    the last ``n_tap`` the tap collected on this thread (those it counted during the call)."""
    ext = getattr(engine, "ext", None)
    out = engine.take_warnings() if (ext is not None and ext.warnings_pending()) else []
    items = TAP.take_last(n_tap) if n_tap > 0 else []
    return merge_call_warnings(out, items, native_seen, getattr(ext, "warning_seen", None))
