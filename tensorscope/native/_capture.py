"""The native capture: the Python side of hooks.cpp and hooks_fetcher.cpp, one object per trace.

``NativeCapture`` binds ``op_begin``/``op_end`` straight to the extension's C functions, gathers
each call's warnings (``call_begin``/``call_end``, shared with the fallback's warning tap),
matches recorded c10 errors to Python exceptions (``error_info``) and arms the native engine's
error sites (``arm_error_sites``; ``site_error_info`` completes an error with them).

Rules and details: docs/development/native.md#what-the-native-capture-sees-and-how
"""
from __future__ import annotations

import types
from typing import Any, Optional

from ._fallback import (
    TAP,
    c10_type_of,
    count_call_warnings,
    exc_text,
    fallback_error_info,
    merge_call_warnings,
    py_type_name,
    raised_in_c,
    take_call_warnings,
)

_MAX_CACHED_ERRORS = 16
#: Callables implemented in C: torch.add, Tensor.add_, Tensor.shape.__get__ ...
_C_CALLABLE_TYPES = frozenset({
    types.BuiltinFunctionType, types.BuiltinMethodType, types.MethodDescriptorType,
    types.WrapperDescriptorType, types.MethodWrapperType, types.GetSetDescriptorType,
    types.ClassMethodDescriptorType,
})
#: Python types torch raises for c10 errors (LinAlgError/OutOfMemoryError are RuntimeErrors).
_C10_PY_TYPES = (RuntimeError, IndexError, ValueError, TypeError, NotImplementedError, BufferError)


def _matches(recorded: str, text: str) -> bool:
    if recorded == text:
        return True
    # With TORCH_SHOW_CPP_STACKTRACES the Python message is what() (message
    # plus backtrace); the recorded one is what_without_backtrace().
    return text.startswith(recorded) and text[len(recorded):len(recorded) + 1] in ("\n", " ")


