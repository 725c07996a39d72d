"""torch's fused fast paths run traced as they do in eager (recording/fastpaths.py).

``nn.TransformerEncoder``/``TransformerEncoderLayer`` and ``nn.MultiheadAttention`` in inference take a
fused kernel only when ``torch.overrides.has_torch_function`` is false, and any TorchFunctionMode made it
true: under a trace they ran the unfused ops, whose output differed from eager's in the last bits
(7e-7 on a 2-layer encoder). Now the trace records the fused op eager runs, with eager's bits; a user's
own function mode still turns the fast path off, as it does untraced; the original function is back
after every trace."""
from __future__ import annotations

import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

import tensorscope

ENGINES = ("native", "python")
ORIGINAL = torch.overrides.has_torch_function


def _models():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    return enc, mha, torch.randn(2, 7, 64), torch.randn(2, 5, 32)


def _run(enc, mha, x, q):
    with torch.inference_mode():
        return enc(x), mha(q, q, q)[0]


def _eager_ops(fn) -> set[str]:
    """The ATen ops eager runs at the top of the dispatcher (torch.profiler, no mode on the stack)."""
    from torch.profiler import profile
    with profile() as p:
        fn()
    return {e.name for e in p.events()}


@pytest.mark.parametrize("engine", ENGINES)
def test_inference_takes_the_fused_fast_path_with_eager_bits(engine):
    enc, mha, x, q = _models()
    want = _run(enc, mha, x, q)
    assert {"aten::_transformer_encoder_layer_fwd", "aten::_native_multi_head_attention"} <= _eager_ops(
        lambda: _run(enc, mha, x, q))
    with tensorscope.trace(engine=engine) as t:
        got = _run(enc, mha, x, q)
    for a, b in zip(want, got):
        assert torch.equal(a, b)                       # bit for bit
    ops = set(t.ops.column("op").cast("string").to_pylist())
    assert {"aten._transformer_encoder_layer_fwd.default", "aten._native_multi_head_attention.default"} <= ops
    assert "aten.addmm.default" not in ops             # not the unfused path
    assert torch.overrides.has_torch_function is ORIGINAL


class _Watch(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_users_function_mode_still_turns_the_fast_path_off_as_untraced(engine):
    enc, mha, x, q = _models()
    with _Watch():
        want = _run(enc, mha, x, q)                    # eager beside a mode: the unfused path
        with tensorscope.trace(engine=engine) as t:
            got = _run(enc, mha, x, q)
    ops = set(t.ops.column("op").cast("string").to_pylist())
    assert "aten._transformer_encoder_layer_fwd.default" not in ops and "aten.addmm.default" in ops
    if t.metadata["engine"] == "python":   # docs/guide/engines.md, known differences: any dispatch mode does it
        assert not torch.equal(want[1], got[1]), "the python engine's MultiheadAttention now has eager's bits"
        return
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_an_override_on_an_argument_still_counts_and_other_threads_are_unchanged():
    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    plain, sub = torch.ones(2), torch.ones(2).as_subclass(Sub)
    seen = {}
    with tensorscope.trace():
        assert torch.overrides.has_torch_function((plain,)) is False   # only tensorscope's mode: as eager
        assert torch.overrides.has_torch_function((sub,)) is True
        th = threading.Thread(target=lambda: seen.update(other=torch.overrides.has_torch_function((plain,))))
        th.start()
        th.join()
    assert seen["other"] is False
    assert torch.overrides.has_torch_function is ORIGINAL


@pytest.mark.parametrize("engine", ENGINES)
def test_the_original_is_back_after_an_exception_and_an_interrupt(engine):
    with pytest.raises(ValueError), tensorscope.trace(engine=engine):
        assert torch.overrides.has_torch_function is not ORIGINAL
        raise ValueError("user error")
    assert torch.overrides.has_torch_function is ORIGINAL
    with pytest.raises(KeyboardInterrupt), tensorscope.trace(engine=engine):
        raise KeyboardInterrupt
    assert torch.overrides.has_torch_function is ORIGINAL
