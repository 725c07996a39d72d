"""``tensorscope.predict(fn, *args, scale=...)``: the memory a step would take, without running it.

``fn(*args)`` runs under ``FakeTensorMode`` inside the public ``trace()`` (python engine): every op
computes shapes, dtypes and strides only, so no real memory is allocated and nothing is computed.
The tensor arguments are replaced by fake ones (dimension 0 multiplied by ``scale["batch"]``), and
while it runs so are the parameters and buffers of the modules it can reach and the state of their
optimizers (``_Swap``; put back when it returns, so weights, buffers, ``.grad`` and optimizer state are
untouched). Each storage a fake op makes is tracked by its StorageImpl instead of a data pointer, and a
fake copy of a real tensor as the real storage (``tracking.storages.fake``). The result is a Trace like
any other: ``memory``, ``memory_timeline``, ``memory_at()``, ``module_memory``.

What cannot be predicted: an op whose output shape or value depends on the data (``nonzero``,
``.item()``, a boolean mask index) raises ``PredictionError`` naming the op and the user line.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Optional

from .errors import OptionsError, TensorscopeError

__all__ = ["predict", "PredictionError"]


class PredictionError(TensorscopeError, RuntimeError):
    """The step cannot be predicted without running it (a data-dependent op)."""


def _closure_objects(fn: Any) -> list[Any]:
    out: list[Any] = []
    code = getattr(fn, "__code__", None)
    glb = getattr(fn, "__globals__", None)
    if code is not None and isinstance(glb, dict):
        out.extend(glb[n] for n in code.co_names if n in glb)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:
            pass
    self_ = getattr(fn, "__self__", None)
    if self_ is not None:
        out.append(self_)
    return out


def _state(fn: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
    """(modules, optimizers) the step can reach: its arguments, globals and closure, the user's names."""
    import torch

    from .tracking.leaks.roots import user_objects
    from .tracking.state import find_optimizers

    objs = list(args) + list(kwargs.values()) + _closure_objects(fn) + user_objects()
    try:
        mods: dict[int, Any] = {}
        for o in objs:
            if issubclass(type(o), torch.nn.Module):
                mods[id(o)] = o
            elif not issubclass(type(o), (torch.Tensor, type)):
                try:
                    d = object.__getattribute__(o, "__dict__")
                except Exception:
                    continue
                if type(d) is dict:
                    for v in list(d.values()):
                        if issubclass(type(v), torch.nn.Module):
                            mods[id(v)] = v
        opts = find_optimizers(objs)
        return list(mods.values()), opts
    finally:
        objs.clear()


class _Swap:
    """The step's parameters, buffers and optimizer state, replaced by fake copies while it runs.

    An op whose inputs are all real tensors would run for real under FakeTensorMode
    (``buf.mul_(m)``, ``num_batches_tracked.add_(1)``); the copies are put back after. ``real`` maps
    a copy's StorageImpl to the real storage's data pointer, so the trace sees the real storages.
    """

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self.fakes: dict[int, Any] = {}
        self.keep: list[Any] = []            # the real tensors, while their fakes are keyed by id
        self.real: dict[int, int] = {}
        self.undo: list[tuple[Any, ...]] = []

    def fake(self, t: Any) -> Any:
        f = self.fakes.get(id(t))
        if f is None:
            f = self.mode.from_tensor(t)
            if t.requires_grad and not f.requires_grad:
                f.requires_grad_(True)
            self.fakes[id(t)] = f
            self.keep.append(t)
            try:
                self.real[int(f.untyped_storage()._cdata)] = int(t.untyped_storage().data_ptr())
            except Exception:
                pass
        return f

    def apply(self, modules: list[Any], optimizers: list[Any]) -> None:
        import torch

        seen = set()
        for root in modules:
            for m in root.modules():
                if id(m) in seen:
                    continue
                seen.add(id(m))
                for table in (m._parameters, m._buffers):
                    for name, t in list(table.items()):
                        if isinstance(t, torch.Tensor):
                            self.undo.append((table, name, t))
                            table[name] = self.fake(t)
        for opt in optimizers:
            for g in opt.param_groups:
                self.undo.append((g, "params", g["params"]))
                g["params"] = [self.fake(p) if isinstance(p, torch.Tensor) else p for p in g["params"]]
            state = opt.state
            if not isinstance(state, dict):
                continue
            new: dict[Any, Any] = defaultdict(dict)   # what Optimizer.__init__ makes
            for k, v in state.items():
                fk = self.fake(k) if isinstance(k, torch.Tensor) else k
                new[fk] = {n: self.fake(x) if isinstance(x, torch.Tensor) else x for n, x in v.items()} \
                    if isinstance(v, dict) else v
            self.undo.append((opt.__dict__, "state", state))
            opt.__dict__["state"] = new

    def restore(self) -> None:
        for table, name, value in reversed(self.undo):
            table[name] = value
        self.undo.clear()
        self.fakes.clear()
        self.keep.clear()


