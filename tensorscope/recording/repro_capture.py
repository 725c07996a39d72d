"""capture=: the real arguments of chosen ops, saved as they ran, for ``t.repro()`` (the ``captures`` table).

An op hook on the ATen namespace (both engines call it right after each recorded op, with the op's
arguments in schema order and its outputs, or None when it raised) keeps the ops ``capture=`` asks
for: ``"errors"`` (the kernel raised), ``"nonfinite"`` (a floating output holds NaN/Inf; its mask is
kept too) or a set of seqs. Per op: one "call" row (the arguments as JSON: tensors by number,
numbers, dtypes, lists...) and one "input" row per CPU tensor argument holding the bytes it spans
from its storage offset, read from its memory with numpy (nothing dispatched, no reference kept).
The hook runs after the op; an argument the op writes (in-place, ``out=``) is copied before the op
ran: by ``before`` (the python engine calls it before such an op) or, under the native engine, in
C++ when the op starts (a memcpy of the memory it spans) and handed to ``written`` right before the
hook; its row says "captured before it ran" (or, where no copy was taken, "as the op left it").
Past ``capture_bytes`` the tensors of further ops are not saved (a note; their repro uses random
values), the call rows still are.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np
import pyarrow as pa
import torch

from .. import schema as S
from .fingerprint import _Memory, raw_values

NAMESPACES = ("aten", "prims")


def _op_schema(name: str) -> Any:
    ns, _, rest = name.partition(".")
    base, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, ns), base)
    return getattr(packet, overload or "default")._schema


def span_elements(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements of storage a strided view covers from its first one (0 when it is empty)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))


class InputCapture:
    """The op hook and the rows it keeps; ``table()`` at the end of the trace."""

    def __init__(self, what: Union[str, tuple[int, ...]], max_bytes: int) -> None:
        self.what = what
        self.seqs = frozenset(what) if isinstance(what, tuple) else frozenset()
        self.max_bytes = max_bytes
        self.used = 0
        self.rows: list[dict[str, Any]] = []
        self._pending: dict[int, Union[bytes, memoryview]] = {}   # tensor number -> its bytes before op _pending_seq
        self._pending_seq = -1
        self.notes: list[str] = []
        self.skipped = 0

    # -- the hooks -----------------------------------------------------------------------------
    def before(self, seq: int, name: str, inputs: Any) -> None:
        """Before an op that writes an argument (python engine): the bytes of the tensors it will
        write, kept until ``hook`` decides whether the op is captured."""
        if self.seqs and seq not in self.seqs:
            return
        try:
            schema = _op_schema(name)
        except Exception:
            return
        self._pending = {}
        k = 0
        for i, v in enumerate(inputs):
            a = schema.arguments[i] if i < len(schema.arguments) else None
            w = a is not None and a.alias_info is not None and a.alias_info.is_write
            for t in self._tensors(v):
                if w and t.device.type == "cpu" and t.layout == torch.strided:
                    n = span_elements(t.shape, t.stride()) * t.element_size()
                    if t.data_ptr() and n and n <= self.max_bytes - self.used:
                        self._pending[k] = np.asarray(_Memory(t.data_ptr(), (n,), (1,), "|u1")).tobytes()
                k += 1
        self._pending_seq = seq

    def written(self, seq: int, name: str, blobs: dict[int, memoryview]) -> int:
        """Native engine: the bytes of the tensors op ``seq`` wrote, copied before it ran (views valid
        until ``hook`` returns); returns the bytes this capture may still keep."""
        if name.replace("::", ".", 1).partition(".")[0] in NAMESPACES:   # not another hook's (c10d)
            self._pending = dict(blobs)
            self._pending_seq = seq
        return max(0, self.max_bytes - self.used)

    def hook(self, seq: int, name: str, inputs: Any, outputs: Any) -> None:
        try:
            self._hook(seq, name, inputs, outputs)
        finally:
            self._pending = {}   # the native engine's views end with this call

    def _hook(self, seq: int, name: str, inputs: Sequence[object], outputs: Optional[Sequence[object]]) -> None:
        if self._pending_seq != seq:
            self._pending = {}
        what = self.what
        if what == "errors":
            if outputs is not None:
                return
            why = "the op raised"
        elif what == "nonfinite":
            if outputs is None or not any(self._nonfinite(o) for o in self._tensors(outputs)):
                return
            why = "an output holds NaN/Inf"
        else:
            if seq not in self.seqs:
                return
            why = f"seq {seq} was asked for"
        self._capture(seq, name, list(inputs or ()), outputs, why)

    @staticmethod
    def _tensors(v: Any) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        stack = [v]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple)):
                stack.extend(reversed(x))
        return out

    @staticmethod
    def _nonfinite(t: torch.Tensor) -> bool:
        rv = raw_values(t)
        return rv is not None and bool(len(rv[1])) and not bool(np.isfinite(rv[1]).all())

    def _capture(self, seq: int, name: str, inputs: list[Any], outputs: Any, why: str) -> None:
        try:
            schema = _op_schema(name)
        except Exception:
            schema = None
        written: set[int] = set()
        names: list[Optional[str]] = []
        kw_only: list[bool] = []
        if schema is not None:
            for i, a in enumerate(schema.arguments):
                names.append(a.name)
                kw_only.append(bool(a.kwarg_only))
                if a.alias_info is not None and a.alias_info.is_write:
                    written.add(i)
        tensors: list[torch.Tensor] = []
        problems: list[str] = []

        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        tensor_written: list[bool] = []
        for i, v in enumerate(inputs):
            n0 = len(tensors)
            e = _encode_arg(v, tensors, problems)   # a module function: a recursive closure is a cycle holding the tensors
            tensor_written.extend([i in written] * (len(tensors) - n0))
            if i < len(kw_only) and kw_only[i]:
                kwargs[str(names[i])] = e
            else:
                args.append(e)
        call = {"op": name, "args": args, "kwargs": kwargs, "why": why, "problems": problems}
        self.rows.append({"seq": seq, "op": name, "kind": "call", "index": None, "dtype": None, "device": None,
                          "shape": None, "stride": None, "storage_offset": None,
                          "data": json.dumps(call).encode(), "note": why})
        for k, t in enumerate(tensors):
            self._input(seq, name, k, t, tensor_written[k])
        if outputs is not None and self.what == "nonfinite":
            for k, o in enumerate(self._tensors(outputs)):
                rv = raw_values(o)
                if rv is not None and len(rv[1]):
                    mask = ~np.isfinite(rv[1])
                    self.rows.append({"seq": seq, "op": name, "kind": "mask", "index": k, "dtype": "bool",
                                      "device": str(o.device), "shape": list(o.shape), "stride": list(o.stride()),
                                      "storage_offset": None, "data": np.packbits(mask).tobytes(), "note": None})

    def _input(self, seq: int, name: str, k: int, t: torch.Tensor, written: bool) -> None:
        row: dict[str, Any] = {"seq": seq, "op": name, "kind": "input", "index": k,
                               "dtype": str(t.dtype).replace("torch.", ""), "device": str(t.device),
                               "shape": list(t.shape), "stride": list(t.stride()),
                               "storage_offset": int(t.storage_offset()), "data": None, "note": None}
        notes = []
        before = self._pending.get(k) if written else None
        if written and before is None:
            notes.append("written by the op: captured as the op left it")
        elif written:
            notes.append("written by the op: captured before it ran")
        n = span_elements(t.shape, t.stride()) * t.element_size()
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_nested or type(t) not in (
                torch.Tensor, torch.nn.Parameter):
            notes.append("not a plain CPU tensor: random values in the repro")
        elif self.used + n > self.max_bytes:
            self.skipped += 1
            notes.append(f"capture_bytes ({self.max_bytes}) reached: random values in the repro")
            if self.skipped == 1:
                self.notes.append(f"capture_bytes={self.max_bytes} reached at seq {seq} ({name}): the inputs of "
                                  f"this and later ops were not saved; their repro scripts use random values")
        else:
            ptr = t.data_ptr()
            if before is not None and len(before) == n:
                row["data"] = bytes(before)   # a copy of a view: its memory is the engine's
            elif n and ptr:
                view = np.asarray(_Memory(ptr, (n,), (1,), "|u1"))
                row["data"] = view.tobytes()   # a copy
            else:
                row["data"] = b""
            self.used += n
        row["note"] = "; ".join(notes) or None
        self.rows.append(row)

    # -- the end ---------------------------------------------------------------------------------
    def table(self) -> pa.Table:
        if not self.rows:
            return S.empty("captures")
        cols = {name: [r[name] for r in self.rows] for name in S.CAPTURES.names}
        return pa.Table.from_pydict(cols, schema=S.CAPTURES)


def _encode_arg(v: Any, tensors: list[torch.Tensor], problems: list[str]) -> Any:
    """One argument of a captured op as JSON, its tensors appended to ``tensors`` (replaced by their
    index), what a script cannot hold to ``problems``."""
    if isinstance(v, torch.Tensor):
        tensors.append(v)
        return {"tensor": len(tensors) - 1}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, complex):
        return {"complex": [v.real, v.imag]}
    if isinstance(v, (list, tuple)):
        return [_encode_arg(x, tensors, problems) for x in v]
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).replace("torch.", "")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v).replace("torch.", "")}
    if isinstance(v, torch.layout):
        return {"layout": str(v).replace("torch.", "")}
    problems.append(f"an argument of type {type(v).__name__} cannot be written into a script")
    return {"unsupported": type(v).__name__}
