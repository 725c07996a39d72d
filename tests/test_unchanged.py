"""Tracing never changes the program: outputs, RNG, exceptions, references, global state."""
from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

import tensorscope
from tests.helpers import cycles


class EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _programs():
    def mlp():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
        x = torch.randn(8, 16)
        y = m(x)
        y.sum().backward()
        return [y, m[0].weight.grad, m[3].bias.grad]

    def conv():
        torch.manual_seed(1)
        c = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        bn = torch.nn.BatchNorm2d(4)
        x = torch.randn(2, 3, 9, 9).to(memory_format=torch.channels_last)
        y = torch.nn.functional.max_pool2d(bn(c(x)), 2)
        return [y, y.softmax(1), y.flatten(1)]

    def misc():
        torch.manual_seed(2)
        a = torch.randn(5, 5, dtype=torch.float64)
        b = torch.randn(5, 5).half()
        out = [a @ a.t(), torch.linalg.solve(a + 5 * torch.eye(5, dtype=a.dtype), a), b.float() + 1,
               torch.cumsum(a, 0), a.sort(1).values, torch.where(a > 0, a, -a), a.t().reshape(-1)]
        z = torch.zeros(3)
        z.add_(torch.ones(3)).mul_(2)
        torch.add(z, 1, out=z)
        out.append(z)
        return out

    def rng():
        torch.manual_seed(3)
        x = torch.rand(10)
        d = torch.nn.functional.dropout(torch.ones(100), 0.5, training=True)
        return [x, d, torch.randn(3), torch.randint(0, 10, (5,)), torch.multinomial(torch.ones(4), 2)]

    return {"mlp": mlp, "conv": conv, "misc": misc, "rng": rng}


@pytest.mark.parametrize("name", list(_programs()))
def test_outputs_bitwise_identical(name):
    prog = _programs()[name]
    ref = prog()
    with tensorscope.trace():
        got = prog()
    with tensorscope.trace(numerics="fp32"):   # shadow mode must not change results either
        got2 = prog()
    for a, b, c in zip(ref, got, got2):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b) and torch.equal(a, c), name


def test_linalg_composites_match_an_empty_mode():
    # any dispatch mode reroutes these; compare the python engine against an empty
    # mode (the native engine has no mode on the stack: tests/recording/test_engines.py compares it with eager)
    torch.manual_seed(0)
    a = torch.randn(6, 6)
    with EmptyMode():
        ref = [torch.linalg.svdvals(a), torch.linalg.matrix_norm(a, ord=2), torch.linalg.cond(a),
               torch.linalg.eigvalsh(a + a.t())]
    with tensorscope.trace(engine="python"):
        got = [torch.linalg.svdvals(a), torch.linalg.matrix_norm(a, ord=2), torch.linalg.cond(a),
               torch.linalg.eigvalsh(a + a.t())]
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def test_empty_ops_compare_by_metadata():
    ref = torch.empty(3, 4, dtype=torch.float16)
    with tensorscope.trace():
        got = torch.empty(3, 4, dtype=torch.float16)
    assert (ref.shape, ref.dtype, ref.stride()) == (got.shape, got.dtype, got.stride())


def test_no_rng_drawn():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with tensorscope.trace(numerics="fp32"):
        x = torch.ones(8, 8).half() @ torch.ones(8, 8).half()
        y = x.float().relu().sum()
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(123)
    a = torch.rand(4)
    torch.manual_seed(123)
    with tensorscope.trace():
        b = torch.rand(4)
    assert torch.equal(a, b)