def _fake_args(mode: Any, value: Any, scale: Mapping[str, int], depth: int = 0) -> Any:
    """``value`` with its tensors replaced by fake ones.

    Inside lists, tuples and dicts, three levels deep, up to 1000 items each below the top; bigger
    containers are left as they are.
    """
    import torch

    if isinstance(value, torch.Tensor):
        k = int(scale.get("batch", 1))
        if k != 1 and value.dim() > 0:
            with mode:
                shape = (value.shape[0] * k,) + tuple(value.shape[1:])
                return torch.empty(shape, dtype=value.dtype, device=value.device).requires_grad_(value.requires_grad)
        return mode.from_tensor(value)
    if depth >= 3 or not isinstance(value, (list, tuple, dict)) or (depth and len(value) > 1000):
        return value
    if type(value) in (list, tuple):
        return type(value)(_fake_args(mode, v, scale, depth + 1) for v in value)
    if type(value) is dict:
        return {k: _fake_args(mode, v, scale, depth + 1) for k, v in value.items()}
    return value


def predict(fn: Any, *args: Any, scale: Optional[Mapping[str, int]] = None, **kwargs: Any) -> Any:
    """Predict the ops and memory of ``fn(*args, **kwargs)`` without running it.

    ``fn`` runs under ``FakeTensorMode`` inside ``trace()`` (the python engine): every op computes
    shapes, dtypes and strides only, so no memory is allocated and nothing is computed. The
    parameters, buffers and optimizer state ``fn`` can reach are swapped for fake copies while it
    runs and put back afterwards, untouched.

    Parameters
    ----------
    fn : callable
        The step to predict, e.g. a forward, backward and optimizer step.
    *args, **kwargs
        Its arguments; tensors among them (also inside lists, tuples and dicts) are made fake.
    scale : dict, optional
        ``{"batch": n}`` multiplies dimension 0 of every tensor argument by ``n`` (a batch never run).

    Returns
    -------
    Trace
        The same tables a real run records (``ops``, ``tensors`` with categories, ``memory``), so
        ``memory_at()``, ``module_memory`` and the summary work on it.

    Raises
    ------
    PredictionError
        An op whose output shape or value depends on the data (``nonzero``, ``.item()``), naming
        the op and the line.
    OptionsError
        ``scale`` has a key other than ``"batch"``.

    Examples
    --------
    >>> import torch, tensorscope
    >>> model = torch.nn.Linear(16, 16)
    >>> def step(x):
    ...     model(x).sum().backward()
    >>> p = tensorscope.predict(step, torch.randn(8, 16), scale={"batch": 4})
    >>> p.ops.column("op").to_pylist()[1], p.ops.column("in_shapes").to_pylist()[1]
    ('aten.addmm.default', [[16], [32, 16], [16, 16]])
    >>> model.weight.grad is None
    True
    """
    import torch
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

    from .recording.session import trace
    from .tracking import storages

    scale = dict(scale or {})
    unknown = set(scale) - {"batch"}
    if unknown:
        raise OptionsError(f"predict: scale knows 'batch' (dimension 0 of the tensor arguments), not {sorted(unknown)}")
    modules, optimizers = _state(fn, args, kwargs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swap = _Swap(mode)
    with torch._C.DisableTorchFunction():
        try:
            swap.apply(modules, optimizers)
        except BaseException:
            swap.restore()
            raise
    del modules, optimizers
    fargs: Any = None
    fkwargs: Any = None
    storages.fake.on = True
    storages.fake.real = swap.real
    try:
        fargs = _fake_args(mode, args, scale)
        fkwargs = _fake_args(mode, kwargs, scale)
        # the device queries FakeTensors dispatch (prim.device) are metadata, not ops: answered above
        with mode, trace(engine="python", leaks=False, nonfinite=False) as t, _DeviceQueries():
            fn(*fargs, **fkwargs)
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        op = getattr(e, "func", None)
        kind = "output shape" if isinstance(e, DynamicOutputShapeException) else "value"
        where = _user_line(e.__traceback__)
        raise PredictionError(f"predict: {op} has a data-dependent {kind}{where}: what follows it cannot be "
                              "known without running the step") from None
    finally:
        storages.fake.on = False
        storages.fake.real = None
        with torch._C.DisableTorchFunction():
            swap.restore()
        del fargs, fkwargs
    return _predicted(t.result)


def _predicted(res: Any) -> Any:
    """The trace of a prediction, its metadata saying so (``metadata["predicted"] = True``).

    Its times are FakeTensor dispatch, not the step's, so no timing-based finding is made from it.
    """
    from . import schema as S
    from ._trace import Trace

    return Trace({name: res.table(name) for name in S.RECORDED}, res.metadata.replace(predicted=True))


def _user_line(tb: Any) -> str:
    """Return ``" at file:line"`` of the innermost frame of the traceback outside torch and tensorscope."""
    import os

    import torch

    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    found = ""
    while tb is not None:
        fn = tb.tb_frame.f_code.co_filename
        if not fn.startswith(skip):
            found = f" at {os.path.basename(fn)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


class _DeviceQueries:
    """A dispatch mode above the trace's that answers ``prim.device`` for FakeTensors itself."""

    _cls: Any = None   # the mode's class, made once (a class made per call is a reference cycle)

    def __enter__(self) -> Any:
        if _DeviceQueries._cls is None:
            import torch
            from torch.utils._python_dispatch import TorchDispatchMode

            prim_device = torch.ops.prim.device.default

            class _Mode(TorchDispatchMode):
                def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                    if func is prim_device:
                        fd = getattr(args[0], "fake_device", None)
                        if fd is not None:
                            return fd
                    return func(*args, **(kwargs or {}))

            _DeviceQueries._cls = _Mode
        self._mode = _DeviceQueries._cls()
        return self._mode.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._mode.__exit__(*exc)
