"""Tensor-subclass substitution check (Liskov): does ``fn`` behave the same on the subclass?

``check_substitution(fn, *args, wrap=..., **kwargs)`` runs ``fn`` twice under a
trace: once on the plain arguments and once with every tensor argument passed
through ``wrap`` (``lambda t: t.as_subclass(MyTensor)``, a wrapper subclass's
constructor…). Both runs get fresh copies of the tensor arguments and the same
RNG state; afterwards the global RNG is where one run of ``fn`` leaves it. The
two traces are compared:

- the ATen op sequences, aligned by op name and phase (``difflib``; ops that only
  moved are paired, not reported): ops that appear or disappear in the subclass run;
- for aligned ops: output shapes, dtypes, memory format and strides (inputs'
  too), aliasing (``out_alias``, ``is_view``) and in-place-ness;
- the outputs: structure, type (outputs that stop being the subclass), shape,
  dtype, memory format, and values within ``rtol``/``atol``;
- gradients: when ``fn`` runs a backward, the ``.grad`` of every argument that
  requires grad (computed in one run only, shape, dtype, layout, values);
- exceptions (one run raised, or both with different types/messages).

The result is a ``SubstitutionReport``: ``.ok``, ``.table`` (one row per
divergence: kind, phase, op, the call, plain vs subclass value, the user line),
``.plain``/``.wrapped`` (the two Traces), text and HTML (escaped). Nothing of
``fn``'s outputs or arguments is kept.
"""
from __future__ import annotations

import difflib
from typing import Any, Callable, Optional

import pyarrow as pa

from . import schema as S
from ._common import Displayable
from .errors import TensorscopeError

_OP_FIELDS = (
    ("out_shapes", "shape"), ("out_dtypes", "dtype"), ("out_formats", "layout"), ("in_formats", "input_layout"),
    ("in_dtypes", "input_dtype"), ("out_alias", "aliasing"), ("is_view", "aliasing"), ("inplace", "inplace"),
)


class SubstitutionReport(Displayable):
    """Where ``fn`` on the subclass diverged from ``fn`` on plain tensors (data; render/substitution.py draws it)."""

    def __init__(self, table: pa.Table, plain, wrapped, subclass: Optional[str], fn_name: str):
        self.table = table
        self.plain = plain
        self.wrapped = wrapped
        self.subclass = subclass
        self.fn_name = fn_name

    @property
    def ok(self) -> bool:
        return self.table.num_rows == 0

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in self.table.column("kind").to_pylist():
            out[k] = out.get(k, 0) + 1
        return out

    def to_text(self) -> str:
        from .render.substitution import substitution_text

        return substitution_text(self)

    def to_html(self) -> str:
        from .render.substitution import substitution_html

        return substitution_html(self)

    def __repr__(self):
        return f"<SubstitutionReport ok={self.ok} divergences={self.table.num_rows}>"


# -- running ---------------------------------------------------------------------------------------------------

def _copy_args(args, kwargs, wrap=None):
    """Fresh copies (wrapped when ``wrap``), and per argument requiring grad the tensor its gradient lands
    on: the wrapper when it is a leaf itself, else the plain copy under it (``as_subclass`` aliases)."""
    import torch
    from torch.utils._pytree import tree_map

    leaves = []

    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        with torch.no_grad():
            c = x.detach().clone(memory_format=torch.preserve_format)
        if x.requires_grad:
            c.requires_grad_(True)
        w = wrap(c) if wrap is not None else c
        if x.requires_grad:
            leaves.append(w if w.is_leaf else c)
        return w

    return tree_map(one, tuple(args)), tree_map(one, dict(kwargs)), leaves


def _run(fn, args, kwargs, trace_options):
    from .recording.session import trace

    out = exc = None
    tr = trace(**trace_options)
    try:
        with tr:
            out = fn(*args, **kwargs)
    except Exception as e:   # the user's exception is a result here; tensorscope's own bugs are not
        if isinstance(e, TensorscopeError):
            raise
        exc = e
    return tr.result, out, exc


