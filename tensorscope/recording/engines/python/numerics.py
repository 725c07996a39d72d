"""The non-finite screen: the python engine's per-op probe (``nonfinite=True``).

``NonfiniteScreen``: ``pre()`` before in-place/out= ops, ``post()`` after every op (a cheap
screen per floating output, an exact count only when it fires, and the produced/propagated
verdict), ``finish()`` once at the end (CUDA counts read back in one copy). ``screen_finite``
and ``count_nonfinite`` are the two passes. The numerics shadow (``numerics=``) is ``shadow.py``.

Rules and details: docs/development/recording.md#the-non-finite-screen-recordingenginespythonnumericspy
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import torch

from ...opfacts import F16, FUNC_INFOS, MAYBE_ALIAS, NOSCREEN, FuncInfo, is_float, plain, tensor_args

Tensor = torch.Tensor
_STRIDED = torch.strided
_isfinite = math.isfinite

#: what identifies a tensor's data for the memos: (data pointer, shape, strides, dtype)
_TensorKey = tuple[int, torch.Size, tuple[int, ...], torch.dtype]
#: what ``pre`` hands ``post``: (a written tensor was non-finite before the op, the written data
#: pointers, the device slots describing them)
_PreState = tuple[bool, frozenset[int], list[int]]


def _scalar_nonfinite(args: Sequence[Any], kwargs: Optional[Mapping[str, Any]]) -> bool:
    """A non-finite Python float among the arguments (what the user wrote)."""
    for a in args:
        if type(a) is float and not _isfinite(a):
            return True
        if type(a) is complex and not (_isfinite(a.real) and _isfinite(a.imag)):
            return True
    if kwargs:
        for a in kwargs.values():
            if type(a) is float and not _isfinite(a):
                return True
    return False


#: at or below this many elements the screen reads values to Python: one
#: ``tolist`` (~1 µs) is cheaper than a reduction plus ``item`` (~2.6 µs)
SMALL = 64


def _finite_values(v: Iterable[Any]) -> bool:
    # Python's sum of floats is non-finite iff an element is (or it overflows:
    # a false alarm the exact count settles)
    s = sum(v)
    if type(s) is complex:
        return _isfinite(s.real) and _isfinite(s.imag)
    return _isfinite(s)


def screen_finite(t: Tensor) -> bool:
    """Cheap screen (CPU): True proves ``t`` finite; False means "count exactly"."""
    n = t.numel()
    if n == 0:
        return True
    dt = t.dtype
    if n <= SMALL and dt.itemsize > 1:
        d = t.dim()
        if d == 0:
            return _finite_values((t.item(),))
        v = t.tolist()
        if d == 1:
            return _finite_values(v)
        if d == 2:
            return _finite_values([x for row in v for x in row])
    if dt is F16 and n > 1:
        lo, hi = torch.aminmax(t)
        return _isfinite(lo.item()) and _isfinite(hi.item())
    if dt.is_complex:
        c = complex(t.sum().item())
        return _isfinite(c.real) and _isfinite(c.imag)
    if dt.itemsize == 1:   # float8: no sum kernel; rare enough to widen
        t = t.float()
    return _isfinite(t.sum().item())


def count_nonfinite(t: Tensor) -> int:
    """Exact number of NaN/Inf elements (x - x is NaN exactly there; faster than ~isfinite on CPU)."""
    if t.numel() == 0:
        return 0
    if t.dtype.itemsize == 1 and not t.dtype.is_complex:
        t = t.float()
    return int(torch.count_nonzero(torch.sub(t, t).ne_(0)))


def _key(t: Tensor) -> _TensorKey:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


def _version(t: Tensor) -> Optional[int]:
    try:
        return t._version
    except Exception:   # inference tensors have no version counter: never trust a memo for them
        return None


class NonfiniteScreen:
    """One per trace. ``pre`` before in-place/out= ops, ``post`` after every op, ``finish`` at the end."""

    #: screened tensors remembered for in-place ops; bounded so long traces stay small
    MEMO_MAX = 4096
    #: route CPU tensors through the deferred (device-buffer) path too: lets the CUDA
    #: logic run, and be tested, on a machine without a GPU
    defer_cpu = False

    def __init__(self) -> None:
        # key -> (version, finite) for CPU tensors that came out of a screened op
        self._memo: dict[_TensorKey, tuple[int, bool]] = {}
        self._cuda: Optional[_CudaFlags] = None
        self.n_screened = 0      # outputs screened
        self.n_fired = 0         # ops that held a non-finite value
        self.n_pre_screened = 0  # in-place targets screened before the op (memo misses)
        self._deferred = 0       # ops whose verdict came from the device buffer at finish()

    def _info(self, func: Any) -> FuncInfo:
        info = FUNC_INFOS.get(func)
        if info is None:
            info = FUNC_INFOS[func] = FuncInfo(func)
        return info

    def screens(self, func: Any) -> bool:
        """Whether ``post`` screens this op's outputs at all (views, aliases and ops returning
        uninitialised memory are not): the trace builder can leave those rows null."""
        return self._info(func).screen != NOSCREEN

    # -- per-op probes -----------------------------------------------------
    def pre(self, func: Any, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]],
            inplace: bool = True) -> Optional[_PreState]:
        """Before an in-place/out= op: the finiteness of what it will overwrite (and then read)."""
        try:
            info = self._info(func)
            if info.screen == NOSCREEN:
                return None
            written = self._written(info, args, kwargs)
            if not written:
                return None
            if not info.inplace:
                # out=: the old contents are not an input, unless the out tensor is also passed as one
                others = tensor_args(args, kwargs, skip_kw=info.write_kw)
                read = {t.data_ptr() for t in others if isinstance(t, Tensor)}
                written = [t for t in written if t.data_ptr() in read]
                if not written:
                    return None
            ptrs: list[int] = []
            bad = False
            cuda_refs: list[int] = []
            for t in written:
                if not plain(t) or not is_float(t):
                    continue
                ptrs.append(t.data_ptr())
                if info.overwrites:
                    continue   # not read: nothing to screen, only excluded from the inputs later
                if t.is_cuda or self.defer_cpu:
                    cuda_refs.append(self._cuda_flags().input_ref(t))
                    continue
                if not bad:
                    known = self._known(t)
                    if known is None:
                        self.n_pre_screened += 1
                        bad = not screen_finite(t) and count_nonfinite(t) > 0
                    else:
                        bad = not known
            if not ptrs:
                return None
            return (bad, frozenset(ptrs), cuda_refs)
        except Exception:
            return None

    def post(self, seq: int, func: Any, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]],
             outs: Sequence[Tensor], state: Optional[_PreState]) -> Optional[tuple[int, bool]]:
        """After an op: ``(count, produced)`` when a floating output holds NaN/Inf, else None."""
        info = FUNC_INFOS.get(func)
        if info is None:
            info = self._info(func)
        if info.screen == NOSCREEN:
            return None
        try:
            targets = outs
            if info.inplace and not targets:
                targets = self._written(info, args, kwargs)   # in-place ops that return nothing (_foreach_*_)
            elif info.screen == MAYBE_ALIAS:
                ptrs = {t.data_ptr() for t in tensor_args(args, kwargs)}
                targets = [t for t in targets if t.data_ptr() not in ptrs]
            count = 0
            cuda_outs: Optional[list[Tensor]] = None
            memo = self._memo
            for t in targets:
                dt = t.dtype
                if not (dt.is_floating_point or dt.is_complex):
                    continue
                if type(t) is not Tensor and not plain(t):
                    continue
                if t.layout is not _STRIDED or t.is_meta:
                    continue
                if t.is_cuda or self.defer_cpu:
                    if cuda_outs is None:
                        cuda_outs = []
                    cuda_outs.append(t)
                    continue
                self.n_screened += 1
                c = 0 if screen_finite(t) else count_nonfinite(t)
                count += c
                # remembered for a later in-place op on this very tensor (see pre)
                try:
                    memo[(t.data_ptr(), t.shape, t.stride(), dt)] = (t._version, c == 0)
                except Exception:   # inference tensors have no version counter
                    pass
            if len(memo) > self.MEMO_MAX:
                del memo[next(iter(memo))]
            if cuda_outs is not None:
                self._cuda_flags().record(seq, args, kwargs, cuda_outs, state, info)
            if not count:
                return None
            self.n_fired += 1
            return count, not self._inputs_nonfinite(info, args, kwargs, state)
        except Exception:
            return None

    def finish(self) -> dict[int, tuple[int, bool]]:
        """CUDA: one device-to-host read of every flag; ``{seq: (count, produced)}`` for bad ops."""
        self._memo.clear()
        if self._cuda is None:
            return {}
        try:
            self._deferred = len(self._cuda._ops)
            return self._cuda.resolve()
        finally:
            self._cuda = None

    # -- helpers -------------------------------------------------------------
    @staticmethod
    def _written(info: FuncInfo, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]]) -> list[Tensor]:
        out: list[Tensor] = []
        for i in info.write_pos:
            if i < len(args):
                a = args[i]
                if isinstance(a, Tensor):
                    out.append(a)
                elif type(a) is list or type(a) is tuple:
                    out.extend(b for b in a if isinstance(b, Tensor))
        for k in info.write_kw:
            a = kwargs.get(k) if kwargs else None
            if isinstance(a, Tensor):
                out.append(a)
            elif type(a) is list or type(a) is tuple:
                out.extend(b for b in a if isinstance(b, Tensor))
        return out

    def _known(self, t: Tensor) -> Optional[bool]:
        """Finiteness of ``t`` as last screened, if nothing wrote to it since (version counter); else None."""
        rec = self._memo.get(_key(t))
        if rec is None:
            return None
        v = _version(t)
        return rec[1] if (v is not None and rec[0] == v) else None

    def _inputs_nonfinite(self, info: FuncInfo, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]],
                          state: Optional[_PreState]) -> bool:
        if _scalar_nonfinite(args, kwargs):
            return True
        written_ptrs: frozenset[int] = frozenset()
        if state is not None:
            if state[0]:
                return True
            written_ptrs = state[1]
        skip_kw = info.write_kw
        for t in tensor_args(args, kwargs, skip_kw=skip_kw):
            if not is_float(t) or not plain(t) or t.is_cuda or self.defer_cpu:
                continue
            if info.inplace and t.data_ptr() in written_ptrs:
                continue   # overwritten by the op: its before-state is in ``state``
            if not screen_finite(t) and count_nonfinite(t) > 0:
                return True
        return False

    def _cuda_flags(self) -> _CudaFlags:
        if self._cuda is None:
            self._cuda = _CudaFlags(self.defer_cpu)
        return self._cuda

    def report(self) -> dict[str, int]:
        """Counters for the trace metadata."""
        out = {"screened": self.n_screened, "fired": self.n_fired, "pre_screened": self.n_pre_screened}
        if self._deferred:
            out["deferred"] = self._deferred
        return out


class _CudaFlags:
    """Device-side finite counts, read once at the end (no sync per op).

    Every screened CUDA tensor gets a slot in a per-device int64 buffer holding
    its number of *finite* elements, written by ``isfinite`` + ``sum`` + ``copy_``
    on the current stream: ordered with the op, asynchronous, exact (a host-side
    "count only when it fires" would need a sync to know it fired). Per op the
    host keeps only integers: output slots with their numel, and for inputs the
    slot that describes them (the output slot they came from, or a fresh screen
    of a tensor the trace did not produce).
    """

    GROW = 4096

    def __init__(self, defer_cpu: bool = False) -> None:
        self.defer_cpu = defer_cpu
        self._bufs: dict[torch.device, Tensor] = {}
        self._used: dict[torch.device, int] = {}
        self._slots: list[tuple[torch.device, int, int]] = []   # slot id -> (device, index, numel)
        self._memo: dict[_TensorKey, tuple[int, int]] = {}      # tensor key -> (version, slot id)
        self._ops: list[tuple[int, tuple[int, ...], tuple[int, ...], bool]] = []

    def _capturing(self) -> bool:
        try:
            return torch.cuda.is_current_stream_capturing()
        except Exception:
            return False

    def _slot(self, t: Tensor) -> int:
        dev = t.device
        buf = self._bufs.get(dev)
        used = self._used.get(dev, 0)
        if buf is None or used >= buf.numel():
            new = torch.zeros(max(self.GROW, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.int64, device=dev)
            if buf is not None:
                new[:used].copy_(buf[:used])
            buf = self._bufs[dev] = new
        idx = used
        self._used[dev] = used + 1
        finite = torch.isfinite(t).sum()
        buf.select(0, idx).copy_(finite)
        sid = len(self._slots)
        self._slots.append((dev, idx, t.numel()))
        return sid

    def input_ref(self, t: Tensor) -> int:
        """The slot describing ``t`` now: the one it was written to, or a fresh screen."""
        k = _key(t)
        rec = self._memo.get(k)
        v = _version(t)
        if rec is not None and v is not None and rec[0] == v:
            return rec[1]
        sid = self._slot(t)
        if v is not None:
            self._memo[k] = (v, sid)
        return sid

    def record(self, seq: int, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]], outs: Sequence[Tensor],
               state: Optional[_PreState], info: FuncInfo) -> None:
        if self._capturing():
            return   # extra kernels would become part of the user's CUDA graph
        written_ptrs: frozenset[int] = state[1] if state is not None else frozenset()
        in_slots = list(state[2]) if state is not None else []
        scalar_bad = _scalar_nonfinite(args, kwargs)
        for t in tensor_args(args, kwargs, skip_kw=info.write_kw):
            if not (t.is_cuda or self.defer_cpu) or not is_float(t) or not plain(t):
                continue
            if info.inplace and t.data_ptr() in written_ptrs:
                continue
            in_slots.append(self.input_ref(t))
        out_slots: list[int] = []
        for t in outs:
            sid = self._slot(t)
            out_slots.append(sid)
            v = _version(t)
            if v is not None:
                self._memo[_key(t)] = (v, sid)
        if len(self._memo) > 65536:
            # bounded: forgetting a key only costs one extra device screen later
            for k in list(self._memo)[:32768]:
                del self._memo[k]
        self._ops.append((seq, tuple(out_slots), tuple(in_slots), scalar_bad))

    def resolve(self) -> dict[int, tuple[int, bool]]:
        host = {dev: buf[: self._used.get(dev, 0)].cpu().tolist() for dev, buf in self._bufs.items()}
        bad = [0] * len(self._slots)
        for sid, (dev, idx, n) in enumerate(self._slots):
            bad[sid] = n - host[dev][idx]
        out: dict[int, tuple[int, bool]] = {}
        for seq, oslots, islots, scalar_bad in self._ops:
            c = sum(bad[s] for s in oslots)
            if c:
                out[seq] = (c, not (scalar_bad or any(bad[s] for s in islots)))
        self._bufs.clear()
        return out
