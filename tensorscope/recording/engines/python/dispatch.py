"""The TorchDispatchMode: one ``ops`` row per ATen operator call. The hot path.

Per op it appends integers only (see recorder.py): interned ids of the op, of
the tuple of input metas and output metas, of the alias tuple, the module and
call ids, autograd node and sequence number, flags, FLOPs and times; storage
ids go to one flat column. Input metadata is read *before* ``func`` runs
(``t_``, ``resize_`` and out= change inputs in place). Outputs are never kept:
a strong reference changes the program (an extra ``aten.detach`` after factory
ops). Everything derivable later (names, formats, bytes, source
lines, hidden copies) is derived when the tables are built.

``ignore_compile_internals()`` is True so torch.compile'd code keeps running
compiled (a default mode makes Dynamo skip the frame for good); what the
compiled artifact calls is then all we see, and the summary says so.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Literal,
    Optional,
    Union,
    cast,
)

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ....tracking.storages import StorageTracker, fake_key
from ....tracking.storages import is_fake as _is_fake
from ...frames import clean_traceback, exc_mark, register_tracer_code
from ...opfacts import FLOP_AT_BUILD, FLOP_NONE, is_composite, op_schema_facts, schema_inputs, tensor_args
from ...recorder import F_BACKWARD, F_INPLACE, F_OUT_KW, Recorder
from ...source import called_from_compiled_code

if TYPE_CHECKING:
    from array import array

    from torch.autograd.graph import Node

    from ...context import RecordingContext
    from ...protocols import OpScreen

Tensor = torch.Tensor
_STRIDED = torch.strided
_perf = time.perf_counter_ns
#: None outside a backward pass (torch's stub says it always returns a node)
_current_node: Callable[[], Optional[Node]] = torch._C._current_autograd_node
_get_seq_nr = torch._C._autograd._get_sequence_nr


class OpInfo:
    """Per-OpOverload facts of one trace: its id there, flags, FLOP formula, whether it is hooked."""

    __slots__ = ("op_id", "flags", "flop", "flop_at_build", "hook")

    def __init__(self, rec: Recorder, func: Any, hook_namespaces: frozenset[str] = frozenset()) -> None:
        self.op_id = rec.funcs(func)
        self.hook = bool(hook_namespaces) and getattr(func, "namespace", None) in hook_namespaces
        self.flags, self.flop_at_build, self.flop = op_schema_facts(func)


_CIA = torch._C.DispatchKey.CompositeImplicitAutograd
_has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
_key_for_device = getattr(torch._C, "_dispatch_key_for_device", None)

#: OpOverload -> {device type: decompose?} for ops with a CompositeImplicitAutograd kernel;
#: None for every other op (the common case: one dict lookup per op)
_COMPOSITE: dict[Any, Optional[dict[str, bool]]] = {}


def _call_device_type(args: Sequence[Any], kwargs: Optional[Mapping[str, Any]]) -> str:
    """The device type whose backend kernel eager would pick: the first tensor argument's (one
    level of lists), else a ``device`` argument, else the default device."""
    for a in args:
        if isinstance(a, Tensor):
            return a.device.type
        if type(a) is list or type(a) is tuple:
            for b in a:
                if isinstance(b, Tensor):
                    return b.device.type
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, Tensor):
                return a.device.type
        d = kwargs.get("device")
        if d is not None:
            try:
                return torch.device(d).type
            except Exception:
                pass
    try:
        return torch.get_default_device().type
    except Exception:   # torch < 2.3
        return "cpu"


def _eager_decomposes(func: Any, device_type: str) -> bool:
    """Would eager run ``func``'s CompositeImplicitAutograd kernel on this backend?

    The dispatcher fills a backend's slot with the composite only when the op has no kernel of
    its own for that backend: ``aten::silu_backward`` has a CPU kernel *and* a composite, and
    eager runs the CPU kernel (other bits than the composite's ``sigmoid`` arithmetic). A Python
    mode receives such an op whole, as it receives every composite under ``inference_mode``
    (autograd keys excluded), so only the backend's own registration decides.
    """
    try:
        key = _key_for_device(device_type) if _key_for_device is not None else None
        name = func.name()
        if key is None:
            key = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta"}.get(device_type)
        if key is None:
            return True   # unknown backend: the composite, as before
        return not _has_kernel(name, str(key).split(".")[-1])
    except Exception:
        return True


def _should_decompose(func: Any, per_device: Union[dict[str, bool], None, Literal[False]], args: Sequence[Any],
                      kwargs: Optional[Mapping[str, Any]]) -> bool:
    """``per_device`` is ``_COMPOSITE.get(func, False)``; the caller skips this call when it is None."""
    if per_device is False:
        per_device = _COMPOSITE[func] = {} if is_composite(func) else None
    if per_device is None:
        return False
    dev = _call_device_type(args, kwargs)
    d = per_device.get(dev)
    if d is None:
        d = per_device[dev] = _eager_decomposes(func, dev)
    return d and _dense_args(args, kwargs)


def _dense_args(args: Sequence[Any], kwargs: Optional[Mapping[str, Any]]) -> bool:
    """Only plain strided tensors: nested/sparse/mkldnn inputs have their own kernels (linear has a
    NestedTensor one), which eager would run instead of the composite."""
    for a in list(args) + (list(kwargs.values()) if kwargs else []):
        ts = a if (type(a) is list or type(a) is tuple) else (a,)
        for t in ts:
            if isinstance(t, Tensor) and (t.layout != torch.strided or t.is_nested or
                                          (type(t) is not Tensor and type(t) is not torch.nn.Parameter)):
                return False
    return True


# torch's TorchDispatchMode.__init_subclass__ is untyped
class TracingDispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The python engine's op observer: a TorchDispatchMode that runs each ATen op unchanged and records
    its row (shapes, dtypes, strides, aliasing, phase, module, time) into the recording context."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, ctx: RecordingContext) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode.__init__ is untyped
        self.ctx = ctx   # the recording context (recording/context.py): all the mode reads and writes
        self._infos: dict[Any, OpInfo] = {}   # OpOverload -> its facts
        # autograd's sequence counter as the last op left it: a forward op created a node (and may
        # claim ``counter - 1``) only if the counter advanced since, so an op that created none
        # never claims a node made before the trace or by an op we did not record
        self._seq_mark = _get_seq_nr()

    def _new_info(self, func: Any) -> OpInfo:
        s = self.ctx
        info = self._infos[func] = OpInfo(s.rec, func, s.op_hooks.namespaces)
        return info

    def _new_node(self, nt: type, node: Node) -> int:
        s = self.ctx
        node_id = s.node_names[nt] = s.rec.nodes(node.name())
        return node_id

    def _describe(self, ts: Sequence[Tensor], alloc: bool, stor: array[int], module_id: int,
                  call_id: int) -> tuple[list[int], list[int]]:
        """Meta ids (and storage ids, appended to ``stor``) of tensors ``ts``; also their data pointers."""
        rec = self.ctx.rec
        metas = rec.metas
        ids = metas.ids
        tracker = cast("Optional[StorageTracker]", self.ctx.tracker)   # the python engine's own
        by_ptr = tracker.by_ptr if tracker is not None else None
        fake_keys = tracker is not None and tracker.fake_keys
        mids: list[int] = []
        ptrs: list[int] = []
        for t in ts:
            try:
                st = t.stride() if t.layout is _STRIDED else None   # sparse/mkldnn: no meaningful strides
            except Exception:   # nested: no strides
                st = None
            try:
                key: tuple[Any, ...] = (t.shape, st, t.dtype, t.device)
            except Exception:   # nested tensors have no single shape
                key = ((), st, t.dtype, t.device)
            mid = ids.get(key)
            if mid is None:
                mid = metas.add(key, key[0], st, key[2], key[3])
            mids.append(mid)
            try:
                storage = t.untyped_storage()
                # under tensorscope.predict a FakeTensor's storage has no memory: keyed by its StorageImpl
                ptr = fake_key(storage) if fake_keys and _is_fake(t) else storage.data_ptr()
            except Exception:   # wrapper subclasses, sparse: storage unknown
                ptrs.append(0)
                stor.append(-1)
                continue
            ptrs.append(ptr)
            if by_ptr is None or tracker is None or ptr == 0:
                stor.append(-1)
            else:
                sid = by_ptr.get(ptr)   # known storage: no call into the tracker
                if sid is None:
                    sid = tracker.storage_id(storage, mid, alloc, module_id, call_id, ptr)
                stor.append(sid)
        return mids, ptrs

    def __torch_dispatch__(self, func: Any, types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        if kwargs is None:
            kwargs = {}
        s = self.ctx
        if not s.recording:
            try:
                return func(*args, **kwargs)
            finally:
                self._seq_mark = _get_seq_nr()
        # [layout/inference parity] CompositeImplicitAutograd ops (reshape, flatten, matmul,
        # linear, to...) reach this mode whole under inference_mode, and ops with a backend
        # kernel of their own (silu_backward) always do; decompose, with the mode re-entered as
        # FlopCounterMode does, exactly those eager would decompose on this backend
        per_device: Union[dict[str, bool], None, Literal[False]] = _COMPOSITE.get(func, False)
        if per_device is not None and _should_decompose(func, per_device, args, kwargs):
            # the C++ kernel eager runs, not func.decompose(): that prefers a Python
            # decomposition (upsample -> _unsafe_index) whose ops and bits differ from eager
            with self:
                return func._op_dk(_CIA, *args, **kwargs)
        e0 = _perf()   # tensorscope's own work before the op starts here (own_ns)
        rec = s.rec
        seq = s.seq
        s.seq = seq + 1
        try:
            info = self._infos.get(func) or self._new_info(func)   # an OpInfo is never falsy
            module_id = s.modules.current
            call_id = s.current_call
            stor = rec.storages
            ins = tensor_args(args, kwargs)
            in_mids, in_ptrs = self._describe(ins, False, stor, module_id, call_id)
            flags = info.flags
            node = _current_node()
            if node is None:
                node_id = 0
                # the autograd layer above this mode created the op's node before dispatching here
                cur = _get_seq_nr()
                seq_nr = cur - 1 if cur != self._seq_mark else -1
                if call_id < 0:
                    s.opaque_ops += 1   # no torch-level call around it: compiled code or a C++ caller
                    if called_from_compiled_code():
                        s.compiled_ops += 1
            else:
                flags |= F_BACKWARD
                nt = type(node)
                node_id = s.node_names.get(nt) or self._new_node(nt, node)   # interned ids are >= 1
                seq_nr = node._sequence_nr()
                if seq_nr >= 1 << 62:   # AccumulateGrad & co. carry UINT64_MAX: no forward op
                    seq_nr = -1
            screen = cast("Optional[OpScreen]", s.screen)   # the python engine's own
            pre_state = screen.pre(func, args, kwargs, True) if (screen is not None and flags & (F_INPLACE | F_OUT_KW)) else None
            if info.hook and flags & (F_INPLACE | F_OUT_KW) and s.op_hooks.before:
                s.op_hooks.call_before(seq, str(func), schema_inputs(func, args, kwargs))
            ok = True
        except Exception as e:
            rec.tracer_error("dispatch (before op)", e)
            ok = False
        cap = s.capture
        cuda = s.cuda_timer
        tok = None
        if cap is not None:
            cap.op_begin()
        if cuda is not None and ok:
            tok = cuda.begin_for(seq, ins, kwargs)
        t0 = _perf()
        own = s.own_ns + t0 - e0
        s.own_ns = own
        if ok:
            last = s.own_row
            if last >= rec.n_spilled:   # the tracer's time between the last row's end and this start
                rec.probe_ns[last] = own - s.own_mark   # (a row its own append spilled keeps null, as its part has it)
            s.own_row = seq
            s.own_mark = own
        try:
            out = func(*args, **kwargs)
            t1 = _perf()   # before the finally's bookkeeping: that is the tracer's, not the op's
        except BaseException as e:
            t1 = _perf()
            try:
                info_ = cap.error_info(e) if cap is not None else None
                s.last_error_id = s.record_exception(e, seq=seq, call_id=s.current_call, op=str(func), info=info_)
                s.last_exc_key = exc_mark(e, s.current_call)
                rec.op_errors[seq] = s.last_error_id
                if ok:
                    self._append(seq, info, flags, module_id, call_id, node_id, seq_nr, in_mids, in_ptrs, (), -1, t0, t1)
                    if info.hook:
                        s.op_hooks(seq, str(func), schema_inputs(func, args, kwargs), None)
                else:
                    s.seq = seq   # keep seq dense: no row was written
            except Exception as e2:
                rec.tracer_error("dispatch (error)", e2)
            clean_traceback(e)   # the tracer's frames go; the user's and torch's own stay
            raise
        finally:
            self._seq_mark = _get_seq_nr()
            if tok is not None and cuda is not None:
                try:
                    cuda.end(tok)
                except Exception as e3:
                    rec.tracer_error("cuda timer", e3)
            if cap is not None:
                try:
                    ws = cap.op_end()
                    if ws:
                        s.record_warnings(ws, call_id=s.current_call, seq=seq, op=str(func))
                except Exception as e4:
                    rec.tracer_error("native capture", e4)
        if not ok:
            s.seq = seq
            return out
        try:
            if type(out) is Tensor or isinstance(out, Tensor):
                outs: Sequence[Tensor] = (out,)
            elif type(out) is tuple or type(out) is list:
                outs = [o for o in out if isinstance(o, Tensor)]
            else:
                outs = ()
            flop = 0
            if info.flop is not None:
                try:
                    flop = int(info.flop(*args, **kwargs, out_val=out))
                except Exception:
                    flop = FLOP_NONE
            elif info.flop_at_build:
                flop = FLOP_AT_BUILD   # decode.py: from the interned input shapes
            else:
                flop = FLOP_NONE
            self._append(seq, info, flags, module_id, call_id, node_id, seq_nr, in_mids, in_ptrs, outs, flop, t0, t1)
            shadow = s.shadow
            if info.hook:
                s.op_hooks(seq, str(func), schema_inputs(func, args, kwargs),
                           tuple(out) if type(out) is tuple or type(out) is list else (out,))
            if screen is not None:
                rn = screen.post(seq, func, args, kwargs, outs, pre_state)
                if rn is not None:
                    rec.nonfinite[seq] = rn
            fps = s.fingerprints
            if fps is not None and outs:
                rf = fps.post(func, args, kwargs, outs)
                if rf is not None:
                    rec.fingerprints[seq] = rf
            if shadow is not None:
                rs = shadow.compare(seq, func, args, kwargs, outs)
                if rs is not None:
                    rec.numerics[seq] = rs
            if screen is not None or shadow is not None:
                self._seq_mark = _get_seq_nr()   # a probe's own ops must not look like the next op's node
        except Exception as e:
            rec.tracer_error("dispatch (after op)", e)
        s.own_ns += _perf() - t1   # the row, its probes and hooks: never the program's time
        return out

    def _append(self, seq: int, info: OpInfo, flags: int, module_id: int, call_id: int, node_id: int, seq_nr: int,
                in_mids: list[int], in_ptrs: list[int], outs: Sequence[Tensor], flop: int, t0: int, t1: int) -> None:
        s = self.ctx
        rec = s.rec
        stor = rec.storages
        if outs:
            out_mids: Sequence[int]
            out_mids, out_ptrs = self._describe(outs, True, stor, module_id, call_id)
            alias: list[int] = []
            for p in out_ptrs:
                a = -1
                if p:
                    for i, q in enumerate(in_ptrs):
                        if q == p:
                            a = i
                            break
                alias.append(a)
            alias_id = rec.aliases(tuple(alias))
        else:
            out_mids = ()
            alias_id = rec.aliases(())
        in_id = rec.tuples(tuple(in_mids))
        out_id = rec.tuples(tuple(out_mids))
        if not FLOP_AT_BUILD <= flop < 1 << 62:
            flop = FLOP_NONE
        # every value is computed above: the appends below cannot fail half-way and misalign columns
        rec.ops.data.extend((info.op_id, in_id, out_id, alias_id, module_id, call_id, node_id, seq_nr, flags, flop,
                             t0 - s.t0, t1 - t0))
        if seq + 1 - rec.chunk_start >= rec.chunk_rows:
            rec.end_chunk()


# the mode's frames are the tracer's (each mode registers its own handler: frames.py imports no mode)
register_tracer_code(TracingDispatchMode.__dict__.get("__torch_dispatch__"))