def check_substitution(fn: Callable, *args, wrap: Callable, rtol: float = 1e-5, atol: float = 1e-6,
                       check_values: bool = True, unwrap: Optional[Callable] = None,
                       trace_options: Optional[dict[str, Any]] = None, **kwargs) -> SubstitutionReport:
    """Run ``fn(*args, **kwargs)`` on plain tensors and on ``wrap``-ped ones; report every divergence.

    ``wrap`` turns a plain tensor into the subclass; ``unwrap`` (optional) turns a
    subclass output back into a plain tensor for the value comparison (default:
    ``__tensor_flatten__``'s single inner tensor, or ``as_subclass(torch.Tensor)``).
    ``trace_options`` are passed to ``tensorscope.trace`` (default ``leaks=False``).
    """
    import torch

    if not callable(fn):
        raise TypeError(f"check_substitution: fn must be callable, got {type(fn).__name__}")
    if not callable(wrap):
        raise TypeError(f"check_substitution: wrap must be callable (a tensor -> subclass), got {type(wrap).__name__}")
    opts = {"leaks": False}
    opts.update(trace_options or {})
    fn_name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)

    rng = torch.get_rng_state()
    pa_args, pa_kwargs, leaves = _copy_args(args, kwargs)
    plain_t, plain_out, plain_exc = _run(fn, pa_args, pa_kwargs, opts)
    after = torch.get_rng_state()
    plain_grads = [x.grad for x in leaves]
    del pa_args, pa_kwargs, leaves
    torch.set_rng_state(rng)
    try:
        wr_args, wr_kwargs, leaves = _copy_args(args, kwargs, wrap)
        sub_type = _subclass_type(wr_args, wr_kwargs)
        wrapped_t, wrapped_out, wrapped_exc = _run(fn, wr_args, wr_kwargs, opts)
        wrapped_grads = [x.grad for x in leaves]
        del wr_args, wr_kwargs, leaves
    finally:
        torch.set_rng_state(after)   # as if fn ran once

    rows: list[dict[str, Any]] = []
    _compare_exceptions(plain_exc, wrapped_exc, rows, plain_t, wrapped_t)
    _compare_ops(plain_t, wrapped_t, rows)
    if plain_exc is None and wrapped_exc is None:
        _compare_outputs(plain_out, wrapped_out, sub_type, rows, rtol, atol, check_values, unwrap,
                         producer=_Producers(wrapped_t))
        _compare_outputs(plain_grads, wrapped_grads, None, rows, rtol, atol, check_values, unwrap, what="grad")
    table = pa.Table.from_pylist(rows, schema=S.SUBSTITUTION) if rows else S.SUBSTITUTION.empty_table()
    name = f"{sub_type.__module__}.{sub_type.__qualname__}" if sub_type is not None else None
    return SubstitutionReport(table, plain_t, wrapped_t, name, fn_name)


def _subclass_type(args, kwargs):
    import torch
    from torch.utils._pytree import tree_leaves

    for x in tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor) and type(x) is not torch.Tensor and type(x) is not torch.nn.Parameter:
            return type(x)
    return None


def _row(kind, *, phase=None, op=None, call=None, plain=None, wrapped=None, source_file=None, source_line=None,
         plain_seq=None, wrapped_seq=None, detail=None):
    return dict(kind=kind, phase=phase, op=op, call=call, plain=None if plain is None else str(plain),
                wrapped=None if wrapped is None else str(wrapped), source_file=source_file, source_line=source_line,
                plain_seq=plain_seq, wrapped_seq=wrapped_seq, detail=detail)


