"""``tensorscope.predict``: the step under FakeTensorMode gives the live bytes of a real trace op for op
(conv net, MLP, transformer block), a bigger batch it did not run, leaves the program as it was, and
names the op it cannot predict."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tensorscope
from tests.analyses.test_memory_categories import TBlock, resnet


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


WORKLOADS = {
    "conv": (resnet, lambda: torch.randn(4, 3, 8, 8)),
    "mlp": (mlp, lambda: torch.randn(8, 16)),
    "transformer": (lambda: TBlock(ckpt=False), lambda: torch.randn(2, 6, 16)),
}


def _setup(name):
    make, data = WORKLOADS[name]
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(data())   # a training loop's second step: momentum buffers exist
    return model, opt, step, data


def _live(t):
    return t.memory.column("live_bytes").to_pylist()


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_prediction_equals_the_real_trace_op_for_op(name):
    model, opt, step, data = _setup(name)
    x = data()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: {n: v.clone() for n, v in st.items()} for k, st in opt.state.items()}
    buffers = [b.clone() for b in model.buffers()]
    p = tensorscope.predict(step, x)
    # nothing of the program changed: weights, buffers (BatchNorm's running stats), .grad, optimizer state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))
    assert all(q.grad is None for q in model.parameters())
    assert all(torch.equal(state[k][n], v) for k, st in opt.state.items() for n, v in st.items())
    assert all(type(v) is torch.Tensor for st in opt.state.values() for v in st.values())
    with tensorscope.trace(engine="python") as real:
        step(x)
    assert p.ops.column("op").to_pylist() == real.ops.column("op").to_pylist()
    assert _live(p) == _live(real)
    assert p.tensors.column("category").to_pylist() == real.tensors.column("category").to_pylist()
    pk = [r for r in p.memory_timeline.to_pylist() if r["is_peak"]]
    rk = [r for r in real.memory_timeline.to_pylist() if r["is_peak"]]
    assert [(r["seq"], r["live_bytes"], r["op"], r["module"]) for r in pk] == \
        [(r["seq"], r["live_bytes"], r["op"], r["module"]) for r in rk]
    with tensorscope.trace() as native:   # the default engine: same storages, same peak
        step(x)
    assert max(_live(native)) == max(_live(p))


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_a_bigger_batch_not_run(name):
    model, opt, step, data = _setup(name)
    x = data()
    big = tensorscope.predict(step, x, scale={"batch": 4})
    small = tensorscope.predict(step, x)
    assert max(_live(big)) > max(_live(small))
    act = [sum(n for n, c in zip(t.tensors.column("nbytes").to_pylist(), t.tensors.column("category").to_pylist())
               if c == "activation") for t in (small, big)]
    assert act[1] == 4 * act[0]   # activations scale with the batch; parameters do not
    # ... and it is what running that batch takes
    x4 = torch.randn((x.shape[0] * 4,) + tuple(x.shape[1:]))
    with tensorscope.trace(engine="python") as real:
        step(x4)
    assert _live(big) == _live(real)


def test_a_data_dependent_op_is_named():
    model, opt, step, data = _setup("mlp")

    def masked(x):
        return model(x[x > 0].reshape(-1, 16)).sum()

    with pytest.raises(tensorscope.prediction.PredictionError, match=r"aten\.nonzero.*data-dependent output shape at test_predict\.py:\d+"):
        tensorscope.predict(masked, data())

    def scalar(x):
        return float(model(x).sum())

    with pytest.raises(tensorscope.prediction.PredictionError, match=r"_local_scalar_dense.*data-dependent value"):
        tensorscope.predict(scalar, data())
    assert all(q.grad is None for q in model.parameters())


def test_bad_scale_is_a_clear_error():
    model, opt, step, data = _setup("mlp")
    with pytest.raises(ValueError, match="scale knows 'batch'"):
        tensorscope.predict(step, data(), scale={"seq": 2})


def test_no_real_memory_is_allocated():
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096)   # the step would take ~1 GiB of activations at this batch
    x = torch.randn(2, 4096)

    def step(x):
        F.relu(model(x)).square().mean().backward()

    t = tensorscope.predict(step, x, scale={"batch": 16384})
    assert max(_live(t)) > 2 ** 30
    assert model.weight.grad is None
