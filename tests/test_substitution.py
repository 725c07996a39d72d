"""check_substitution on real subclasses: one that substitutes, and three that do not."""
from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map

import tensorscope
from tensorscope import schema as S


class Good(torch.Tensor):
    """A well-behaved as_subclass subclass: torch's default __torch_function__ keeps the type."""


class Plainifying(torch.Tensor):
    """__torch_function__ that runs func with subclass handling off: outputs come back plain."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class Double(torch.Tensor):
    """__torch_function__ that computes in float64: dtypes change and casts appear."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def up(x):
            return x.as_subclass(torch.Tensor).double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        with torch._C.DisableTorchFunctionSubclass():
            out = func(*tree_map(up, args), **tree_map(up, kwargs or {}))
        return tree_map(lambda o: o.as_subclass(cls) if isinstance(o, torch.Tensor) else o, out)


class Wrapper(torch.Tensor):
    """A _make_wrapper_subclass wrapper that forgets the inner tensor's strides (channels_last is lost)."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device,
                                                   requires_grad=elem.requires_grad)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def un(x):
            return x.elem if isinstance(x, Wrapper) else x

        out = func(*tree_map(un, args), **tree_map(un, kwargs or {}))
        return tree_map(lambda o: Wrapper(o) if isinstance(o, torch.Tensor) else o, out)


def f(x, w):
    y = torch.relu(x @ w + 1)
    return y.sum(dim=1), y.t()


def _kinds(r):
    return r.counts()


def test_well_behaved_subclass_substitutes():
    x, w = torch.randn(4, 5), torch.randn(5, 3)
    r = tensorscope.check_substitution(f, x, w, wrap=lambda t: t.as_subclass(Good))
    assert r.ok, r.to_text()
    assert r.table.schema.equals(S.SUBSTITUTION, check_metadata=False) and r.table.num_rows == 0
    assert r.subclass.endswith("Good")
    assert "no divergence" in r.to_text()
    # both runs traced the same ops; the inputs were not modified
    # (bookkeeping rows aside: the native engine also sees the aten.alias that re-wrapping each output
    # as the subclass runs, a real eager op no dispatch mode can see; it is noise, as detach is)
    def work(t):
        return [r["op"] for r in t.ops.select(["op", "is_noise"]).to_pylist() if not r["is_noise"]]

    assert work(r.plain) == work(r.wrapped)
    assert type(x) is torch.Tensor


def test_torch_function_returning_plain_tensors():
    x, w = torch.randn(4, 5), torch.randn(5, 3)
    r = tensorscope.check_substitution(f, x, w, wrap=lambda t: t.as_subclass(Plainifying))
    assert not r.ok
    assert _kinds(r) == {"lost_subclass": 2}       # both outputs; ops, dtypes and values are unchanged
    rows = r.table.to_pylist()
    # each row names the op that made the plain output (issue 29: it named only "output[0]")
    assert {(row["op"], row["call"]) for row in rows} == {("aten.sum.dim_IntList", "sum"), ("aten.t.default", "t")}
    assert {row["detail"].split(":")[0] for row in rows} == {"output[0]", "output[1]"}
    assert all(row["source_file"] == __file__ and row["source_line"] == f.__code__.co_firstlineno + 2 for row in rows)
    assert all("Plainifying" in row["plain"] for row in rows)
    assert f"aten.t.default in t: plain Plainifying expected → subclass torch.Tensor (test_substitution.py:" \
        f"{f.__code__.co_firstlineno + 2})" in r.to_text()


def test_subclass_that_changes_dtype():
    x, w = torch.randn(4, 5), torch.randn(5, 3)
    r = tensorscope.check_substitution(f, x, w, wrap=lambda t: t.as_subclass(Double))
    k = _kinds(r)
    assert k.get("op_appeared", 0) >= 1 and k.get("dtype", 0) >= 1
    rows = r.table.to_pylist()
    appeared = [row for row in rows if row["kind"] == "op_appeared"]
    assert all(row["op"] == "aten._to_copy.default" for row in appeared)
    mm = next(row for row in rows if row["kind"] == "dtype" and row["op"] == "aten.mm.default")
    assert (mm["plain"], mm["wrapped"]) == ("[float32]", "[float64]")
    assert mm["call"] == "matmul" and mm["source_file"] == __file__
    assert mm["source_line"] == f.__code__.co_firstlineno + 1
    out = [row for row in rows if row["kind"] == "dtype" and row["op"].startswith("output")]
    assert len(out) == 2 and out[0]["wrapped"] == "float64"
    # float64 results are within the default tolerance of the float32 ones: no value divergence
    assert "value" not in k


def test_wrapper_subclass_loses_channels_last():
    conv = torch.nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)

    def g(x):
        return conv(x).relu()

    r = tensorscope.check_substitution(g, x, wrap=Wrapper)
    rows = r.table.to_pylist()
    conv_row = next(row for row in rows if row["kind"] == "layout" and row["op"] == "aten.convolution.default")
    assert conv_row["plain"] == "[channels_last]" and conv_row["wrapped"] == "[contiguous]"
    assert "[144, 1, 24, 4]" in conv_row["detail"]
    assert any(row["kind"] == "input_layout" and row["op"] == "aten.convolution.default" for row in rows)
    out = next(row for row in rows if row["op"] == "output")
    assert (out["kind"], out["plain"], out["wrapped"]) == ("layout", "channels_last", "contiguous")
    # values were compared through the wrapper's inner tensor, and agree
    assert not any(row["kind"] == "value" for row in rows)
    html = r.to_html()
    assert "channels_last" in html and "<script" not in html


def test_inplace_and_exceptions_and_values():
    class OutOfPlace(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "add_":
                func = torch.Tensor.add
            return super().__torch_function__(func, types, args, kwargs or {})

    def h(x):
        y = x * 1
        y.add_(1)
        return y

    r = tensorscope.check_substitution(h, torch.randn(3), wrap=lambda t: t.as_subclass(OutOfPlace))
    k = _kinds(r)
    assert k.get("op_disappeared") == 1 and k.get("op_appeared") == 1 and k.get("value") == 1
    gone = next(row for row in r.table.to_pylist() if row["kind"] == "op_disappeared")
    assert gone["op"] == "aten.add_.Tensor" and gone["source_line"] == h.__code__.co_firstlineno + 2

    class Raises(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "relu":
                raise NotImplementedError("relu is not supported by <Raises>")
            return super().__torch_function__(func, types, args, kwargs or {})

    r = tensorscope.check_substitution(lambda x: torch.relu(x), torch.randn(3), wrap=lambda t: t.as_subclass(Raises))
    row = next(row for row in r.table.to_pylist() if row["kind"] == "exception")
    assert row["plain"] == "returned" and row["wrapped"].startswith("NotImplementedError")
    assert "&lt;Raises&gt;" in r.to_html() and "<Raises>" not in r.to_html()


def test_same_randomness_in_both_runs_and_rng_advanced_once():
    def noisy(x):
        return x + torch.randn_like(x)

    x = torch.randn(6)
    torch.manual_seed(7)
    r = tensorscope.check_substitution(noisy, x, wrap=lambda t: t.as_subclass(Good))
    after = torch.randn(3)
    torch.manual_seed(7)
    noisy(x)
    assert torch.equal(after, torch.randn(3))
    assert r.ok, r.to_text()


def test_bad_arguments_are_clear():
    with pytest.raises(TypeError, match="wrap must be callable"):
        tensorscope.check_substitution(f, torch.randn(2, 2), torch.randn(2, 2), wrap=None)
    with pytest.raises(TypeError, match="fn must be callable"):
        tensorscope.check_substitution(3, wrap=lambda t: t)


def test_gradients_are_compared_when_fn_runs_backward():
    class DetachingGrad(torch.Tensor):
        """Multiplication goes through .detach() on the subclass: the gradient never reaches the input."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("mul", "__mul__"):
                args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            return super().__torch_function__(func, types, args, kwargs or {})

    def train_step(x, w):
        loss = (x * 3 + w).sum()
        loss.backward()
        return loss.detach()

    x = torch.randn(4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    good = tensorscope.check_substitution(train_step, x, w, wrap=lambda t: t.as_subclass(Good))
    assert good.ok, good.to_text()
    assert x.grad is None and w.grad is None            # the caller's tensors are untouched
    bad = tensorscope.check_substitution(train_step, x, w, wrap=lambda t: t.as_subclass(DetachingGrad))
    rows = [r for r in bad.table.to_pylist() if r["kind"] == "grad"]
    assert [(r["op"], r["plain"], r["wrapped"]) for r in rows] == [("grad[0]", "computed", "none")]


def test_wrapper_subclass_gradients_are_unwrapped_and_compared():
    lin = torch.nn.Linear(4, 3)

    def step(x):
        out = lin(x).relu().sum()
        out.backward()
        return out.detach()

    x = torch.randn(2, 4, requires_grad=True)
    r = tensorscope.check_substitution(step, x, wrap=Wrapper)
    assert not any(row["kind"] in ("grad", "value") for row in r.table.to_pylist()), r.to_text()


def test_wrapper_with_wrong_strides_makes_reshape_take_the_view_path_and_fail():
    def f(x):
        return x.t().reshape(-1)

    r = tensorscope.check_substitution(f, torch.randn(3, 4), wrap=Wrapper)
    rows = r.table.to_pylist()
    kinds = {row["kind"] for row in rows}
    # the wrapper reports t()'s output as contiguous, so reshape views it and the inner view raises
    t_row = next(row for row in rows if row["kind"] == "layout" and row["op"] == "aten.t.default")
    assert (t_row["plain"], t_row["wrapped"]) == ("[strided]", "[contiguous]")
    exc = next(row for row in rows if row["kind"] == "exception")
    assert exc["plain"] == "returned" and exc["wrapped"].startswith("RuntimeError: view size is not compatible")
    assert exc["op"] == "aten.view.default"
    # storage identity is unknown for wrappers and the failing op has no outputs: neither is a divergence
    assert "aliasing" not in kinds and "shape" not in kinds and "dtype" not in kinds