def _compare_exceptions(pe, we, rows, pt=None, wt=None):
    if pe is None and we is None:
        return
    def fmt(e):
        return None if e is None else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    if pe is None or we is None or type(pe) is not type(we) or str(pe) != str(we):
        loc = _exc_location(we if we is not None else pe)
        rows.append(_row("exception", op=_exc_op(wt if we is not None else pt), plain=fmt(pe) or "returned",
                         wrapped=fmt(we) or "returned",
                         source_file=loc[0], source_line=loc[1],
                         detail="only the subclass raised" if pe is None else
                         "only plain tensors raised" if we is None else "different exception"))


def _exc_op(t) -> Optional[str]:
    """The ATen op the run's exception was raised in (from its errors table), if any."""
    try:
        for r in t.errors.to_pylist():
            if r["kind"] == "exception" and r.get("op"):
                return r["op"]
    except Exception:
        pass
    return None


def _exc_location(e):
    from .recording.source import user_traceback_location

    return user_traceback_location(e.__traceback__ if e is not None else None)


def _op_rows(t) -> list[dict[str, Any]]:
    ops = t.ops
    if ops.num_rows == 0:
        return []
    import pyarrow.compute as pc

    keep = pc.invert(ops.column("is_noise").fill_null(False))
    ops = ops.filter(keep)
    names = {}
    calls = t.calls
    if calls.num_rows:
        names = dict(zip(calls.column("call_id").to_pylist(), calls.column("name").to_pylist()))
    cols = (["seq", "op", "phase", "call_id", "source_file", "source_line", "in_strides", "out_strides",
             "out_storages", "error_id"] + sorted({f for f, _ in _OP_FIELDS}))
    rows = ops.select(cols).to_pylist()
    for r in rows:
        r["call"] = names.get(r["call_id"])
    return rows


def _compare_ops(pt, wt, rows):
    """Align by (op, phase); unmatched ops of the same kind on both sides are paired in order (a reordering,
    e.g. autograd running independent backward nodes in another order, is not a divergence)."""
    a, b = _op_rows(pt), _op_rows(wt)
    ka = [(r["op"], r["phase"]) for r in a]
    kb = [(r["op"], r["phase"]) for r in b]
    sm = difflib.SequenceMatcher(a=ka, b=kb, autojunk=False)
    only_a, only_b = [], []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            for ra, rb in zip(a[i1:i2], b[j1:j2]):
                _compare_pair(ra, rb, rows)
            continue
        only_a.extend(a[i1:i2])
        only_b.extend(b[j1:j2])
    pending: dict[Any, list[dict[str, Any]]] = {}
    for rb in only_b:
        pending.setdefault((rb["op"], rb["phase"]), []).append(rb)
    for ra in only_a:
        match = pending.get((ra["op"], ra["phase"]))
        if match:
            _compare_pair(ra, match.pop(0), rows)
            continue
        rows.append(_row("op_disappeared", phase=ra["phase"], op=ra["op"], call=ra["call"], plain=ra["op"],
                         wrapped="(not dispatched)", source_file=ra["source_file"], source_line=ra["source_line"],
                         plain_seq=ra["seq"]))
    for rb in sorted((r for rs in pending.values() for r in rs), key=lambda r: r["seq"]):
        rows.append(_row("op_appeared", phase=rb["phase"], op=rb["op"], call=rb["call"], plain="(not dispatched)",
                         wrapped=rb["op"], source_file=rb["source_file"], source_line=rb["source_line"],
                         wrapped_seq=rb["seq"]))


def _fmt(v):
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, tuple):
        return "(" + ", ".join(_fmt(x) for x in v) + ")"
    return str(v)