class NativeCapture:
    """Capture backed by the compiled hooks (the interface: docs/development/native.md, "The capture")."""

    native = True
    #: the native recording engine, when it records this trace: it captures C++ warnings per op itself
    engine: Any = None

    def __init__(self, ext: Any, cpp_errors: bool = False, reason: str = "") -> None:
        self._ext = ext
        self.reason = reason
        self.cpp_errors = bool(cpp_errors)
        self._closed = False
        self._errors: dict[int, tuple] = {}
        self._surfaced = 0
        self._baseline: Optional[int] = None
        self._final_constructed: Optional[int] = None
        self._sites = False
        self._site_engine: Any = None
        #: why error sites are not armed ("ok" when they are; "" before arm_error_sites)
        self.sites_reason = ""
        ext.capture_open()
        self._tapped = TAP.acquire()
        if self.cpp_errors:
            self._baseline = ext.counter_on()
        # Bound straight to the C functions: this is the per-op hot path.
        self.op_begin = ext.op_begin
        self.op_end = ext.op_end
        self._native_seen = ext.native_seen

    @property
    def description(self) -> str:
        return "native C++ hooks"

    @property
    def source_locations(self) -> bool:
        """Whether c10 errors' "raised from" locations can be read in this torch build."""
        return bool(getattr(self._ext, "peek_ok", False))

    def arm_error_sites(self, engine: Any) -> bool:
        """Let the native engine's observer read the source location of the c10 errors its ops
        raise (hooks_fetcher.cpp: the stack-trace fetcher). Undone by :meth:`close`; True when armed."""
        if self._closed or self._sites:
            return self._site_engine is not None
        armed, self.sites_reason = self._ext.sites_on()
        self._sites = True
        if armed:
            engine.ext.set_site_reader(self._ext.site_reader)
            self._site_engine = engine
        return bool(armed)

    def call_begin(self, func: Any = None) -> int:
        """Enter an outermost torch-level call; pass the called ``func`` when known.

        Always returns a token (never None), so callers that skip ``call_end``
        for a None token still end the call.
        """
        self._ext.call_begin(type(func) in _C_CALLABLE_TYPES)
        return TAP.push() if self._tapped else -1

    def call_end(self, token: Any) -> Optional[list[dict[str, Any]]]:
        self._ext.call_end()
        eng = self.engine
        out = eng.take_warnings() if (eng is not None and eng.ext.warnings_pending()) else []
        if token is None or token == -1:
            return out or None
        items = TAP.pop(token)
        if not items:
            return out or None
        return merge_call_warnings(out, items, self._native_seen,
                                   eng.ext.warning_seen if eng is not None else None) or None

    def count_call_warnings(self, fn: Any) -> None:
        count_call_warnings(fn)

    def take_call_warnings(self, n_tap: int, engine: Any = None) -> list[dict[str, Any]]:
        return take_call_warnings(n_tap, engine, self._native_seen)

    def error_info(self, exc: Optional[BaseException]) -> Optional[dict[str, Any]]:
        if not isinstance(exc, BaseException):
            return None
        try:
            return self._error_info(exc)
        except Exception:
            return None

    def _error_info(self, exc: BaseException) -> dict[str, Any]:
        text = exc_text(exc)
        # The same exception is asked about by the op (dispatch mode) and by
        # every enclosing call (function mode). No reference to it is kept:
        # its traceback holds frames, and frames hold the user's tensors.
        hit = self._errors.get(id(exc))
        if hit is not None and hit[0] == text:
            return dict(hit[1])
        rec = self._ext.last_error()
        if rec is not None and _matches(rec[2], text):
            _serial, cpp_type, message, file, line, func = rec
            info = {"cpp_type": cpp_type, "message": message, "cpp_file": file, "cpp_line": line,
                    "cpp_function": func, "native": True, "py_type": py_type_name(exc)}
        else:
            info = fallback_error_info(exc, text)
        if len(self._errors) >= _MAX_CACHED_ERRORS:
            self._errors.pop(next(iter(self._errors)))
        self._errors[id(exc)] = (text, info)
        if info["native"]:
            if str(info["cpp_type"]).startswith("c10::"):
                self._surfaced += 1
        elif isinstance(exc, _C10_PY_TYPES) and raised_in_c(exc):
            # Raised by a torch binding before dispatch (HANDLE_TH_ERRORS):
            # most likely a c10::Error the counter saw being constructed.
            self._surfaced += 1
        return dict(info)

    def constructed_count(self) -> Optional[int]:
        """c10::Error objects constructed while this capture counted (cpp_errors)."""
        if self._baseline is None:
            return None
        if self._final_constructed is not None:
            return self._final_constructed
        return int(self._ext.constructed()) - self._baseline

    def swallowed_count(self) -> Optional[int]:
        """Constructed c10 errors that never surfaced as an exception the trace saw.

        Errors that reached Python are those the trace asked ``error_info``
        about (once each), so call this after the trace's last ``error_info``.
        """
        made = self.constructed_count()
        if made is None:
            return None
        return max(0, made - self._surfaced)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        ext = self._ext
        try:
            if self._baseline is not None:
                self._final_constructed = self.constructed_count()
                ext.counter_off()
        finally:
            try:
                if self._site_engine is not None:
                    self._site_engine.ext.set_site_reader(None)
                    self._site_engine = None
                if self._sites:
                    self._sites = False
                    ext.sites_off()
            except Exception:
                pass
            try:
                ext.reset_thread()
            finally:
                ext.capture_close()
                if self._tapped:
                    TAP.release()
        self.op_begin = _closed_noop
        self.op_end = _closed_noop

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _closed_noop() -> None:
    return None


def site_error_info(exc: BaseException, info: Optional[dict[str, Any]], file: Optional[str],
                    line: Optional[int], func: Optional[str]) -> Optional[dict[str, Any]]:
    """``info`` (an ``error_info`` dict or None) completed with a c10 error's source location.

    The native engine found the location on the op whose kernel raised ``exc``; the C++ type
    is the c10 class torch translates to ``exc``'s Python type. Unchanged when there is no
    location, when ``info`` already has one, or when ``exc`` is no type torch raises for c10
    errors.
    """
    if file is None or line is None:
        return info
    if info is not None and info.get("cpp_file") is not None:
        return info
    cpp_type = c10_type_of(exc)
    if cpp_type is None:
        return info
    out: dict[str, Any] = dict(info) if info is not None else {"message": exc_text(exc), "py_type": py_type_name(exc)}
    out.update(cpp_type=cpp_type, cpp_file=file, cpp_line=int(line), cpp_function=func, native=True)
    return out