def test_trace_holds_no_reference_to_user_tensors():
    """Not even in a reference cycle: in eager ``del`` frees a tensor at once, so it must traced too
    (with the collector off, nothing only a collection would free may hold it)."""
    x = torch.randn(64, 64, requires_grad=True)
    refs = []
    with cycles.no_collector():
        with tensorscope.trace() as t:
            y = (x @ x).relu()
            z = y.sum()
            z.backward()
            refs = [weakref.ref(y), weakref.ref(z)]
            storage_ref = weakref.ref(y.untyped_storage())
        del y, z
        assert all(r() is None for r in refs)
        assert storage_ref() is None, "the trace keeps a storage alive"
    # nothing in the Trace's object graph is a tensor or storage
    seen, stack = set(), [t.result]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        assert not isinstance(o, (torch.Tensor, torch.UntypedStorage)), type(o)
        if isinstance(o, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
            continue   # code and classes, not data the trace holds
        if isinstance(o, (dict, list, tuple, set)) or hasattr(o, "__dict__"):
            stack.extend(gc.get_referents(o))


def test_no_extra_detach_after_factory_ops():
    # holding an output inside __torch_dispatch__ makes autograd insert aten.detach
    with tensorscope.trace() as t:
        a = torch.zeros(3)
        b = torch.ones(3)
        c = a + b
    ops = [r["op"] for r in t.ops.to_pylist()]
    assert "aten.detach.default" not in ops, ops


def test_user_exception_propagates_unchanged_and_is_recorded():
    a = torch.randn(3)
    b = torch.randn(4)
    with pytest.raises(RuntimeError) as plain:
        a + b
    with pytest.raises(RuntimeError) as traced:
        with tensorscope.trace() as t:
            a + b
    assert type(traced.value) is type(plain.value) and str(traced.value) == str(plain.value)
    err = t.errors.to_pylist()
    assert err and err[0]["kind"] == "exception" and err[0]["py_type"] == "RuntimeError"
    assert err[0]["op"] == "aten.add.Tensor" and err[0]["source_file"] == __file__
    assert err[0]["call_id"] is not None and err[0]["message"] == str(plain.value).split("\n")[0] or \
        str(plain.value).startswith(err[0]["message"])
    op_row = t.ops.to_pylist()[err[0]["seq"]]
    assert op_row["error_id"] == err[0]["error_id"]
    call = t.calls.to_pylist()[err[0]["call_id"]]
    assert call["error_id"] == err[0]["error_id"]


def test_exception_before_dispatch_recorded_at_call_level():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        with tensorscope.trace() as t:
            x.add_(1)
    err = t.errors.to_pylist()
    # raised in the autograd layer: the python engine's dispatch mode (below autograd) never
    # sees the op; the native observer (above it) records the op row and links the error to it
    expected_op = "aten.add_.Tensor" if t.metadata["engine"] == "native" else None
    assert err and err[0]["op"] == expected_op and err[0]["call_id"] is not None
    with pytest.raises(TypeError):
        with tensorscope.trace() as t2:
            torch.add(x, "nope")
    assert t2.errors.to_pylist()[0]["py_type"] == "TypeError"


def test_pure_python_exception_in_block_recorded():
    with pytest.raises(KeyError):
        with tensorscope.trace() as t:
            torch.ones(2) + 1
            {}["missing"]
    e = t.errors.to_pylist()[-1]
    assert e["py_type"] == "KeyError" and e["source_file"] == __file__


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_state_restored_after_errors_and_keyboardinterrupt(exc):
    from torch.nn.modules import module as _mod

    hooks = (len(_mod._global_forward_pre_hooks), len(_mod._global_forward_hooks))
    lin = torch.nn.Linear(2, 2)

    class Boom(torch.nn.Module):
        def forward(self, x):
            raise exc

    with pytest.raises(type(exc)):
        with tensorscope.trace():
            lin(torch.randn(1, 2))
            torch.nn.Sequential(Boom())(torch.randn(1, 2))
    assert _get_current_dispatch_mode_stack() == [] and _get_current_function_mode_stack() == []
    assert (len(_mod._global_forward_pre_hooks), len(_mod._global_forward_hooks)) == hooks
    assert tensorscope.last().errors.num_rows >= 1
    with tensorscope.trace() as t:   # a new trace works afterwards
        lin(torch.randn(1, 2))
    assert t.ops.num_rows > 0 and all(m is None or m.startswith("<Linear") or m == "" for m in
                                      t.ops.column("module").to_pylist())


def test_user_mode_left_on_the_stack_is_kept():
    m = EmptyMode()
    with tensorscope.trace():
        m.__enter__()
    assert _get_current_dispatch_mode_stack() == [m]
    m.__exit__(None, None, None)


def test_tracer_bug_never_reaches_user_code(monkeypatch):
    from tensorscope.recording.engines.python import dispatch

    def broken(*a, **k):
        raise ZeroDivisionError("tracer bug")

    monkeypatch.setattr(dispatch.TracingDispatchMode, "_append", broken)
    x = torch.randn(3)
    with pytest.warns(RuntimeWarning, match="internal error"):
        import tensorscope.recording.session as S

        monkeypatch.setattr(S, "_warned_tracer_bug", False)
        with tensorscope.trace(engine="python") as t:   # the native engine's twin: tests/recording/test_engines.py
            y = x * 2
    assert torch.equal(y, x * 2)
    assert t.metadata["tracer_errors"] >= 1


def test_two_caught_exceptions_in_turn_are_both_recorded():
    # CPython reuses a freed exception's id: dedupe must not swallow the second one
    x = torch.randn(3, requires_grad=True)
    with tensorscope.trace() as t:
        for _ in range(2):
            try:
                torch.randn(3) + torch.ones(4)
            except RuntimeError:
                pass
            try:
                x.add_(1)
            except RuntimeError:
                pass
    kinds = [(e["py_type"], e["op"]) for e in t.errors.to_pylist() if e["kind"] == "exception"]
    assert kinds.count(("RuntimeError", "aten.add.Tensor")) == 2
    # the leaf in-place error is raised in the autograd layer: see the test above
    leaf_op = "aten.add_.Tensor" if t.metadata["engine"] == "native" else None
    assert kinds.count(("RuntimeError", leaf_op)) == 2
