"""The numerics shadow: a per-op probe of the python engine's dispatch mode (``numerics=``).

It runs inside ``__torch_dispatch__``, where the tracing modes are inactive, so the extra ops
it dispatches are invisible to the trace; it reads user tensors only, draws no random numbers,
keeps no reference to a tensor after the op returns and builds no autograd graph.

``NumericsShadow`` (``numerics='fp32'|'fp64'``): recomputes ops with 16-bit
(and with 'fp64', float32) floating inputs on upcast copies and reports the
norm-wise relative error and the max absolute error of the real output
against that reference. Ops that draw random numbers are skipped (and counted),
as are in-place/out= ops (their inputs are gone when the probe runs). It is a
debugging mode: every compared op runs twice, and on CUDA reading the error
back synchronises once per op.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch

from ...opfacts import BF16, F16, F32, F64, REL, SEEDED_NAMES, SHADOW_SKIP_SILENT, is_float, op_name, plain, tensor_args

Tensor = torch.Tensor


def rel_errors(real: Tensor, ref: Tensor) -> tuple[float, float]:
    """Norm-wise relative error ``||real - ref|| / ||ref||`` and max |real - ref|, in ``ref``'s dtype.

    Positions where both are the same non-finite value (both inf of one sign,
    both NaN) agree; a non-finite value on one side only makes the error inf.
    """
    r = real.to(ref.dtype)
    same = (r == ref) | (torch.isnan(r) & torch.isnan(ref))
    diff = torch.where(same, torch.zeros((), dtype=ref.dtype, device=ref.device), r - ref)
    diff = diff.abs()   # |complex| is its modulus: one call for both kinds
    mx = float(diff.max()) if diff.numel() else 0.0
    ref_f = torch.where(torch.isfinite(ref), ref, torch.zeros((), dtype=ref.dtype, device=ref.device))
    num = float(torch.linalg.vector_norm(diff)) if diff.numel() else 0.0
    den = float(torch.linalg.vector_norm(ref_f)) if ref_f.numel() else 0.0
    if math.isnan(mx):
        mx = math.inf
    if math.isnan(num):
        num = math.inf
    if num == 0.0:
        rel = 0.0
    elif den == 0.0:
        rel = math.inf
    else:
        rel = num / den
    return rel, mx


class NumericsShadow:
    """Recompute low-precision ops in a wider dtype; report the real output's error against it."""

    def __init__(self, mode: Union[str, bool, None] = "fp32"):
        if mode in (True, None):
            mode = "fp32"
        if mode not in ("fp32", "fp64"):
            raise ValueError(f"numerics mode must be 'fp32' or 'fp64', not {mode!r}")
        self.mode = mode
        self.ref_dtype = F32 if mode == "fp32" else F64
        self.low = frozenset({F16, BF16}) if mode == "fp32" else frozenset({F16, BF16, F32})
        self.skipped: dict[str, int] = {}
        self.skip_reasons: dict[str, str] = {}
        self.n_compared = 0
        self._kinds: dict[Any, Optional[str]] = {}

    def _kind(self, func: Any) -> Optional[str]:
        """None: shadow it; "" skip silently (nothing to compare); else the reason it is skipped."""
        k = self._kinds.get(func, "?")   # "?": not seen yet (None and "" are verdicts)
        if k != "?":
            return k
        name = op_name(func)
        tags = getattr(func, "tags", ()) or ()
        if torch.Tag.nondeterministic_seeded in tags or name in SEEDED_NAMES:
            k = "nondeterministic_seeded"
        elif getattr(func, "is_view", False) or name in SHADOW_SKIP_SILENT:
            k = ""
        else:
            k = None
            try:
                for a in func._schema.arguments:
                    if a.alias_info is not None and a.alias_info.is_write:
                        k = "in-place/out= (its inputs are overwritten before the probe runs)"
                        break
            except Exception:
                pass
        self._kinds[func] = k
        return k

    def report(self) -> dict[str, Any]:
        """For the trace metadata: mode, ops compared, ops skipped and why."""
        return {"mode": self.mode, "compared": self.n_compared, "skipped": dict(self.skipped),
                "skip_reasons": dict(self.skip_reasons)}

    def _skip(self, func: Any, reason: str) -> None:
        name = str(func)
        self.skipped[name] = self.skipped.get(name, 0) + 1
        self.skip_reasons.setdefault(name, reason)

    def compare(self, seq: int, func: Any, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]],
                outs: Sequence[Tensor]) -> Optional[REL]:
        if not outs:
            return None
        try:
            low = self.low
            has_low = False
            for t in tensor_args(args, kwargs):
                if t.dtype in low and plain(t):
                    has_low = True
                    break
            if not has_low:
                return None
            kind = self._kind(func)
            if kind is not None:
                if kind:
                    self._skip(func, kind)
                return None
            pairs = [(i, o) for i, o in enumerate(outs) if isinstance(o, Tensor) and is_float(o) and plain(o)]
            if not pairs:
                return None
            with torch.no_grad():
                ref = self._reference(func, args, kwargs)
                if ref is None:
                    return None
                refs = [ref] if isinstance(ref, Tensor) else [r for r in ref if isinstance(r, Tensor)] \
                    if isinstance(ref, (list, tuple)) else []
                rel = mx = 0.0
                got = False
                for i, o in pairs:
                    if i >= len(refs):
                        continue
                    r = refs[i]
                    if not isinstance(r, Tensor) or r.shape != o.shape or not is_float(r):
                        continue
                    wide = r.dtype if r.dtype in (F32, F64) or r.dtype.is_complex else self.ref_dtype
                    if wide.itemsize < self.ref_dtype.itemsize and not wide.is_complex:
                        wide = self.ref_dtype
                    a, b = rel_errors(o, r.to(wide))
                    rel, mx = max(rel, a), max(mx, b)
                    got = True
            if not got:
                return None
            self.n_compared += 1
            return rel, mx
        except Exception as e:
            try:
                self._skip(func, f"reference failed: {type(e).__name__}")
            except Exception:
                pass
            return None

    def _up(self, a: Any) -> Any:
        """``a`` with its low-precision tensors and dtypes (inside lists and tuples) widened to the reference dtype."""
        if isinstance(a, Tensor):
            if a.dtype in self.low and plain(a):
                return a.to(self.ref_dtype)
            return a
        if isinstance(a, torch.dtype):
            # sum(dtype=float16), softmax(x, 1, torch.bfloat16): the reference computes wide too
            return self.ref_dtype if a in self.low else a
        if type(a) is list or type(a) is tuple:
            return type(a)(self._up(b) for b in a)
        return a

    def _reference(self, func: Any, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]]) -> Any:
        new_args = [self._up(a) for a in args]
        new_kwargs = {k: self._up(v) for k, v in kwargs.items()} if kwargs else {}
        name = op_name(func)
        if name in ("_softmax", "_log_softmax") and len(new_args) >= 3:
            new_args[2] = False   # half_to_float is only legal on half inputs
        return func(*new_args, **new_kwargs)
