"""The native screen's proofs (native/engine_known.h) never change a finding.

The native engine records an op's outputs as finite without reading them when what it knows of
the inputs bounds them (an optimizer's ``add_``/``mul_`` on parameters it read before). Each case
here runs under both engines; the python engine reads every output, so every column (the
``nonfinite`` count and ``nonfinite_produced`` included) must agree, and the cases check that the
proofs really ran (``proven`` > 0) where they should.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.recording.test_engines import _native_available, _trace, both


@pytest.fixture(scope="module", autouse=True)
def _need_native():
    ok, reason = _native_available()
    if not ok:
        pytest.skip(f"native engine unavailable: {reason}")


def _findings(t):
    return [(r["op"], r["nonfinite"], r["nonfinite_produced"]) for r in t.ops.to_pylist() if r["nonfinite"]]


def _proven(t):
    return t.metadata["nonfinite_screen"].get("proven", 0)


def _sgd_steps(poison):
    """Four SGD-with-momentum steps on a small net; ``poison(step, model)`` may corrupt something."""
    def run():
        torch.manual_seed(0)
        # big enough to be proven (engine_known.h kProveMin: smaller tensors are simply read)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(64, 64)
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            poison(step, model)
            opt.step()
    return run


def test_optimizer_steps_are_proven_and_agree():
    tp, tn, _ = both(_sgd_steps(lambda step, model: None))
    assert _findings(tn) == [] and _proven(tn) > 0


@pytest.mark.parametrize("how", ["grad_index", "data_alias", "view_write", "param_data_set"])
def test_a_write_after_what_was_known_is_seen(how):
    def poison(step, model):
        if step != 2:
            return
        w = model[0].weight
        with torch.no_grad():
            if how == "grad_index":
                w.grad[0, 0] = float("inf")          # a write to a tensor the screen knew finite
            elif how == "data_alias":
                w.data[1, 1] = float("nan")          # through .data: another impl, its own version counter
            elif how == "view_write":
                w.view(-1)[3] = float("-inf")        # through a view: the same storage
            else:
                w.data = torch.full_like(w, float("nan"))   # the parameter now shows other memory

    tp, tn, _ = both(_sgd_steps(poison))
    found = _findings(tn)
    assert found and found == _findings(tp)
    assert any(op in ("aten.add_.Tensor", "aten.mul_.Tensor", "aten.addmm.default", "aten.mm.default")
               for op, _, _ in found)


def test_bounds_that_could_overflow_are_screened():
    n = 4096   # engine_known.h kProveMin: smaller tensors are read, never proven

    def run():
        x = torch.full((n,), 3e37)
        y = x * 2                    # a bound of 6e37 is too close to float32's 3.4e38: read
        z = y * 10                   # overflows
        h = torch.full((n,), 0.5, dtype=torch.float16)
        h.sum()                      # 2048: fine in float16 (read: the bound's margin is larger)
        (h * 1e5).sum()              # each product is finite, their sum overflows float16
        torch.full((n,), 60.0, dtype=torch.float16).sum()   # the sum overflows float16
        a = torch.full((64, 64), 1e20)
        a @ a                        # 64 * 1e40: inf
        z.relu()                     # inf in: propagated, not produced
        torch.ones(n).add_(z)
        torch.zeros(n).mul_(float("inf"))   # 0 * inf: nan from a scalar argument

    tp, tn, _ = both(run)
    found = {(op, k): prod for op, k, prod in _findings(tn)}
    assert found == {(op, k): prod for op, k, prod in _findings(tp)}
    assert found[("aten.mul.Tensor", n)] is True
    assert ("aten.mm.default", n) in found
    assert [op for op, _k, _p in _findings(tn)].count("aten.sum.default") == 2
    assert found[("aten.relu.default", n)] is False


def test_chains_of_proven_ops_keep_their_bound():
    def run():
        torch.manual_seed(0)
        x = torch.randn(64, 64)
        y = x.clone()
        for _ in range(30):
            y = y * 100.0            # the bound grows 100x per step: proven while far below the limit
        y.sum()

    tp, tn, _ = both(run)
    found = _findings(tn)
    assert found == _findings(tp) and found
    first = found[0]
    assert first[0] == "aten.mul.Tensor" and first[2] is True
    assert _proven(tn) > 0


def test_counts_match_the_python_engine_on_mixed_dtypes():
    def run():
        torch.manual_seed(0)
        a = torch.randn(8, 8, dtype=torch.float64)
        b = a.to(torch.float16) * 1e4             # overflows float16 where |a| > 6.55
        c = a.to(torch.bfloat16) * 1e30
        (c * 1e10).float()
        torch.cat([b, b.abs().neg()]).clone()
        torch.where(a > 0, a, a * 1e308 * 10)

    tp, tn, _ = both(run)
    assert _findings(tn) == _findings(tp) and _findings(tn)


def test_a_freed_storage_reused_at_the_same_address_is_not_known():
    """A loop over fresh buffers of one size: the allocator may hand the next one the freed one's
    StorageImpl and data addresses. What was known of the old one (finite) must not prove the new
    one, whose NaN came from outside any op (NumPy)."""
    x = torch.ones(256)
    arrs = [np.full(256, np.nan if i % 2 else 1.0, np.float32) for i in range(8)]

    def run():
        for a in arrs:
            y = x * 2                 # learnt finite at version 0
            y.sum()
            del y                     # freed: its TensorImpl, StorageImpl and buffer may be reused...
            z = torch.from_numpy(a)   # ...by this tensor, made by no op (NaN every other time)
            z.relu()
            del z

    # from_numpy's lift_fresh makes a calls row only the python engine has (its dispatch mode calls
    # the op from Python): the ops and their findings are compared, not the calls
    tp, tn = _trace("python", run), _trace("native", run)
    found = _findings(tn)
    assert found and found == _findings(tp)
    assert [op for op, _, _ in found] == ["aten.relu.default"] * 4


def test_means_are_proven_only_when_their_sum_cannot_overflow():
    def run():
        torch.full((1000,), 1e36).mean()          # the sum overflows float32: inf
        torch.full((1000,), 1e36).mean(dim=0)
        torch.ones(0).mean()                      # empty: NaN
        torch.ones(4, 0).mean(dim=1)              # empty rows: NaN
        torch.full((8,), 3.0).mean()              # fine

    tp, tn, _ = both(run)
    found = _findings(tn)
    assert found == _findings(tp)
    assert [op for op, _, _ in found] == ["aten.mean.default", "aten.mean.dim", "aten.mean.default", "aten.mean.dim"]


@pytest.mark.parametrize("poisoned", [False, True])
def test_a_small_input_nothing_is_known_of_is_read_to_prove_the_output(poisoned):
    """A conv's weight (made before the trace: unknown) is read when it is small beside the
    activations; the output is then proven. A NaN in that weight is found, as the python engine does."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    if poisoned:
        with torch.no_grad():
            conv.weight[2, 1, 0, 0] = float("nan")
    x = torch.randn(4, 3, 32, 32)

    def run():
        y = conv(x * 1.0)           # an activation the screen read: known
        y.relu().sum().backward()

    tp, tn = _trace("python", run), _trace("native", run)
    assert _findings(tn) == _findings(tp)
    assert tn.metadata["nonfinite_screen"]["inputs_screened"] > 0
    if poisoned:
        assert _findings(tn)[0][0] == "aten.convolution.default"
    else:
        assert _findings(tn) == [] and _proven(tn) > 0


@pytest.mark.parametrize("poisoned", [False, True])
def test_conv_backward_reads_the_weight_its_gradient_replaces(poisoned):
    """convolution_backward reads an unknown weight (its gradient, the same size, is then proven),
    so the optimizer's in-place update of that weight needs no read before it: only the momentum
    buffer (and its scalar) are read first. A NaN in the weight is found as the python engine finds it."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1, bias=False)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2, 64, 8, 8)

    def step():
        opt.zero_grad(set_to_none=True)
        (conv(x * 1.0) * 1.0).sum().backward()
        opt.step()

    step()   # the momentum buffer exists before the trace
    if poisoned:
        with torch.no_grad():
            conv.weight[3, 2, 1, 1] = float("nan")
    tp, tn = _trace("python", step), _trace("native", step)
    assert _findings(tn) == _findings(tp)
    screen = tn.metadata["nonfinite_screen"]
    if poisoned:
        assert _findings(tn)[0][0] == "aten.convolution.default"
    else:
        assert _findings(tn) == []
        assert screen["inputs_screened"] >= 1 and screen["pre_screened"] <= 2 and _proven(tn) > 0
