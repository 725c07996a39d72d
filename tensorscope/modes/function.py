"""The TorchFunctionMode: torch-level calls (``linear``, ``reshape``, ``backward``).

It is the outer of the two modes. Per call it appends one ``calls`` row (name,
module, user source line, autocast state, time, error) and sets the session's
current call id, which every ATen op dispatched inside inherits; the source
line is found here only (a frame walk per torch-level call, never per op).
Property getters and metadata queries (``size``, ``dim``, ``__get__``...) are
passed straight through unrecorded.
"""
from __future__ import annotations

import time

import torch
from torch.overrides import TorchFunctionMode

from .source import user_frame_location

# torch-level functions that are bookkeeping, not work: never recorded
NOISE_NAMES = frozenset({
    "__get__", "__set__", "__delete__", "size", "dim", "stride", "numel", "nelement", "ndimension",
    "_set_grad_enabled", "__repr__", "__str__", "__format__", "__len__", "__hash__", "__bool__",
    "__index__", "__int__", "__float__", "__contains__", "is_contiguous", "data_ptr", "storage_offset",
    "element_size", "is_floating_point", "is_complex", "is_signed", "get_device", "untyped_storage",
    "_is_view", "is_shared", "is_pinned", "__reduce_ex__", "__setstate__", "__getstate__", "__deepcopy__",
    "_has_compatible_shallow_copy_type", "is_inference", "requires_grad_", "retain_grad", "register_hook",
    "has_names", "is_nested", "is_sparse", "_version", "dim_order", "__dlpack_device__",
})

_perf = time.perf_counter_ns
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def _classify(func) -> bool:
    name = getattr(func, "__name__", None)
    return name is not None and name not in NOISE_NAMES


def autocast_state():
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
    def __init__(self, session):
        super().__init__()
        self.s = session
        self._kinds = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        keep = self._kinds.get(func)
        if keep is None:
            keep = self._kinds[func] = _classify(func)
        s = self.s
        if not keep or not s.recording:
            return func(*args, **kwargs)
        rec = s.rec
        cols = rec.calls
        try:
            cid = rec.n_calls
            rec.n_calls = cid + 1
            parent = s.call_stack[-1] if s.call_stack else -1
            if parent >= 0:
                src = cols.src[parent]   # nested calls inherit the user line
            elif s.want_source:
                src = rec.sources(user_frame_location(2))
            else:
                src = 0
            cols.func.append(rec.call_funcs(func))
            cols.module.append(s.modules.current)
            cols.src.append(src)
            cols.first_seq.append(s.seq)
            cols.n_ops.append(0)
            cols.parent.append(parent)
            cols.error.append(-1)
            ac = autocast_state()
            cols.autocast.append(rec.autocasts(ac) if ac else 0)
            s.call_stack.append(cid)
            s.current_call = cid
            cap = s.capture
            token = cap.call_begin() if (cap is not None and parent < 0) else None
            cols.start.append(_perf() - s.t0)
            cols.dur.append(0)
        except Exception as e:  # a tracer bug must never reach user code
            rec.tracer_error("function mode (enter)", e)
            return func(*args, **kwargs)
        t0 = _perf()
        try:
            return func(*args, **kwargs)
        except BaseException as e:
            try:
                if s.last_exc_id == id(e):
                    cols.error[cid] = s.last_error_id
                else:
                    cols.error[cid] = s.record_exception(e, seq=None, call_id=cid, op=None, info=None)
                    s.last_exc_id = id(e)
                    s.last_error_id = cols.error[cid]
            except Exception as e2:
                rec.tracer_error("function mode (error)", e2)
            raise
        finally:
            t1 = _perf()
            try:
                cols.dur[cid] = t1 - t0
                cols.n_ops[cid] = s.seq - cols.first_seq[cid]
                stack = s.call_stack
                if stack and stack[-1] == cid:
                    stack.pop()
                s.current_call = stack[-1] if stack else -1
                if token is not None:
                    ws = cap.call_end(token)
                    if ws:
                        s.record_warnings(ws, call_id=cid, seq=None)
            except Exception as e:
                rec.tracer_error("function mode (exit)", e)