def _compare_pair(ra, rb, rows):
    done = set()
    raised = ra.get("error_id") is not None or rb.get("error_id") is not None
    # storage identity is unknown for wrapper subclasses (-1): their aliasing cannot be compared
    unknown_storage = any(x is None or x < 0 for r in (ra, rb) for x in (r.get("out_storages") or []))
    for field, kind in _OP_FIELDS:
        va, vb = ra.get(field), rb.get(field)
        if raised and field.startswith("out_"):
            continue   # an op that raised has no outputs: the exception row says it
        if field == "out_alias" and (va is None or vb is None or unknown_storage):
            continue
        if va == vb or (kind, ra["seq"]) in done:
            continue
        if field == "out_formats" and ra.get("out_strides") == rb.get("out_strides"):
            continue
        detail = None
        if kind in ("layout", "input_layout"):
            side = "out" if kind == "layout" else "in"
            detail = f"strides {_fmt(ra.get(side + '_strides'))} → {_fmt(rb.get(side + '_strides'))}"
        done.add((kind, ra["seq"]))
        rows.append(_row(kind, phase=ra["phase"], op=ra["op"], call=rb["call"] or ra["call"], plain=_fmt(va),
                         wrapped=_fmt(vb), source_file=rb["source_file"] or ra["source_file"],
                         source_line=rb["source_line"] if rb["source_file"] else ra["source_line"],
                         plain_seq=ra["seq"], wrapped_seq=rb["seq"], detail=detail))


def _to_plain(t, unwrap):
    import torch

    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t
    if unwrap is not None:
        return unwrap(t)
    if hasattr(t, "__tensor_flatten__"):
        try:
            names, _ctx = t.__tensor_flatten__()
            if len(names) == 1:
                return _to_plain(getattr(t, names[0]), None)
        except Exception:
            pass
    inner = [v for v in getattr(t, "__dict__", {}).values() if type(v) is torch.Tensor]
    if len(inner) == 1:   # a wrapper holding one plain tensor (self.elem = elem)
        return inner[0]
    try:
        with torch._C.DisableTorchFunctionSubclass():
            p = torch.Tensor.as_subclass(t, torch.Tensor)
        p.untyped_storage().data_ptr()   # a wrapper without real storage raises here
        return p
    except Exception:
        return None


def _fmt_layout(t) -> str:
    from ._tensormeta import memory_format

    try:
        return memory_format(tuple(t.shape), tuple(t.stride()))[0]
    except Exception:
        return "non_strided"


class _Producers:
    """The op of a run that made an output tensor: the last op that wrote the output's storage with
    the output's shape and strides (a view: ``y.t()`` is ``aten.t``), else the storage's allocating op.
    Looked up by the storage's address in the run's ``tensors`` table (the trace holds no tensor)."""

    def __init__(self, t):
        self.t = t

    def __call__(self, out) -> Optional[dict[str, Any]]:
        t = self.t
        if t is None:
            return None
        try:
            addr = int(out.untyped_storage().data_ptr())
            shape, strides = list(out.shape), list(out.stride())
        except Exception:
            return None
        tens = t.tensors
        if tens.num_rows == 0 or "address" not in tens.column_names:
            return None
        sids = [r["storage_id"] for r in tens.select(["storage_id", "address", "free_seq"]).to_pylist()
                if r["address"] == addr and r["free_seq"] is None]
        if not sids:
            return None
        best = None
        for r in _op_rows(t):
            outs = r.get("out_storages") or []
            for j, sid in enumerate(outs):
                if sid in sids and (r.get("out_shapes") or [None] * len(outs))[j] == shape \
                        and (r.get("out_strides") or [None] * len(outs))[j] == strides \
                        and (best is None or r["seq"] > best["seq"]):
                    best = r
        return best


