"""Facts of an ATen op that both engines need, computed one way: the module below
``engines/python/`` and ``engines/native/`` (neither engine imports the other) and ``decode.py``.

* the op's schema facts (``op_schema_facts``: in-place / out= / view flags and how its FLOPs are counted);
* the FLOP registry and the one way FLOPs are computed: ``flop_formula`` (torch.utils.flop_counter's
  formula of an op, live in the python engine), ``matmul_flops`` (mm/addmm/bmm/baddbmm from input shapes,
  when the tables are built: the rows marked ``FLOP_AT_BUILD``) and ``formula_flops`` (a formula over
  decoded argument shapes, once per distinct argument set: the native engine);
* the non-finite screen's op classes (``func_info``: screened or not, which arguments an op writes),
  read by the python screen, the native screen's decode side and the fingerprints.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch

from .recorder import F_INPLACE, F_OUT_KW, F_VIEW

Tensor = torch.Tensor

#: a row's ``flops`` value left for the table build: matmul FLOPs from the interned input shapes
FLOP_AT_BUILD = -2
#: a row's ``flops`` value when the op has no formula or its formula failed
FLOP_NONE = -1

try:
    from torch.utils.flop_counter import flop_registry as _flop_registry
except Exception:  # older torch
    _flop_registry = {}
#: torch.utils.flop_counter's formulas by op packet (the same dict: formulas registered later count)
FLOP_REGISTRY: dict[object, Callable[..., Any]] = _flop_registry

#: ops whose FLOPs decode.py computes from input shapes (same formulas as torch.utils.flop_counter)
SHAPE_FLOP_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm"})


def schema_inputs(func: Any, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]]) -> list[Any]:
    """An op's arguments in schema order (kwarg-only ones from kwargs), as the native engine gives them."""
    out = list(args)
    try:
        for a in func._schema.arguments[len(args):]:
            out.append(kwargs.get(a.name, a.default_value) if kwargs else a.default_value)
    except Exception:
        out.extend((kwargs or {}).values())
    return out


#: OpOverload -> (flags, flop_at_build): facts of the op's schema, the same in every trace, so
#: computed once per process (a schema walk: ~20 µs per op)
_SCHEMA_FACTS: dict[object, tuple[int, bool]] = {}


def op_schema_facts(func: Any) -> tuple[int, bool, Optional[Callable[..., Any]]]:
    """``(flags, flop_at_build, flop)`` of ``func``: F_INPLACE/F_OUT_KW/F_VIEW from its schema;
    whether its FLOPs are counted from input shapes when the tables are built; else its
    flop_counter formula (None: no formula; looked up each time: formulas can be registered
    between traces). The schema facts are cached per process."""
    facts = _SCHEMA_FACTS.get(func)
    if facts is not None:
        flags, at_build = facts
        return flags, at_build, None if at_build else FLOP_REGISTRY.get(func.overloadpacket)
    flags = 0
    schema = func._schema
    out_kw = False
    mut_pos = False
    for a in schema.arguments:
        ai = a.alias_info
        if ai is not None and ai.is_write:
            if a.kwarg_only and a.name.startswith("out"):
                out_kw = True
            else:
                mut_pos = True
    if mut_pos:
        flags |= F_INPLACE
    if out_kw:
        flags |= F_OUT_KW
    if getattr(func, "is_view", False):
        flags |= F_VIEW
    packet = func.overloadpacket
    # matmul FLOPs depend on input shapes only: counted when the tables are built
    # (flop_counter's formulas tree-map their arguments: ~25 µs per call)
    at_build = str(packet).split(".")[-1] in SHAPE_FLOP_OPS and packet in FLOP_REGISTRY
    _SCHEMA_FACTS[func] = (flags, at_build)
    return flags, at_build, None if at_build else FLOP_REGISTRY.get(packet)



_has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key


