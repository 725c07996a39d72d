"""Model and optimizer state at the end of a trace, as storage ids: what ``tensors.category`` starts from.

Read once, when the tables are built, from objects the program already holds: the root modules the
trace saw (the module tracker keeps weak references to them) give their parameters, registered
buffers and the parameters' ``.grad``; optimizers reachable from the user's names (globals, the
locals of the running user functions, one or two attributes or items below them: ``trainer.opt``,
``scheduler.optimizer``) give their ``state`` tensors. Each tensor is reduced to its storage's data
pointer at once and matched to the storages alive at the end of the trace (``live``: data pointer
-> storage id); nothing is kept. Attributes are read with torch functions disabled, so nothing here
reaches a user's ``TorchFunctionMode`` or dispatches an op (no profiler event).
"""
from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

from .storages import fake_key, is_fake

#: objects whose attributes hold no optimizer of the user's
_SKIP = (type, str, bytes, int, float, complex, bool, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
         types.MethodType, types.CodeType, types.FrameType)

#: the exact types most of the user's names hold (modules, functions, numbers, strings): skipped
#: with one set lookup, before the subclass checks
_LEAVES = frozenset(_SKIP + (type(None),))

#: category -> precedence (a parameter saved for backward stays a parameter)
_RANK = {"parameter": 0, "buffer": 1, "gradient": 2, "optimizer_state": 3}


def _ptr(t: Any) -> int:
    try:
        if is_fake(t):   # under tensorscope.predict: the key the tracker gave it
            return fake_key(t.untyped_storage())
        return int(t.untyped_storage().data_ptr())
    except Exception:   # wrapper subclasses, meta / fake tensors
        return 0


def find_optimizers(objects: Iterable[Any], depth: int = 2, limit: int = 20000) -> list[Any]:
    """The ``torch.optim.Optimizer`` instances among ``objects`` and up to ``depth`` attributes or
    items below them (plain objects' ``__dict__``, lists, tuples, dicts), each once."""
    import torch

    opt_type = torch.optim.Optimizer
    found: dict[int, Any] = {}
    seen: set = set()
    frontier = list(objects)
    budget = limit
    for level in range(depth + 1):
        nxt: list[Any] = []
        for obj in frontier:
            budget -= 1
            if budget < 0:
                break
            tp = type(obj)   # never isinstance(): a proxy's __class__ would run the user's code
            if tp in _LEAVES or id(obj) in seen:
                continue
            seen.add(id(obj))
            if issubclass(tp, opt_type):
                found[id(obj)] = obj
                continue
            if level == depth or issubclass(tp, _SKIP) or issubclass(tp, (torch.Tensor, torch.nn.Module)):
                continue
            if tp in (list, tuple):
                nxt.extend(obj[:64])
            elif tp is dict:
                nxt.extend(list(obj.values())[:64])
            else:
                try:   # the instance dict itself: no __getattr__ / property of the user's runs
                    d = object.__getattribute__(obj, "__dict__")
                except Exception:
                    continue
                if type(d) is dict:
                    nxt.extend(list(d.values())[:64])
        frontier = nxt
        if budget < 0:
            break
    del frontier, seen
    return list(found.values())


#: the methods ``Module.parameters()`` and ``Module.buffers()`` go through
_WALK = ("parameters", "named_parameters", "buffers", "named_buffers", "_named_members", "modules", "named_modules")


def _params_and_buffers(root: Any) -> tuple[list[Any], list[Any]]:
    """The tensors of ``root.parameters()`` and ``root.buffers()``, in one walk of the modules when
    its class overrides none of the methods they go through (each walk costs a generator per module
    and level: half the time here on a ResNet)."""
    import torch

    base, tp = torch.nn.Module, type(root)
    if not issubclass(tp, base) or any(getattr(tp, name, None) is not getattr(base, name) for name in _WALK):
        return list(root.parameters()), list(root.buffers())
    params: list[Any] = []
    buffers: list[Any] = []
    for m in root.modules():   # what _named_members reads (duplicates are put twice: same result)
        params.extend(p for p in m._parameters.values() if p is not None)
        buffers.extend(b for b in m._buffers.values() if b is not None)
    return params, buffers


def state_storages(modules: Iterable[Any], optimizers: Iterable[Any], live: dict[int, int]) -> dict[int, str]:
    """storage id -> category for the parameters, registered buffers and ``.grad`` of ``modules``
    and the state (and parameters) of ``optimizers``; only storages in ``live`` (data pointer ->
    storage id of the storages alive at the end of the trace)."""
    import torch

    out: dict[int, str] = {}
    # parameters put already, by id (held here, so no id is reused): an optimizer's are its model's
    done: dict[int, Any] = {}

    def put(t: Any, cat: str) -> None:
        sid = live.get(_ptr(t))
        if sid is None:
            return
        old = out.get(sid)
        if old is None or _RANK[cat] < _RANK[old]:
            out[sid] = cat

    def put_param(p: Any) -> None:
        if id(p) in done:
            return
        done[id(p)] = p
        put(p, "parameter")
        g = p.grad
        if g is not None:
            put(g, "gradient")

    try:
        with torch._C.DisableTorchFunction():
            for root in modules:
                try:
                    params, buffers = _params_and_buffers(root)
                except Exception:
                    continue
                for p in params:
                    put_param(p)
                for b in buffers:
                    if b is not None:
                        put(b, "buffer")
                del params, buffers
            for opt in optimizers:
                try:
                    states = list(opt.state.values())
                    groups = [p for g in opt.param_groups for p in g.get("params", ())]
                except Exception:
                    continue
                for st in states:
                    if isinstance(st, dict):
                        for v in st.values():
                            if isinstance(v, torch.Tensor):
                                put(v, "optimizer_state")
                for p in groups:   # an optimizer's parameters (and their .grad) without their module
                    if isinstance(p, torch.Tensor):
                        put_param(p)
                del states, groups
    finally:
        done.clear()   # no tensor outlives the call
    return out