def _compare_outputs(po, wo, sub_type, rows, rtol, atol, check_values, unwrap, what="output", producer=None):
    import torch
    from torch.utils._pytree import tree_flatten

    if what == "grad":   # one entry per argument requiring grad; None: no gradient reached it
        pl, wl = list(po), list(wo)
        for i, (a, b) in enumerate(zip(pl, wl)):
            if (a is None) != (b is None):
                rows.append(_row("grad", op=f"grad[{i}]", plain="none" if a is None else "computed",
                                 wrapped="none" if b is None else "computed",
                                 detail="the gradient of this argument is computed in one run only"))
        pairs = [(a, b) for a, b in zip(pl, wl) if a is not None and b is not None]
        names = [f"grad[{i}]" for i, (a, b) in enumerate(zip(pl, wl)) if a is not None and b is not None]
    else:
        pl, pspec = tree_flatten(po)
        wl, wspec = tree_flatten(wo)
        if pspec != wspec:
            rows.append(_row("output_structure", plain=str(pspec), wrapped=str(wspec)))
            return
        pairs = list(zip(pl, wl))
        names = [f"output[{i}]" if len(pl) > 1 else "output" for i in range(len(pl))]
    for name, (a, b) in zip(names, pairs):
        if not isinstance(a, torch.Tensor):
            if isinstance(b, torch.Tensor) or (a != b if not isinstance(a, float) else abs(a - b) > atol + rtol * abs(a)):
                rows.append(_row("value", op=name, plain=repr(a)[:80], wrapped=repr(b)[:80]))
            continue
        if not isinstance(b, torch.Tensor):
            rows.append(_row("output_type", op=name, plain=type(a).__name__, wrapped=type(b).__name__))
            continue
        if sub_type is not None and not isinstance(b, sub_type):
            made = producer(b) if producer is not None else None
            rows.append(_row("lost_subclass", op=made["op"] if made else name, call=made["call"] if made else None,
                             plain=f"{sub_type.__name__} expected",
                             wrapped=f"{type(b).__module__}.{type(b).__qualname__}",
                             source_file=made["source_file"] if made else None,
                             source_line=made["source_line"] if made else None,
                             wrapped_seq=made["seq"] if made else None,
                             detail=(f"{name}: " if made else "") + "the subclass's __torch_function__/"
                                    "__torch_dispatch__ returned a tensor that is not the subclass"))
        if tuple(a.shape) != tuple(b.shape):
            rows.append(_row("shape", op=name, plain=list(a.shape), wrapped=list(b.shape)))
            continue
        if a.dtype != b.dtype:
            rows.append(_row("dtype", op=name, plain=str(a.dtype).replace("torch.", ""),
                             wrapped=str(b.dtype).replace("torch.", "")))
        fa, fb = _fmt_layout(a), _fmt_layout(b)
        if fa != fb:
            rows.append(_row("layout", op=name, plain=fa, wrapped=fb,
                             detail=f"strides {list(a.stride())} → {list(b.stride())}"))
        if not check_values:
            continue
        pb = _to_plain(b, unwrap)
        if pb is None:
            rows.append(_row("value", op=name, plain="-", wrapped="-", detail="values not compared: cannot unwrap "
                                                                              "the subclass (pass unwrap=)"))
            continue
        with torch.no_grad():
            x = a.detach()
            y = pb.detach()
            if tuple(y.shape) != tuple(x.shape):
                continue
            if x.is_floating_point() or x.is_complex() or y.is_floating_point():
                xd = x.to(torch.complex128 if x.is_complex() else torch.float64)
                yd = y.to(xd.dtype)
                close = torch.isclose(xd, yd, rtol=rtol, atol=atol, equal_nan=True)
                if not bool(close.all()):
                    diff = (xd - yd).abs()
                    diff = torch.where(torch.isnan(diff), torch.zeros_like(diff), diff)
                    rows.append(_row("value", op=name, plain=f"{int((~close).sum())} of {x.numel()} differ",
                                     wrapped=f"max abs diff {float(diff.max()):.3g}",
                                     detail=f"rtol={rtol}, atol={atol}"))
            elif not torch.equal(x, y.to(x.dtype)):
                rows.append(_row("value", op=name, plain=f"{int((x != y.to(x.dtype)).sum())} of {x.numel()} differ",
                                 wrapped="exact comparison"))
