"""Output fingerprints (``fingerprints=True``): the python engine's per-op probe, and the record
layout the native engine hands over.

A fingerprint describes an op's first real floating output (fresh, or written in place): a bitwise
hash of its values in logical (row-major) order and float64 statistics of the finite ones (count of
NaN/Inf, sum, sum of ``|x|``, largest ``|x|``). The values are read from the tensor's memory with
numpy (no op is dispatched, so nothing reaches another mode, the profiler or autograd); the native
engine computes the same hash in ``native/engine_screen.h`` (``fingerprint``), so traces recorded by
either engine compare. The hash is ``mix(sum_i mix(bits_i, i), numel)`` (wrapping 64-bit sums) with
``mix(b, i) = x ^ (x >> 31)``, ``x = (b ^ i*K1) * K2``: order-free across lanes, exact per bit.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import torch

from .opfacts import FUNC_INFOS, MAYBE_ALIAS, NOSCREEN, FuncInfo, plain, tensor_args

#: the native engine's FpRec (engine_screen.h): seq, hash, nonfinite, sum, abs_sum, max_abs
FP_RECORD = np.dtype([("seq", "<i8"), ("hash", "<u8"), ("nonfinite", "<i8"), ("sum", "<f8"),
                      ("abs_sum", "<f8"), ("max_abs", "<f8")])

K1 = 0x9E3779B97F4A7C15
K2 = 0xBF58476D1CE4E5B9
_M64 = (1 << 64) - 1
_K1 = np.uint64(K1)
_K2 = np.uint64(K2)
_S31 = np.uint64(31)
_S16 = np.uint32(16)

#: dtype -> (raw integer type, how the raw integers become float values)
_RAW: dict[torch.dtype, tuple[Any, Any]] = {
    torch.float32: (np.uint32, lambda b: b.view(np.float32)),
    torch.float64: (np.uint64, lambda b: b.view(np.float64)),
    torch.float16: (np.uint16, lambda b: b.view(np.float16)),
    torch.bfloat16: (np.uint16, lambda b: (b.astype(np.uint32) << _S16).view(np.float32)),
}

Fingerprint = tuple[int, int, float, float, float]


def mix(b: int, i: int) -> int:
    """The per-element mix, on Python ints (the final step: ``mix(sum, numel)``)."""
    x = ((b ^ ((i * K1) & _M64)) * K2) & _M64
    return x ^ (x >> 31)


class _Memory:
    """What ``np.asarray`` reads a strided view of raw memory from (the array interface)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], typestr: str) -> None:
        self.__array_interface__ = {"data": (ptr, True), "shape": shape, "strides": strides, "typestr": typestr,
                                    "version": 3}


#: idx * K1 (wrapping), kept for the largest tensor seen so far (up to 4M elements): sliced per op
_IK: list[np.ndarray] = [np.zeros(0, np.uint64)]


def _ik(n: int) -> np.ndarray:
    ik = _IK[0]
    if n > 1 << 22:   # bigger than 32 MiB of indices: made for this tensor alone, not kept
        big: np.ndarray = np.arange(n, dtype=np.uint64)
        big *= _K1   # arrays wrap silently
        return big
    if len(ik) < n:
        ik = np.arange(max(n, 2 * len(ik)), dtype=np.uint64)
        ik *= _K1
        _IK[0] = ik
    return ik[:n]


def raw_values(t: torch.Tensor) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(raw bits, float values) of a plain real-float CPU tensor in logical order, read from its
    storage without dispatching anything; None when it is not one."""
    spec = _RAW.get(t.dtype)
    if spec is None or t.device.type != "cpu" or not plain(t) or t.is_nested or t.is_sparse:
        return None
    utype, as_float = spec
    n = t.numel()
    if n == 0:
        e = np.zeros(0, utype)
        return e, as_float(e).astype(np.float64)
    ptr = t.data_ptr()
    if not ptr:
        return None
    item = np.dtype(utype).itemsize
    # a numpy view of the tensor's memory (its shape and strides), made from the address alone:
    # nothing is dispatched and no reference to the tensor is kept
    view = np.asarray(_Memory(ptr, tuple(t.shape), tuple(s * item for s in t.stride()), np.dtype(utype).str))
    bits = np.ascontiguousarray(view).reshape(-1)   # a copy: the tensor's memory is never held
    return bits, as_float(bits).astype(np.float64)


def fingerprint(t: torch.Tensor) -> Optional[Fingerprint]:
    """(hash, nonfinite, sum, abs_sum, max_abs) of ``t``, or None (not a real float CPU tensor)."""
    rv = raw_values(t)
    if rv is None:
        return None
    bits, vals = rv
    n = len(bits)
    if n == 0:
        return (mix(0, 0), 0, 0.0, 0.0, 0.0)
    # integer arrays wrap silently (no overflow warning, unlike numpy scalars)
    x = bits.astype(np.uint64)
    x ^= _ik(n)
    x *= _K2
    x ^= x >> _S31
    h = int(x.sum(dtype=np.uint64))
    fin = np.isfinite(vals)
    nf = n - int(np.count_nonzero(fin))
    good = vals if nf == 0 else vals[fin]
    ab = np.abs(good)
    return (mix(h, n), nf, float(good.sum()), float(ab.sum()), float(ab.max()) if len(ab) else 0.0)


class Fingerprinter:
    """The python engine's probe: ``post`` after every op, the fingerprint of its first real
    floating output that is fresh or written (views and aliases of an input are not; ops returning
    uninitialised memory are not): the outputs the native engine fingerprints."""

    def __init__(self) -> None:
        self.n = 0

    def post(self, func: Any, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]],
             outs: Sequence[torch.Tensor]) -> Optional[Fingerprint]:
        try:
            info = FUNC_INFOS.get(func)
            if info is None:
                info = FUNC_INFOS[func] = FuncInfo(func)
            if info.screen == NOSCREEN:
                return None
            in_ptrs: Optional[set[int]] = None
            for t in outs:
                if t.dtype not in _RAW:
                    continue
                if not info.inplace:
                    if in_ptrs is None:

                        in_ptrs = {a.data_ptr() for a in tensor_args(args, kwargs)}
                    if info.screen == MAYBE_ALIAS and t.data_ptr() in in_ptrs:
                        continue
                r = fingerprint(t)
                if r is not None:
                    self.n += 1
                    return r
            return None
        except Exception:
            return None
