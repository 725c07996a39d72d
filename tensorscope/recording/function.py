"""The TorchFunctionMode: torch-level calls (``linear``, ``reshape``, ``backward``).

It is the outer of the two modes. Per call it appends one ``calls`` row (name,
module, user source line, autocast state, time, error) and sets the recording
context's current call id (``recording/context.py``), which every ATen op
dispatched inside inherits; the source line is found here only (a frame walk
per torch-level call, never per op), and so is the module path (modules.py
reads it from the stack).
Pure metadata queries (``size``, ``dim``, ``.shape``...) are passed straight through
unrecorded; property getters that dispatch a view op (``.T``, ``.mT``) are calls named
after the property; conversions that may dispatch ops (``__repr__``) are kept only when
they did. Every torch function is called through a trampoline frame that looks like the
caller's (frames.py), so warnings keep their untraced location, and an exception leaves
without the frames tracing added.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from .._common import CompileCallbacks
from ..native.abi_layout import CALL_KINDS, KIND_BITS
from . import source as _source
from .frames import (
    _HTF_CODE,
    call_as_caller,
    call_from,
    caller_frame,
    clean_traceback,
    clean_when_caught,
    exc_mark,
    register_tracer_code,
    seen_exc,
    trampoline_for,
)
from .live_calls import CALL_DTYPE as CALL_DTYPE  # re-exported: the engine and the tests read it here
from .live_calls import LiveCalls
from .modules import _MOD_CODE, _GraphModule
from .recorder import (
    C_DUR,
    C_ERROR,
    C_FIRST_SEQ,
    C_N_OPS,
    C_SRC,
    CALL_WIDTH,
    CallStore,
    Recorder,
)
from .source import user_location_from

if TYPE_CHECKING:
    from .context import NativeRecordingContext, RecordingContext

# torch-level functions that are pure metadata queries, not work: never recorded (and they
# dispatch no op). Conversions that do dispatch ops (``__bool__`` -> ``is_nonzero``,
# ``__repr__``, ``__format__``, ``__deepcopy__``...) are recorded like any call, so every op
# run from user code has its call and line.
NOISE_NAMES = frozenset({
    "__get__", "__set__", "__delete__", "size", "dim", "stride", "numel", "nelement", "ndimension",
    "_set_grad_enabled", "__len__", "__hash__",
    "is_contiguous", "data_ptr", "storage_offset",
    "element_size", "is_floating_point", "is_complex", "is_signed", "get_device", "untyped_storage",
    "_is_view", "is_shared", "is_pinned", "__reduce_ex__", "__setstate__", "__getstate__",
    "_has_compatible_shallow_copy_type", "is_inference", "requires_grad_", "retain_grad", "register_hook",
    "has_names", "is_nested", "is_sparse", "_version", "dim_order", "__dlpack_device__",
})
#: property getters that dispatch a view op (recorded as calls named after the property)
OP_GETTERS = frozenset({"T", "mT", "H", "mH", "real", "imag"})
#: how a torch-level function is handled: passed straight through, recorded, or passed through
#: from a frame that looks like the caller's (getters and setters can warn: ``.grad`` of a non-leaf)
DIRECT, RECORD, PASS, LAZY = (CALL_KINDS[k] for k in ("DIRECT", "RECORD", "PASS", "LAZY"))   # native/abi.h
#: conversions that dispatch ops only sometimes (``repr`` of a large tensor summarises it with
#: ops; of a small one, none): recorded like any call, the row dropped again when no op ran
MAY_DISPATCH = frozenset({"__repr__", "__str__", "__format__", "__deepcopy__", "__contains__", "__array__"})
#: tensor printing: torch runs it with every dispatch mode disabled (``_tensor_str._str``), so no
#: engine records the ops it runs (the native one is paused for it, to agree with the python one)
PRINTING = frozenset({"__repr__", "__str__"})

_perf = time.perf_counter_ns
try:
    _is_compiling = torch.compiler.is_compiling
except AttributeError:  # torch < 2.3
    _is_compiling = lambda: False  # noqa: E731
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def _classify(func: Callable[..., Any]) -> tuple[int, object]:
    """(kind, the object the calls table names it by)."""
    name = getattr(func, "__name__", None)
    if name is None:
        return DIRECT, func
    if name in ("__get__", "__set__"):
        desc = getattr(func, "__self__", None)
        if name == "__get__" and getattr(desc, "__name__", None) in OP_GETTERS:
            return RECORD, desc   # named "T", qualname "Tensor.T"
        return PASS, func
    if name in MAY_DISPATCH:
        return LAZY, func
    return (DIRECT if name in NOISE_NAMES else RECORD), func


def autocast_state() -> Optional[str]:
    """'cpu:bfloat16' / 'cuda:float16' when autocast is on, else None."""
    if _any_autocast is not None and not _any_autocast():
        return None
    for dev in ("cuda", "cpu", "xpu", "mps"):
        try:
            if torch.is_autocast_enabled(dev):
                return f"{dev}:{str(torch.get_autocast_dtype(dev)).replace('torch.', '')}"
        except Exception:
            continue
    return None


class TracingFunctionMode(TorchFunctionMode):
    """The python engine's call observer: a TorchFunctionMode that records each torch-level call (name,
    module, source line, parent call) and the warnings and errors crossing it."""

    def __init__(self, ctx: RecordingContext) -> None:
        super().__init__()
        self.ctx = ctx   # the recording context (recording/context.py): all the mode reads and writes
        self._kinds: dict[Callable[..., Any], tuple[int, object]] = {}

    def __torch_function__(self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        if kwargs is None:
            kwargs = {}
        # While Dynamo traces this handler, is_compiling() is True: it then inlines a plain call
        # (no frame walk, no graph break) and reads none of the mode's state first: a read of
        # ``self._kinds`` here became a guard on that cache, and the region recompiled in a later
        # trace whose cache differed (tests/recording/test_compiled.py)
        if _is_compiling():
            return func(*args, **kwargs)
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _classify(func)
        keep, named = kind
        s = self.ctx
        if keep < RECORD or keep == PASS or not s.recording:
            try:
                if keep == PASS and s.recording:
                    return call_as_caller(1, func, args, kwargs)   # a getter's warning: at the user's line
                return func(*args, **kwargs)
            except BaseException as e:
                clean_traceback(e)   # this frame never existed untraced; bare raise adds none
                clean_when_caught(1)   # and the two above it, should the user catch it in the block
                raise
        e0 = _perf()   # the tracer's own work before the call (the context's own_ns)
        rec = s.rec
        calls = rec.calls
        cap: Any   # the warning/error capture (s.capture)
        token: Optional[int]
        caller: Optional[FrameType]
        cap = token = caller = None
        try:
            caller = caller_frame(1)
            cid = rec.n_calls
            if cid - calls.base >= rec.chunk_rows:   # pack finished rows: memory stays bounded
                calls.freeze_below(s.call_stack[0] if s.call_stack else cid)
            data = calls.data
            rec.n_calls = cid + 1
            parent = s.call_stack[-1] if s.call_stack else -1
            if parent >= 0:
                src = data[(parent - calls.base) * CALL_WIDTH + C_SRC]   # nested calls inherit the user line
            elif s.want_source:
                src = rec.sources(user_location_from(caller))   # the walk starts where caller_frame stopped
            else:
                src = 0
            if parent < 0 and s.want_modules:
                s.modules.at(caller)   # the module whose call encloses this one (nested calls inherit it)
            ac = autocast_state() if _any_autocast is None or _any_autocast() else None
            cap = s.capture
            token = cap.call_begin(func) if (cap is not None and parent < 0) else None   # native: func decides the warning redirect
            # func, module, src, first_seq, n_ops, autocast, parent, error, start, dur
            data.extend((rec.call_funcs(named), s.modules.current, src, s.seq, 0, rec.autocasts(ac) if ac else 0,
                         parent, -1, _perf() - s.t0, 0))
            s.call_stack.append(cid)
            s.current_call = cid
        except Exception as e:  # a tracer bug must never reach user code
            rec.tracer_error("function mode (enter)", e)
            if token is not None:   # native capture: never leave a call open (its warning redirect)
                try:
                    cap.call_end(token)
                except Exception as e5:
                    rec.tracer_error("function mode (enter)", e5)
            try:
                return func(*args, **kwargs)
            except BaseException as e6:
                clean_traceback(e6)
                clean_when_caught(1)
                raise
        t0 = _perf()
        s.own_ns += t0 - e0
        try:
            if keep == LAZY and getattr(named, "__name__", None) in PRINTING:
                with s.printing():
                    return call_from(caller, func, args, kwargs)
            return call_from(caller, func, args, kwargs)   # warnings keep the user's location
        except BaseException as e:
            try:
                base = (cid - calls.base) * CALL_WIDTH
                if seen_exc(s.last_exc_key, e, cid):
                    data[base + C_ERROR] = s.last_error_id
                else:
                    data[base + C_ERROR] = s.last_error_id = s.record_exception(
                        e, seq=None, call_id=cid, op=None, info=cap.error_info(e) if cap is not None else None)
                    s.last_exc_key = exc_mark(e, cid)
            except Exception as e2:
                rec.tracer_error("function mode (error)", e2)
            clean_traceback(e)
            clean_when_caught(1)
            raise
        finally:
            t1 = _perf()
            try:
                data = calls.data
                base = (cid - calls.base) * CALL_WIDTH
                data[base + C_DUR] = t1 - t0
                data[base + C_N_OPS] = s.seq - data[base + C_FIRST_SEQ]
                stack = s.call_stack
                if stack and stack[-1] == cid:
                    stack.pop()
                s.current_call = stack[-1] if stack else -1
            except Exception as e:
                rec.tracer_error("function mode (exit)", e)
            ws = None
            if token is not None:   # its own try: the native capture's call must always end
                try:
                    ws = cap.call_end(token)
                    if ws:
                        s.record_warnings(ws, call_id=cid, seq=None)
                except Exception as e:
                    rec.tracer_error("function mode (exit)", e)
            if keep == LAZY and not ws:
                try:
                    _drop_if_empty(rec, calls, cid)
                except Exception as e:
                    rec.tracer_error("function mode (exit)", e)
            s.own_ns += _perf() - t1


def _drop_if_empty(rec: Recorder, calls: CallStore, cid: int) -> None:
    """Forget call ``cid`` if it dispatched no op, raised nothing and nothing nested was recorded."""
    data = calls.data
    base = (cid - calls.base) * CALL_WIDTH
    if (rec.n_calls == cid + 1 and base >= 0 and len(data) == base + CALL_WIDTH
            and data[base + C_N_OPS] == 0 and data[base + C_ERROR] < 0):
        del data[base:]
        rec.n_calls = cid


register_tracer_code(TracingFunctionMode.__torch_function__)


# ---------------------------------------------------------------------------
# the native function mode: the hot path above, in C (native/fmode.cpp)
# ---------------------------------------------------------------------------
#: kinds as native/fmode.cpp numbers them (PRINTING: a LAZY conversion that prints a tensor)
_C_PRINTING = CALL_KINDS["PRINTING"]


class NativeFunctionMode(TorchFunctionMode):
    """The function mode of the native engine: ``__torch_function__`` is ``fm.torch_function``, a C
    builtin set on the instance (torch looks the attribute up on the mode object), so a traced call
    adds no Python frame. It produces the same ``calls`` rows as :class:`TracingFunctionMode` (the
    oracle: tests/test_fmode.py compares them); the ``c_*`` members are what the C code calls on a
    cache miss or a rare path. The class-level ``__torch_function__`` is what Dynamo sees while it
    compiles (the instance attribute is hidden then): a plain call, so compiled code stays compiled.
    """

    def __init__(self, ctx: NativeRecordingContext, fm: Any) -> None:
        super().__init__()
        self.ctx = ctx   # the recording context (recording/context.py); ctx.fmode is ``fm``
        self._fm = fm
        rec = ctx.rec
        self._rec = rec
        self._closed = False
        # what the C code calls (looked up once, at configure)
        self.c_classify = self._classify
        self.c_user_src = lambda f: rec.sources(user_location_from(f))
        self.c_module_at = ctx.modules.at
        self.c_autocast = lambda: rec.autocasts(autocast_state())
        self.c_on_error = self._on_error
        self.c_on_warnings = self._on_warnings
        self.c_tracer_error = rec.tracer_error
        self.c_trampoline_for = trampoline_for
        self.c_printing = ctx.ext.pause
        self.c_is_internal = _source._is_internal
        self.c_any_autocast = _any_autocast if _any_autocast is not None else (lambda: True)
        self.c_htf_code = _HTF_CODE if _HTF_CODE is not None else object()
        self.c_mod_code = _MOD_CODE if _MOD_CODE is not None else object()
        self.c_cacheable = _plain_modules
        self._calls = rec.calls = LiveCalls(fm)
        self._bound = fm.bind(self)
        self.__dict__["__torch_function__"] = self._bound   # the instance attribute torch calls (its __self__ is the mode)

    def __torch_function__(self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if _is_compiling():   # Dynamo traces this (the instance attribute is hidden while it compiles)
            return func(*args, **kwargs)
        return self._fm.torch_function(func, types, args, kwargs)

    def __enter__(self) -> NativeFunctionMode:
        s = self.ctx
        self._fm.configure(self, s.ext.fmode_state, s.t0, bool(s.want_source), bool(s.want_modules))
        try:
            self._compile_callbacks(True)
            if s.capture is not None:
                s.capture.count_call_warnings(self._fm.warning)
            return super().__enter__()  # type: ignore[no-untyped-call,no-any-return]  # torch's TorchFunctionMode.__enter__ is untyped
        except BaseException:
            self.finish()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            return super().__exit__(*exc)  # type: ignore[no-untyped-call,no-any-return]  # torch's TorchFunctionMode.__exit__ is untyped
        finally:
            self.finish()

    def finish(self) -> None:
        """Stop recording and move the rows into ``rec.calls`` (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.ctx.capture is not None:
            self.ctx.capture.count_call_warnings(None)
        self._compile_callbacks(False)
        own_ns, own_calls, seen = self._fm.stats()["own"]   # the sampled calls' own time, for every call
        self._rec.own_calls_ns = own_ns * seen // own_calls if own_calls else None
        raw, n, first, packed = self._fm.take()
        self._calls.handover(raw, n, first, packed)
        self._rec.n_calls = n
        # take() dropped the C side's references to the c_* callbacks; this mode's own (bound
        # methods of itself: a cycle) go too, so the recorder is freed with the session
        for name in [k for k in self.__dict__ if k.startswith("c_")]:
            del self.__dict__[name]
        self.__dict__.pop("__torch_function__", None)
        self._bound = None

    # -- torch.compile: Dynamo must see the Python handler, not the C builtin ---------------------
    def _compile_callbacks(self, on: bool) -> None:
        cb, self._cb = getattr(self, "_cb", None), None
        if cb is not None:
            cb.remove()
        if on:
            self._cb = CompileCallbacks(lambda *a, **k: self.__dict__.pop("__torch_function__", None),
                                        lambda *a, **k: self.__dict__.__setitem__("__torch_function__", self._bound))

    # -- what the C code calls -------------------------------------------------------------------
    def _classify(self, func: Callable[..., Any]) -> int:
        kind, named = _classify(func)
        if kind == LAZY and getattr(named, "__name__", None) in PRINTING:
            kind = _C_PRINTING
        fid = self._rec.call_funcs(named) if kind != DIRECT else 0
        return kind | (fid << KIND_BITS)

    def _on_error(self, cid: int, e: BaseException, _htf: bool) -> Optional[int]:
        s = self.ctx
        try:
            if seen_exc(s.last_exc_key, e, cid):
                return s.last_error_id
            cap = s.capture
            s.last_error_id = s.record_exception(
                e, seq=None, call_id=cid, op=None, info=cap.error_info(e) if cap is not None else None)
            s.last_exc_key = exc_mark(e, cid)
            return s.last_error_id
        finally:
            clean_traceback(e)   # the trampoline's entries (Python-level torch functions) go
            if _htf:   # handle_torch_function called us (no frame of ours between): watch the user's
                clean_when_caught(1)   # frame, so an except in the block sees the untraced traceback

    def _on_warnings(self, cid: int, n_tap: int) -> int:
        s = self.ctx
        cap = s.capture
        if cap is not None:
            ws = cap.take_call_warnings(n_tap, s.engine)
        else:   # no capture: the engine's per-op warnings only
            ws = s.engine.take_warnings() if s.ext.warnings_pending() else []
        if ws:
            s.record_warnings(ws, call_id=cid, seq=None)
        return len(ws)


def _plain_modules(inner: torch.nn.Module, outer: torch.nn.Module) -> bool:
    """Whether the module path of a call between these two module calls depends on them alone."""
    for m in (inner, outer):
        if type(m).__name__ == "OptimizedModule" or (_GraphModule is not None and isinstance(m, _GraphModule)):
            return False
    return True


register_tracer_code(NativeFunctionMode.__torch_function__)