def is_composite(func: Any) -> bool:
    try:
        return bool(_has_kernel(func.name(), "CompositeImplicitAutograd"))
    except Exception:
        return False


def tensor_args(args: Sequence[Any], kwargs: Optional[Mapping[str, Any]], skip_kw: tuple[str, ...] = ()) -> list[Tensor]:
    """The tensors among an op's arguments (one level of lists), in order; by hand, not pytree."""
    out: list[Tensor] = []
    for a in args:
        if isinstance(a, Tensor):
            out.append(a)
        elif type(a) is list or type(a) is tuple:
            for b in a:
                if isinstance(b, Tensor):
                    out.append(b)
    if kwargs:
        for k, a in kwargs.items():
            if skip_kw and k in skip_kw:
                continue
            if isinstance(a, Tensor):
                out.append(a)
            elif type(a) is list or type(a) is tuple:
                for b in a:
                    if isinstance(b, Tensor):
                        out.append(b)
    return out



F16 = torch.float16
BF16 = torch.bfloat16
F32 = torch.float32
F64 = torch.float64

# ops whose outputs are uninitialised memory or pure aliases of an input:
# screening them costs a full pass and tells nothing (the data is screened
# where it is computed, or is garbage the program will overwrite)
UNINIT_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
    "resize_", "resize_as_", "set_", "_resize_output_", "_empty_affine_quantized", "_empty_per_channel_affine_quantized",
})
ALIAS_OPS = frozenset({
    "detach", "alias", "lift_fresh", "_unsafe_view", "_reshape_alias", "lift_fresh_copy", "_local_scalar_dense",
    "_nested_tensor_from_mask", "record_stream", "_assert_async", "sym_size", "sym_stride", "sym_numel",
})
# conversions and copies: exact when widening, the cast itself when narrowing;
# a shadow reference would reproduce the same values and the same work
SHADOW_SKIP_SILENT = frozenset({
    "_to_copy", "to", "clone", "contiguous", "copy", "_copy_from", "_copy_from_and_resize", "type_as",
    "zeros_like", "ones_like", "full_like", "fill", "lift_fresh_copy",
}) | UNINIT_OPS | ALIAS_OPS
# in-place ops that overwrite their target without reading it: its old contents
# (possibly garbage from empty()) are no input of theirs
OVERWRITE_OPS = frozenset({
    "copy_", "fill_", "zero_", "uniform_", "normal_", "bernoulli_", "exponential_", "geometric_", "cauchy_",
    "log_normal_", "random_", "_copy_from", "_foreach_copy_", "_foreach_zero_",
})
# composites that draw random numbers but arrive undecomposed under inference_mode
SEEDED_NAMES = frozenset({"dropout", "dropout_", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
                           "rrelu", "rrelu_"})

NOSCREEN, SCREEN, MAYBE_ALIAS = 0, 1, 2
REL = tuple[float, float]
def op_name(func: Any) -> str:
    try:
        name: str = func._schema.name
        return name.split("::", 1)[-1]
    except Exception:
        return str(func).split(".")[1] if "." in str(func) else str(func)


#: OpOverload -> its FuncInfo (facts of the op alone: shared by every screen of the process)
FUNC_INFOS: dict[object, FuncInfo] = {}


class FuncInfo:
    """Per-OpOverload facts, computed once: skip, which arguments it writes."""

    __slots__ = ("screen", "write_pos", "write_kw", "inplace", "overwrites")

    screen: int
    write_pos: tuple[int, ...]
    write_kw: tuple[str, ...]
    inplace: bool
    overwrites: bool

    def __init__(self, func: Any) -> None:
        name = op_name(func)
        view = bool(getattr(func, "is_view", False))
        if name in UNINIT_OPS or name in ALIAS_OPS:
            self.screen = NOSCREEN
        elif view:
            # reshape/flatten/contiguous/to are schema views that may copy; they arrive
            # undecomposed under inference_mode: screen the outputs that are fresh
            self.screen = MAYBE_ALIAS if is_composite(func) else NOSCREEN
        else:
            self.screen = SCREEN
        wp: list[int] = []
        wk: list[str] = []
        inplace = False
        try:
            for i, a in enumerate(func._schema.arguments):
                ai = a.alias_info
                if ai is not None and ai.is_write:
                    if a.kwarg_only:
                        wk.append(a.name)
                    else:
                        wp.append(i)
                        inplace = True
        except Exception:
            pass
        self.write_pos = tuple(wp)
        self.write_kw = tuple(wk)
        self.inplace = inplace
        self.overwrites = name in OVERWRITE_OPS


_NO_DISPATCH = Tensor.__torch_dispatch__
_STRIDED = torch.strided


def plain(t: Tensor) -> bool:
    """A strided tensor whose data we may read: no wrapper subclass (fake, functional, DTensor), not meta."""
    tt = type(t)
    if tt is not Tensor and tt is not torch.nn.Parameter and getattr(tt, "__torch_dispatch__", _NO_DISPATCH) is not _NO_DISPATCH:
        return False
    return t.layout == torch.strided and not t.is_meta


def is_float(t: Tensor) -> bool:
    dt = t.dtype
    return dt.is_floating_point or dt.is_complex


def flop_formula(func: Any) -> Optional[Callable[..., Any]]:
    """torch.utils.flop_counter's formula of ``func`` (looked up each time: formulas can be
    registered between traces), or None."""
    return FLOP_REGISTRY.get(getattr(func, "overloadpacket", None))


def matmul_flops(name: str, shapes: Sequence[Sequence[int]]) -> int:
    """torch.utils.flop_counter's mm/addmm/bmm/baddbmm formulas (2*m*n*k per batch), or -1."""
    try:
        a, b = shapes[-2], shapes[-1]
        if name in ("mm", "addmm"):
            return 2 * a[0] * a[1] * b[1]
        if name in ("bmm", "baddbmm"):
            return 2 * a[0] * a[1] * a[2] * b[2]
    except (IndexError, TypeError):
        pass
    return FLOP_NONE


#: (op, arguments, outputs) -> FLOPs: the formulas are pure functions of shapes and scalars, and
#: torch's shape wrapper tree-maps every argument (~0.1 ms a call), so each is computed once per process
FLOPS_CACHE: dict[tuple[object, object, object], int] = {}


def formula_flops(func: Any, args: Sequence[Any], out_val: Any) -> int:
    """FLOPs of ``func`` from its formula over decoded arguments (shapes for tensors), cached per
    distinct (op, arguments, outputs); -1 without a formula or when it fails."""
    f = flop_formula(func)
    if f is None:
        return FLOP_NONE
    try:
        key = (func, _frozen(args), _frozen(out_val))
        v = FLOPS_CACHE.get(key)
        if v is None:
            v = int(f(*args, out_val=out_val))
            if len(FLOPS_CACHE) >= 65536:
                FLOPS_CACHE.clear()
            FLOPS_CACHE[key] = v
        return v
    except Exception:
        return FLOP_NONE


def _frozen(v: object) -> object:
    """A decoded argument list as a hashable key (lists become tuples, tagged apart from tuples)."""
    if isinstance(v, list):
        return ("l",) + tuple(_frozen(x) for x in v)
    if isinstance(v, tuple):
        return ("t",) + tuple(_frozen(x) for x in v)
    return v


def func_info(func: Any) -> FuncInfo:
    """The screen's facts of ``func`` (cached per process)."""
    info = FUNC_INFOS.get(func)
    if info is None:
        info = FUNC_INFOS[func] = FuncInfo(func)
    return info


def screens(func: Any) -> bool:
    """Whether the non-finite screen screens ``func``'s outputs at all (views, aliases and ops
    returning uninitialised memory are not)."""
    return func_info(func).screen != NOSCREEN
